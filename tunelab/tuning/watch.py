"""Retune for auto-loaded jobs: a training job that loaded its tuned profile keeps watching it.

With the ``retune`` setting (``TUNELAB_RETUNE=1``, or ``retune=True`` to ``tunelab.init``), a job whose
framework adapter loaded a stored profile hands every finished training step to :class:`ProfileWatch`
(``Runtime.step_done``).  Rank 0 times the steps and feeds a tuning driver started *locked* on the
loaded knobs (:meth:`.driver.Driver.watching`): its first blocks set the interval watched, and when
step time leaves it for ``watch_sustain`` blocks in a row the search re-opens, warm-started from the
profile's stored trials, with the default as the reference, then locks again and goes on watching.
New knobs go to the coordinator on rank 0, which every rank applies at the same cycle, so the other
ranks take no part and a step costs them nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..knobs import Knobs
from .driver import Driver, Plan
from .space import SearchSpace
from .strategies import Observation, Told, make_strategy

WATCH_PLAN = Plan(retune=True)


class ProfileWatch:
    def __init__(self, coordinator: Any, space: SearchSpace, loaded: Knobs, stored: list[Observation] | None = None,
                 plan: Plan = WATCH_PLAN, strategy: str = "tunelab", seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.coordinator, self.clock, self.say = coordinator, clock, say
        stored = stored or []

        def strategy_of(epoch: int) -> Told:
            made = make_strategy(strategy, space, seed + 1000 * epoch)
            if epoch == 1 and stored:
                made.warm_start(stored)
            return made

        self.driver = Driver.watching(space, strategy_of, loaded, plan)
        self._last: float | None = None
        self._epoch, self._locks = 0, 1

    def step_done(self) -> None:
        """One training step finished (rank 0 only; the first call only starts the clock)."""
        now = self.clock()
        if self._last is None:
            self._last = now
            return
        elapsed, self._last = now - self._last, now
        knobs = self.driver.step_done(elapsed)
        if knobs is not None:
            self.coordinator.set_knobs(knobs)
        self._report()

    def _report(self) -> None:
        d = self.driver
        if d.epoch != self._epoch:
            self._epoch = d.epoch
            self.say("tunelab: retune: step time left the loaded configuration's interval; re-opening the search")
        if len(d.decisions) != self._locks:
            self._locks = len(d.decisions)
            last = d.decisions[-1]
            what = f"{last.interval.text()} over the default" if last.interval and last.adopted else "default kept"
            self.say(f"tunelab: retune: locked again after {last.samples} blocks ({what})")
