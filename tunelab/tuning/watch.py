"""Retune for auto-loaded jobs: a training job that loaded its tuned profile keeps watching it.

With the ``retune`` setting (``TUNELAB_RETUNE=1``, or ``retune=True`` to ``tunelab.torch.init`` or ``tunelab.tensorflow.init``), a job whose
framework adapter loaded a stored profile hands every finished training step to :class:`ProfileWatch`
(``Runtime.step_done``).  Rank 0 times the steps and feeds a tuning driver started *locked* on the
loaded knobs (:meth:`.driver.Driver.watching`): its first blocks set the interval watched, and when
step time leaves it for ``watch_sustain`` blocks in a row, a check measures the loaded knobs between two
blocks of the default.  Where their ratio still holds the gain the profile claims, the host moved and
the watch goes on; else the search re-opens, warm-started from the profile's stored trials, with the
default as the reference, then locks again and goes on watching.
New knobs go to the coordinator on rank 0, which every rank applies at the same cycle, so the other
ranks take no part and a step costs them nothing.

What a retune measures goes back to the profile store (:class:`StoreWriter`): its blocks as trials of
the profile (references as the default's), and each new lock as the profile's best, with its gain
interval and the outcome ``retuned: ...``; so the next job loads what this one found, and the next
search starts warm from these trials.  A store that cannot be written is said once, and the job
trains on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ..knobs import Knobs
from .driver import Driver
from .plan import Decision, Plan, Sample
from .result import evidence, outcome, record_sample, search_run_id
from .space import SearchSpace
from .stats import Interval
from .strategies import Observation, Told, make_strategy

WATCH_PLAN = Plan(retune=True)


class ProfileWatch:
    def __init__(self, coordinator: Any, space: SearchSpace, loaded: Knobs, stored: list[Observation] | None = None,
                 plan: Plan | None = None, strategy: str = "tunelab", seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 say: Callable[[str], None] = lambda line: print(line, flush=True),
                 writer: StoreWriter | None = None, key: tuple[str, str] | None = None,
                 interval: Interval | None = None, samples_per_step: float = 1.0) -> None:
        """``samples_per_step``: the samples one training step holds over all ranks, which turns the
        steps timed into the samples/s the store keeps (1: scores are steps/s)."""
        self.coordinator, self.clock, self.say, self.writer = coordinator, clock, say, writer
        self.key = key  # the watched model's (signature, framework): Runtime.step_done passes only its steps
        self.steps = 0  # steps handed to the watch
        stored = stored or []

        def strategy_of(epoch: int) -> Told:
            made = make_strategy(strategy, space, seed + 1000 * epoch)
            if epoch == 1 and stored:
                made.warm_start(stored)
            return made

        self.driver = Driver.watching(space, strategy_of, loaded, plan or WATCH_PLAN,
                                      on_sample=writer.sample if writer is not None else None, interval=interval,
                                      samples_per_step=samples_per_step)
        self._last: float | None = None
        self._epoch, self._locks, self._checks = 0, 1, 0

    def step_done(self) -> None:
        """One training step finished (rank 0 only; the first call only starts the clock).  An error
        here ends the watch (the caller stops calling): where it struck in a search or a check, the last
        locked configuration is asked for again first, so that the job does not train on for good with
        whatever candidate the search was measuring."""
        try:
            self._step_done()
        except BaseException:
            if self.driver.tuning and self.driver.locked is not None:
                with contextlib.suppress(Exception):
                    self.coordinator.set_knobs(self.driver.locked)
            raise

    def _step_done(self) -> None:
        self.steps += 1
        now = self.clock()
        if self._last is None:
            self._last = now
            return
        knobs = self.driver.step_done(now - self._last)
        if knobs is not None:
            self.coordinator.set_knobs(knobs)
        self._report()
        self._last = self.clock()  # (the decision and the store's writes are not the next step's)

    def _report(self) -> None:
        d = self.driver
        checked = ""
        if len(d.checks) != self._checks:
            self._checks = len(d.checks)
            c = d.checks[-1]
            if not c.moved:
                self.say(f"tunelab: retune: step time moved, but the locked configuration still leads the default "
                         f"({c.ratio:.3f}x, claimed {c.claimed:.3f}x): the host moved, not the optimum; watching on")
            else:
                checked = f" and a check measured it at {c.ratio:.3f}x the default, where {c.claimed:.3f}x was claimed"
        if d.epoch != self._epoch:
            self._epoch = d.epoch
            self.say(f"tunelab: retune: step time left the locked configuration's interval{checked}; "
                     "re-opening the search")
        if len(d.decisions) != self._locks:
            self._locks = len(d.decisions)
            last = d.decisions[-1]
            what = f"{last.interval.text()} over the default" if last.interval and last.adopted else "default kept"
            saved = self.writer.lock(d, last) if self.writer is not None else ""
            self.say(f"tunelab: retune: locked again after {last.samples} blocks ({what}){saved}")


class StoreWriter:
    """A retune's blocks and locks, written to profile ``profile_id`` of ``store`` (rank 0)."""

    def __init__(self, store: Any, profile_id: int, run_id: str,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.store, self.profile_id, self.run_id, self.say = store, profile_id, run_id, say
        self.broken = False

    def sample(self, s: Sample) -> None:
        """A measured block: trials are the retune's blocks, not the watched blocks of the loaded knobs."""
        if s.role == "locked" or (s.epoch == 0 and s.phase != "check"):  # (a check's blocks, from the first
            return                                                          # re-open's, say why it re-opened)
        self._write(lambda: record_sample(self.store, self.profile_id, self.run_id, s))

    def lock(self, driver: Driver, d: Decision) -> str:
        """The new lock as the profile's best; returns what to add to the line said (or "")."""
        refs = [s for s in driver.samples if s.epoch == d.epoch and s.role == "reference"]
        mine = evidence(driver, d)
        if not refs or not mine:
            return ""
        default = sum(s.score for s in refs) / len(refs)
        score = sum(s.score for s in mine) / len(mine)
        spread = sum(s.spread for s in mine) / len(mine)
        iv = d.interval if d.adopted else None
        ok = self._write(lambda: self.store.set_best(
            self.profile_id, d.knobs.as_dict(), score, default, spread, search_run_id(self.run_id, d.epoch),
            gain_interval=(iv.gain, iv.low, iv.high) if iv is not None else None, steps=d.steps, outcome=outcome(d)))
        return f"; saved to profile {self.profile_id}" if ok else ""

    def _write(self, write: Callable[[], object]) -> bool:
        if self.broken:
            return False
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - a store that fails must not stop training
            self.broken = True
            self.say(f"tunelab: warning: retune results not saved to the profile store ({exc}); training goes on")
            return False
        return True


def stored_claim(best: Any, trials: list[Any], loaded: Knobs, base: Knobs) -> Interval | None:
    """The gain over the default a stored ``best`` claims for the job's ``loaded`` knobs, which a check
    holds them to before a search re-opens; None (the watch re-opens unchecked) where the claim does not
    speak of this job: it runs other values of the knobs the best names (pinned here, not there), or the
    default the claim was measured against (its run's default blocks, in ``trials``) is not this job's
    ``base`` (a pin then, a default changed since).  A knob the best does not name runs alike in the
    check's default and loaded blocks, so the check still compares what the claim compared."""
    from ..knobs import stored_knobs

    if best is None or best.gain_low is None or best.gain_high is None or not best.gain or best.gain <= 0:
        return None
    measured = stored_knobs(best.knobs).as_dict()
    if any(getattr(loaded, k) != v for k, v in measured.items() if k in best.knobs):
        return None
    if any(stored_knobs(t.knobs) != base for t in trials if t.run_id == best.run_id and t.phase == "default"):
        return None
    return Interval(best.gain, best.gain_low, best.gain_high, 0)
