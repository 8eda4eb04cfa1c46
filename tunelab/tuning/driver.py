"""The tuning protocol, one state machine fed step times by any objective.

The live session (:mod:`.session`) feeds it the training loop's step times; ``bench tuner``
(:mod:`.replay`) feeds it step times replayed from a recorded landscape.  Both run this code.

Phases (``Driver.phase``):

1. ``warmup``: steps that are not measured;
2. ``explore``: blocks of ``discard_steps`` (only after a knob change) + ``measure_steps`` steps, or more
   where steps are short: a block lasts at least ``block_seconds`` (its step count is fixed once, from
   the fastest warm-up step, so that every block of the run is as long; :attr:`Driver.block_steps`).  The
   first block is the default configuration, the *reference*; after every ``reference_every``
   candidate blocks the reference is measured again.  A candidate's score is its paired ratio to the
   reference (:mod:`.stats`), told to the strategy with its own variance (:mod:`.noise`: the step noise
   of that configuration and of the reference, and what the host adds between blocks): first against
   the reference before it, then, once the reference after it is measured, its bracketed ratio in its
   place (``Plan.retell``: a linear drift cancels out of that one).  Once
   ``explore_first`` candidates are measured, exploration stops early, at a reference block, when the
   strategy's best configuration is *promising* (its estimated gain less ``confirm_z`` standard
   deviations clears the minimum gain) or when nothing can be (no configuration's estimate plus
   ``futile_z`` deviations reaches it: the default is kept without re-measuring, unless an explored
   candidate's own measured ratio reached the minimum gain: the model may have smoothed a real gain
   away on a noisy host, so that candidate is re-measured first, once per search); else at the budget;
3. ``remeasure``: first, when the strategy's pick was explored and its own exploration blocks already
   clear ``1 + min_gain`` with an interval simultaneous over the ``m`` configurations explored
   (Bonferroni: each at ``1 - (1 - confidence) / 2m``, so picking the best of them cannot inflate it;
   and with the block-level noise at its upper ``1 - (1 - confidence) / 2`` confidence limit, since this
   early only two or three references tell it), it is locked without re-measuring
   (``lock_from_exploration``; only before any re-measurement of this search).  Otherwise the strategy's recommendation and its best measured configurations (at most
   ``finalists``, those that can still reach the minimum gain) are measured again, one block each per
   round, each round closed by a block of the reference.  These blocks are as long as the step noise
   measured so far asks for (the step-noise part of a round's paired ratio near ``remeasure_sigma``;
   between an exploration block's steps and ``remeasure_max_steps``; chosen as re-measurement starts):
   exploration screens with short blocks, the decision gets longer ones on a noisy host.  Their gains
   and confidence intervals rest on these fresh blocks only (not on the exploration that picked them,
   which favours the lucky).  The best finalist is adopted as soon as its interval's low end clears
   ``1 + min_gain``; finalists whose high end cannot, or that are clearly behind the leader, are
   dropped.  When every finalist is dropped
   and exploration budget is left, exploration resumes (the re-measured blocks told to the strategy
   too); else, or after ``max_rounds``, the default is kept.  A search's k-th re-measurement decides
   at confidence ``1 - (1 - confidence) / 2^(k-1)`` (:meth:`Driver._after_round`);
4. ``locked``: the decision is applied.  With ``retune``, blocks of the locked configuration go on being
   measured; when ``watch_sustain`` blocks in a row leave the interval its own blocks predict
   (:meth:`Driver._watch`), a lock that claims a gain is first checked: one block of it between two of
   the default (phase ``check``).  Where their paired ratio still holds the claimed gain, the host
   moved, not the optimum, and the watch goes on; else (or with no gain claimed) the search re-opens (a
   fresh strategy warm-started with this run's trials) and locks again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..knobs import Knobs
from ..units import counted
from . import noise, stats
from .plan import Decision, Plan, Sample, block_steps_for
from .space import SearchSpace
from .strategies import Observation, Told


@dataclass
class _Block:
    knobs: Knobs
    phase: str
    role: str
    discard_left: int
    times: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Check:
    """A retune's check (:meth:`Driver._end_check`): where its blocks began, the locked configuration's
    ratio to the default it measured, the gain the lock claimed, and whether the optimum moved."""

    index: int
    ratio: float
    claimed: float
    moved: bool


class Driver:
    """``step_done(step_s)`` after every training step; it returns knobs to apply now, or None."""

    def __init__(self, space: SearchSpace, make_strategy: Callable[[int], Told], plan: Plan | None = None,
                 samples_per_step: float = 1.0, on_sample: Callable[[Sample], None] | None = None) -> None:
        plan = plan or Plan()
        self.space, self.plan, self.samples_per_step = space, plan, samples_per_step
        self.make_strategy, self.on_sample = make_strategy, on_sample
        self.strategy = make_strategy(0)
        self.default = space.base
        self.knobs = space.base
        self.phase = "warmup"
        self.samples: list[Sample] = []
        self.decisions: list[Decision] = []
        self.epoch = 0
        self.steps = 0
        self.elapsed_s = 0.0
        self.stop_reason = ""
        self._warmup_left = plan.warmup_steps
        self._queue: list[tuple[Knobs, str, str]] = []
        self._block: _Block | None = None
        self._since_ref = 0
        self._explored = 0      # exploration blocks of this epoch, references included
        self._stint = 0         # candidates explored since exploration (re)started
        self._stint_goal = plan.explore_first if plan.explore_first is not None else len(space.names) + 2
        self._epoch_start = (0.0, 0)
        self._finalists: list[Knobs] = []
        self._round = 0
        self._outside = 0
        self._watch_from = 0    # the watch reads locked blocks from this sample on (reset by a check)
        self._watch_var = 0.0   # one watched block's variance, as the watch last estimated it
        self._watch_ss = (0.0, 0)  # squared successive differences (and their count) of the watched
                                   # blocks before the last check, since the lock
        self.checks: list[Check] = []
        self._noise: tuple[int, noise.Noise] | None = None
        self._forced: Knobs | None = None  # a finalist the model gave up on but a measurement did not
        self._block_steps: int | None = None  # measured steps of a block, fixed once the warm-up is timed
        self._fastest_s = math.inf               # the fastest step before then
        self._remeasure_steps = plan.measure_steps
        self._told_at: dict[int, int] = {}  # sample index -> the strategy's observation told for it
        self._remeasures = 0  # re-measurement stints begun in this search

    @classmethod
    def watching(cls, space: SearchSpace, make_strategy: Callable[[int], Told], loaded: Knobs, plan: Plan,
                 reason: str = "loaded from the profile store",
                 on_sample: Callable[[Sample], None] | None = None,
                 interval: stats.Interval | None = None, samples_per_step: float = 1.0) -> Driver:
        """A driver that starts locked on ``loaded`` (a stored profile) and watches it (``plan.retune``):
        its first ``watch_baseline`` blocks (after the warm-up steps) set the interval watched.
        ``interval``: the gain over the default the profile claims for ``loaded``, which a check holds
        it to before a search re-opens (None: none is known, and the search re-opens unchecked)."""
        driver = cls(space, make_strategy, dataclasses.replace(plan, retune=True), samples_per_step, on_sample)
        adopted = loaded != space.base
        driver.decisions.append(Decision(0, loaded, adopted, loaded, interval if adopted else None, reason,
                                         "loaded, not searched here", False, 0, 0, 0.0))
        driver.phase, driver.knobs = "locked", loaded
        driver._block = _Block(loaded, "locked", "locked", plan.warmup_steps)
        return driver

    # ---- the step loop --------------------------------------------------------------------------------
    @property
    def tuning(self) -> bool:
        return self.phase != "locked"

    @property
    def locked(self) -> Knobs | None:
        return self.decisions[-1].knobs if self.decisions else None

    def step_done(self, step_s: float) -> Knobs | None:
        if not (math.isfinite(step_s) and step_s > 0):  # (one would size every block, or void a reference)
            raise ValueError(f"a step's time must be a positive number of seconds, got {step_s!r}")
        self.steps += 1
        self.elapsed_s += step_s
        block = self._block
        if self._block_steps is None and (self.phase == "warmup" or (block is not None and block.discard_left > 0)):
            self._fastest_s = min(self._fastest_s, step_s)  # a warm-up step (a watching driver's: discarded)
        if self.phase == "warmup":
            self._warmup_left -= 1
            return self._start(self._next_block()) if self._warmup_left <= 0 else None
        if block is None:
            return None
        if block.discard_left > 0:
            block.discard_left -= 1
            return None
        if self._block_steps is None:  # the first measured step: size every block from the warm-up
            self._block_steps = block_steps_for(self.plan.measure_steps, self.plan.block_seconds, self._fastest_s)
        block.times.append(step_s)
        if len(block.times) < self._steps_of(block):
            return None
        self._finish(block)
        nxt = self._next_block()
        return self._start(nxt) if nxt is not None else None

    def _start(self, planned: tuple[Knobs, str, str] | None) -> Knobs | None:
        if planned is None:
            return None
        knobs, phase, role = planned
        changed = knobs != self.knobs
        if role == "locked" and not self.plan.retune:
            self._block, self.knobs = None, knobs
            return knobs if changed else None
        self._block = _Block(knobs, phase, role, self.plan.discard_steps if changed else 0)
        if phase != "locked":
            self.phase = phase
        self.knobs = knobs
        return knobs if changed else None

    def _steps_of(self, block: _Block) -> int:
        return self._remeasure_steps if block.phase == "remeasure" else self.block_steps

    @property
    def block_steps(self) -> int:
        """Measured steps of an exploration (and reference, and watched) block: ``plan.measure_steps``,
        or as many as last ``plan.block_seconds`` at the fastest warm-up step where steps are short (a
        fast GPU step; noise and drift grow with time, not with steps).  Fixed at the first measured step;
        with no warm-up step timed (a watching driver without warm-up steps) it stays ``measure_steps``."""
        return self._block_steps if self._block_steps is not None else self.plan.measure_steps

    def _choose_remeasure_steps(self, finalists: list[Knobs] | None) -> int:
        """Steps of each re-measurement block, chosen once as re-measurement starts: ``plan.remeasure_steps``
        if set; else enough that the step-noise part of one round's paired ratio (a finalist's block
        and a reference block; the block-level noise between blocks does not shrink with more steps)
        is about ``remeasure_sigma``, from the step noise measured so far, between ``measure_steps``
        and ``remeasure_max_steps``.  Exploration screens with short blocks; the decision gets longer
        ones where the host is noisy (a quiet host keeps them short)."""
        plan = self.plan
        if plan.remeasure_steps is not None:
            return plan.remeasure_steps
        if plan.remeasure_sigma is None or finalists == []:
            return self.block_steps
        model = self.noise()
        # (finalists None: a configuration not known yet, at the pooled step variance)
        worst = max(model.step_var.get(k, model.pooled_var) for k in finalists) if finalists else model.pooled_var
        need = (worst + model.step_var.get(self.default, model.pooled_var)) / plan.remeasure_sigma ** 2
        most = max(self.block_steps, plan.remeasure_max_steps or 4 * self.block_steps)
        return int(min(most, max(self.block_steps, math.ceil(need))))

    def _finish(self, block: _Block) -> None:
        rates = self.samples_per_step / np.asarray(block.times)
        logs = tuple(float(x) for x in np.log(rates))
        median = float(np.median(rates))
        spread = float((np.percentile(rates, 90) - np.percentile(rates, 10)) / median)
        sample = Sample(len(self.samples), block.phase, block.role, block.knobs, math.exp(float(np.mean(logs))),
                        spread, len(block.times), float(np.sum(block.times)), self.elapsed_s, self.epoch, None, logs)
        if block.role == "candidate":
            told = self._tell(sample)
            sample = dataclasses.replace(sample, told=told)
        self.samples.append(sample)
        self._explored += block.phase == "explore"
        self._stint += block.phase == "explore" and block.role == "candidate"
        if block.role == "candidate":
            self._since_ref += 1
        elif block.role == "reference":
            self._since_ref = 0
        if self.on_sample is not None:
            self.on_sample(sample)
        if block.role == "reference" and self.plan.retell:
            self._retell_bracketed(sample)
        if block.role == "locked":
            self._watch(sample)
        elif block.phase == "check" and not self._queue:
            self._end_check()

    def _tell(self, sample: Sample) -> float | None:
        """Provisional paired ratio against the reference blocks so far (the strategy learns now, and the
        bracketed ratio replaces it when the next reference is measured: :meth:`_retell_bracketed`),
        with its own variance; a block measured right after a reference set aside as disturbed is
        told as withdrawn (no value), to be told its value once that reference is kept."""
        if self._next_to_disturbed(float(sample.index)):  # (paired across it, it would carry the disturbance)
            self.strategy.tell(sample.knobs, 0.0, math.inf)
            self._told_at[sample.index] = len(self.strategy.observations) - 1
            return None
        pair = self._pair(sample, bracket=False)
        if pair is None:
            return None
        ratio, steps_part, block_part = pair
        self.strategy.tell(sample.knobs, ratio, steps_part + block_part)
        self._told_at[sample.index] = len(self.strategy.observations) - 1
        return ratio

    def _retell_bracketed(self, ref: Sample) -> None:
        """At each reference block: the strategy gets every candidate's ratio of this search as the
        references now bracket it, with its variance, in place of what it was told (replaced, not
        added: the two estimate the same block, and told twice it would count as two).  Told against
        the reference before it, a candidate carries the host's drift since then; bracketed, a linear
        drift cancels.  A candidate next to a reference set aside as disturbed (which may be known only
        references later: the robust spread needs four) is withdrawn, its value no longer told; one
        whose neighbour is no longer set aside is told again."""
        refs = self._refs()
        kept = {r[0] for r in refs}
        for index, told_at in self._told_at.items():
            if index >= ref.index:
                continue
            s = self.samples[index]
            if self._next_to_disturbed(float(index), kept):
                if s.told is not None:
                    self.strategy.retell(told_at, 0.0, math.inf)
                    self.samples[index] = dataclasses.replace(s, told=None)
                continue
            pair = self._pair(s, bracket=True, refs=refs)
            if pair is None:
                continue
            ratio, steps_part, block_part = pair
            self.strategy.retell(told_at, ratio, steps_part + block_part)
            self.samples[index] = dataclasses.replace(s, told=ratio)

    # ---- what to measure next -------------------------------------------------------------------------
    def _next_block(self) -> tuple[Knobs, str, str] | None:
        if self._queue:
            return self._queue.pop(0)
        ref = (self.default, self.phase if self.phase != "warmup" else "explore", "reference")
        if self.phase in ("warmup", "explore"):
            if not self._refs():
                return (self.default, "explore", "reference")
            if not self.stop_reason:
                self.stop_reason = self._explore_done()
            if self._since_ref >= self.plan.reference_every or (self.stop_reason and self._since_ref):
                return ref
            if not self.stop_reason:
                return (self.strategy.ask(), "explore", "candidate")
            return self._begin_remeasure()
        if self.phase == "remeasure":
            if self._since_ref:
                return ref
            return self._after_round()
        # (the lock's knobs: after a check, the block just measured was the default's)
        return (self.decisions[-1].knobs, "locked", "locked") if self.plan.retune else None

    def _explore_done(self) -> str:
        if not self.space.names:
            return "every knob is pinned"
        if self._explored >= self.plan.budget_samples:
            return f"budget of {counted(self.plan.budget_samples, 'exploration block')} spent"
        left = self._time_left()
        if left < self._reserve_s():
            return (f"time budget of {self.plan.time_budget_s:g} s spent"
                    + (f" (its last {left:.0f} s left to re-measure)" if left > 0 else ""))
        if self.strategy.converged():
            return "converged (no meaningful expected improvement)"
        if self._stint >= self._stint_goal and self._since_ref == 0:
            goal, z = math.log1p(self.plan.min_gain), self.plan.confirm_z
            pick = self.strategy.recommend()
            top = self.strategy.upper_bound(z) if self.plan.near_best is not None else -math.inf
            if pick is not None and pick != self.default:
                mean, sd = self.strategy.estimate(pick)
                if mean - z * sd >= goal and top - mean <= math.log1p(self.plan.near_best or 0.0):
                    return f"converged (a promising configuration: {math.exp(mean):.3f}x estimated)"
            if self.strategy.upper_bound(self.plan.futile_z) < goal:
                above = self._measured_above(goal)
                if above:  # the model smoothed a measured gain away: re-measure it before giving up
                    self._forced = above[0]
                    return ("converged (nothing is expected to reach the minimum gain, but one candidate "
                            "measured above it: re-measured first)")
                return "converged (nothing is expected to reach the minimum gain)"
        return ""

    def _begin_remeasure(self) -> tuple[Knobs, str, str] | None:
        goal, z = math.log1p(self.plan.min_gain), self.plan.futile_z
        pick = self.strategy.recommend()
        self._finalists = []
        for k in [*([pick] if pick is not None else []), *self.strategy.ranked()]:
            if k == self.default or any(self._distance(k, f) < self.plan.finalist_distance for f in self._finalists):
                continue  # distinct regions: near-twins would tell nothing new
            mean, sd = self.strategy.estimate(k)
            if mean + z * sd >= goal:
                self._finalists.append(k)
            if len(self._finalists) == self.plan.finalists:
                break
        if self._forced is None and not self._finalists:
            self._forced = next(iter(self._measured_above(goal)), None)
        if self._forced is not None:  # the model smoothed it down, but a measured gain is re-measured first
            self._finalists = [self._forced]
        self._round = 0
        if not self._finalists:
            if not self.space.names:
                return self._lock(None, None, "every knob is pinned: there is nothing to search")
            if not any(s.role == "candidate" and s.epoch == self.epoch for s in self.samples):
                return self._lock(None, None, "no candidate was measured: the exploration budget held only the "
                                              "default's reference blocks")
            return self._lock(None, None, "no configuration is expected to reach the minimum gain "
                                          f"({1 + self.plan.min_gain:.2f}x)")
        if self.plan.lock_from_exploration and self._forced is None and not self._remeasured():
            # (once a re-measurement had its say in this search, it decides: exploration alone does not)
            pick, what = self._finalists[0], "its exploration blocks"
            explored, iv = self._explored_interval(pick)
            stand_in = self._explored_stand_in(pick) if iv is None else None  # (a pick never measured)
            if stand_in is not None:
                pick, what = stand_in, "the best explored configuration's blocks"
                explored, iv = self._explored_interval(pick)
            if iv is not None and iv.low >= 1.0 + self.plan.min_gain:
                return self._lock(pick, iv,
                                  f"{what} clear the minimum gain ({1 + self.plan.min_gain:.2f}x) "
                                  f"with an interval simultaneous over the {explored} configurations explored")
        self._remeasure_steps = self._fit_steps(self._choose_remeasure_steps(self._finalists), len(self._finalists))
        self._remeasures += 1
        return self._queue_round()

    def _explored_stand_in(self, pick: Knobs) -> Knobs | None:
        """For a pick the model proposes but nobody measured: the explored configuration it believes
        best, when the model expects the pick to beat it by no more than ``near_best`` (what the
        promising stop calls nothing better elsewhere).  Locked on its own exploration blocks, if they
        clear the minimum gain with the simultaneous interval, it saves a round spent confirming a guess
        worth at most that much more (the gain it is locked with is measured, the pick's is not).  Not
        when the model also holds trials from before this search (a retune, a stored profile): they ran
        on another host state, or before the optimum moved, so its comparison of the two is not this
        search's to trust."""
        if self.plan.near_best is None or len(self.strategy.observations) > len(self._told_at):
            return None
        explored = self._explored_configs()
        best = next((k for k in self.strategy.ranked() if k in explored), None)
        if best is None:
            return None
        (mean, sd), (mean_best, _) = self.strategy.estimate(pick), self.strategy.estimate(best)
        if not math.isfinite(sd):  # (a strategy with no model of what it did not measure)
            return None
        return best if mean - mean_best <= math.log1p(self.plan.near_best) else None

    def _explored_configs(self) -> set[Knobs]:
        """The configurations this epoch measured as candidates, the default's aside."""
        return {s.knobs for s in self.samples
                if s.epoch == self.epoch and s.role == "candidate" and s.knobs != self.default}

    def _remeasured(self) -> bool:
        """Whether this search (epoch) has re-measured anything yet."""
        return any(s.epoch == self.epoch and s.phase == "remeasure" for s in self.samples)

    def _explored_interval(self, knobs: Knobs) -> tuple[int, stats.Interval | None]:
        """The gain of ``knobs`` from its own exploration blocks, with a confidence level that holds for
        all ``m`` configurations explored in this epoch at once (Bonferroni: each at 1 - (1 - c) / 2m),
        so it stays valid for whichever one the search picked: no winner's curse; and with the
        block-level noise at its upper ``1 - (1 - c) / 2`` confidence limit (:meth:`.noise.Noise.bounded`):
        this early, two or three references' differences are all that tell it, and by chance they often
        agree far more closely than the host's state moves (Berger and Boos: the two halves of ``1 - c``
        add up)."""
        m = max(1, len(self._explored_configs()))
        alpha = 1.0 - self.plan.confidence
        return m, self.interval_of(knobs, phase="explore", confidence=1.0 - alpha / 2 / m,
                                   model=self.noise().bounded(alpha / 2))

    def _measured_above(self, goal: float) -> list[Knobs]:
        """This epoch's explored candidates whose own paired ratios (their mean) reach ``goal`` (log units),
        best first, while nothing was re-measured in this epoch: on a noisy host the model may smooth a
        real gain away, so the best such candidate is re-measured before the search gives up."""
        told: dict[Knobs, list[float]] = {}
        for s in self.samples:
            if s.epoch == self.epoch and s.phase == "explore" and s.told is not None and s.knobs != self.default:
                told.setdefault(s.knobs, []).append(s.told)
        if self._remeasured():
            return []  # once per search: a re-measurement already had its say
        means = {k: float(np.mean(v)) for k, v in told.items()}
        return sorted((k for k, m in means.items() if m >= goal), key=lambda k: -means[k])

    def _queue_round(self) -> tuple[Knobs, str, str] | None:
        self._round += 1
        for i, knobs in enumerate(self._finalists):
            if i and i % self.plan.reference_every == 0:
                self._queue.append((self.default, "remeasure", "reference"))
            self._queue.append((knobs, "remeasure", "candidate"))
        return self._queue.pop(0)

    def _after_round(self) -> tuple[Knobs, str, str] | None:
        """After a round of re-measurement: lock the best finalist if its interval clears the minimum
        gain, drop the finalists that cannot, and go on, resume exploring, or keep the default.  The
        k-th re-measurement stint of a search decides at confidence ``1 - (1 - c) / 2^(k-1)``: a search
        that failed one and explored on tests again, and spent so the chance of a false lock over all
        its stints stays below twice one stint's, where a fixed level would add one stint's per stint.
        The interval recorded with a decision is the plan's (``c``), which the stricter one contains."""
        goal = 1.0 + self.plan.min_gain
        level = 1.0 - (1.0 - self.plan.confidence) / 2.0 ** (max(1, self._remeasures) - 1)
        scored = [(k, self.interval_of(k, confidence=level)) for k in self._finalists]
        # a finalist whose every block sat next to a reference set aside as disturbed is not out: its
        # blocks told nothing either way, so it gets another round while rounds are left
        unpaired = [k for k, iv in scored if iv is None] if self._round < self.plan.max_rounds else []
        scored = [(k, iv) for k, iv in scored if iv is not None]
        if not scored:
            if unpaired and self._time_left() < self._round_s(len(unpaired), self._remeasure_steps):
                return self._lock(None, None, "no finalist could be paired with the reference before the time "
                                              f"budget of {self.plan.time_budget_s:g} s ran out")
            if unpaired:
                self._finalists = unpaired
                return self._queue_round()
            return self._lock(None, None, "no finalist could be paired with the reference")
        best_k, best_iv = max(scored, key=lambda s: s[1].gain)
        recorded = best_iv if self._remeasures <= 1 else self.interval_of(best_k)  # (at the plan's confidence)
        if best_iv.low >= goal and self._round >= min(self.plan.min_rounds, self.plan.max_rounds):
            return self._lock(best_k, recorded, f"its interval clears the minimum gain ({goal:.2f}x)"
                              + (f" (re-measurement {self._remeasures} of this search: at {level:.1%} confidence)"
                                 if self._remeasures > 1 else ""))
        futile = self._round >= self.plan.futility_after  # by then a point estimate below the goal is a no
        self._finalists = [k for k, iv in scored if iv.high >= goal and iv.high >= best_iv.low
                           and not (futile and iv.gain < goal)] + unpaired
        if not self._finalists:
            forced, self._forced = self._forced, None
            if forced is None and self._explored < self.plan.budget_samples \
                    and not self.stop_reason.startswith(("budget", "time")) and self._time_left() >= self._reserve_s():
                return self._resume_explore()
            return self._lock(None, (best_k, recorded), f"no finalist can reach the minimum gain ({goal:.2f}x)")
        if self._round >= self.plan.max_rounds:
            return self._lock(None, (best_k, recorded),
                              f"no finalist cleared the minimum gain ({goal:.2f}x) in {self._round} rounds")
        if self._time_left() < self._round_s(len(self._finalists), self._remeasure_steps):
            return self._lock(None, (best_k, recorded),
                              f"no finalist cleared the minimum gain ({goal:.2f}x) in {counted(self._round, 'round')} "
                              f"before the time budget of {self.plan.time_budget_s:g} s ran out")
        return self._queue_round()

    # ---- the time budget ------------------------------------------------------------------------------
    def _time_left(self) -> float:
        """Seconds of this search's time budget (``plan.time_budget_s``, from the search's start) left;
        inf without one."""
        if self.plan.time_budget_s is None:
            return math.inf
        return self.plan.time_budget_s - (self.elapsed_s - self._epoch_start[0])

    def _round_blocks(self, finalists: int) -> int:
        """Blocks in a round of re-measurement of ``finalists``: theirs and the references between them."""
        return finalists + math.ceil(finalists / self.plan.reference_every)

    def _round_s(self, finalists: int, steps: int) -> float:
        """What a round of re-measurement of ``finalists`` blocks of ``steps`` measured steps is expected
        to take, with its reference blocks and every block's discarded steps (:meth:`_step_s`)."""
        return self._round_blocks(finalists) * (steps + self.plan.discard_steps) * self._step_s()

    def _step_s(self) -> float:
        """This search's mean measured step so far (0 before a block was measured: nothing tells it yet)."""
        epoch = [s for s in self.samples if s.epoch == self.epoch]
        measured = sum(s.steps for s in epoch)
        return sum(s.seconds for s in epoch) / measured if measured else 0.0

    def _reserve_s(self) -> float:
        """What one more exploration block needs left: itself, the reference block that closes exploration
        after it, and one round of re-measurement at the steps the noise asks for now, or as many as take
        a third of the budget where that is fewer (not fewer than a block's).  A time budget ends exploration
        when less than this is left, so that the search ends near the budget with a decision, not in the
        middle of one; re-measurement then measures as many steps as fit (:meth:`_fit_steps`)."""
        if self.plan.time_budget_s is None:
            return -math.inf
        # (the finalist is not known yet; the strategy is not asked, which would move its random state)
        steps = self._choose_remeasure_steps(None)
        steps = self._fit_steps(steps, self.plan.finalists, self.plan.time_budget_s / 3)
        return 2 * (self.block_steps + self.plan.discard_steps) * self._step_s() \
            + self._round_s(self.plan.finalists, steps)

    def _fit_steps(self, steps: int, finalists: int, seconds: float | None = None) -> int:
        """``steps`` for each re-measurement block, fewer where a round of them would not fit in ``seconds``
        (the time budget left by default), not fewer than an exploration block's."""
        seconds = self._time_left() if seconds is None else seconds
        block_step_s = self._round_blocks(finalists) * self._step_s()  # a round's seconds per step of each block
        if not math.isfinite(seconds) or block_step_s <= 0:
            return steps
        fit = math.floor(seconds / block_step_s) - self.plan.discard_steps
        return max(min(steps, self.block_steps), min(steps, fit))

    def _resume_explore(self) -> tuple[Knobs, str, str] | None:
        """Every finalist dropped with budget left: explore again (what was re-measured is told)."""
        self.phase, self.stop_reason = "explore", ""
        self._stint, self._stint_goal = 0, self.plan.explore_more
        return self._next_block()

    def _distance(self, a: Knobs, b: Knobs) -> float:
        ua, ub = np.asarray(self.space.unit_point(a)), np.asarray(self.space.unit_point(b))
        return float(np.sqrt(((ua - ub) ** 2).sum()))

    # ---- decisions ------------------------------------------------------------------------------------
    def _lock(self, adopted: Knobs | None, best: tuple[Knobs, stats.Interval] | stats.Interval | None,
              reason: str) -> tuple[Knobs, str, str] | None:
        if isinstance(best, tuple):
            best_k, iv = best
        else:
            best_k, iv = adopted, best
        knobs = adopted if adopted is not None else self.default
        blocks = sum(1 for s in self.samples if s.epoch == self.epoch)
        self.decisions.append(Decision(self.epoch, knobs, adopted is not None, best_k, iv, reason,
                                       self.stop_reason, self.stop_reason.startswith("converged"),
                                       blocks, self.steps - self._epoch_start[1],
                                       self.elapsed_s - self._epoch_start[0]))
        self.phase = "locked"
        self._outside, self._forced, self._watch_ss = 0, None, (0.0, 0)
        return (knobs, "locked", "locked")

    def _watch(self, sample: Sample) -> None:
        """Retune: count locked blocks in a row outside the interval that the locked blocks before them
        predict; ``watch_sustain`` in a row start a check where the lock claims a gain
        (:meth:`_begin_check`), else re-open the search.

        The interval rests on the locked configuration's own blocks since its lock, not on the search's
        (picked as the best of several, its exploration blocks read high, and they ran at another time).
        Its centre is the straight line through the last ``watch_window`` watched blocks before the run
        of blocks outside, carried on to this block: a host that drifts slowly carries the line with it,
        while a jump, whose blocks stay out of the window, does not.  Its spread is what the watched
        blocks before that run differ by from one to the next (half their mean square successive
        difference: the steps' noise and the host's state from block to block, which a slow drift
        barely reaches), blended with the noise model's block sigma as a prior of
        ``noise.TAU_PRIOR_DF`` degrees of freedom, and never below that sigma (a drift that bends within
        the window moves blocks off the line by more than they differ from one block to the next).  The
        half-width is Student's t at the two-sided level
        of ``watch_z`` normal sigmas (``check_watch_z`` where a check comes before any search: a lock
        that claims a gain), on the blend's degrees of freedom, times the standard error of predicting
        one new block from the line.  Each block is judged alone, not the run's mean: the
        host's state holds for several blocks, so a mean of a few neighbours varies far more than
        independent blocks would.  Nothing is watched until ``watch_baseline`` blocks are in."""
        watched = [s.log_score for s in self.samples[self._watch_from:] if s.epoch == self.epoch and s.role == "locked"]
        before = watched[:len(watched) - 1 - self._outside]
        if len(before) < self.plan.watch_baseline:
            return
        window = np.asarray(before[-self.plan.watch_window:])
        n = window.size
        x = np.arange(n, dtype=float) - (n - 1) / 2.0
        sxx = float(np.sum(x * x))
        at = (n - 1) / 2.0 + 1 + self._outside  # this block, counted from the window's centre
        slope = float(np.sum(x * window)) / sxx
        centre = float(np.mean(window)) + slope * at
        diffs = np.diff(np.asarray(before))
        ss, nd = self._watch_ss
        prior = noise.sigma_of(self.noise(), self.decisions[-1].knobs, self.block_steps) ** 2
        df = noise.TAU_PRIOR_DF + nd + diffs.size
        var = max(prior, (noise.TAU_PRIOR_DF * prior + (ss + float(np.sum(diffs * diffs))) / 2.0) / df)
        last = self.decisions[-1]
        checked = last.adopted and last.interval is not None and self.plan.check_z is not None
        level = math.erf((self.plan.check_watch_z if checked else self.plan.watch_z) / math.sqrt(2.0))
        half = noise.t_quantile(level, df) * math.sqrt(var * (1.0 + 1.0 / n + at * at / sxx))
        # the check's blocks each start a new state of the host: its ratio varies as much as blocks do
        # around their line, which successive differences miss where a state holds over several blocks
        resid = window - float(np.mean(window)) - slope * x
        self._watch_var = max(var, float(np.sum(resid * resid)) / (n - 2)) if n > 2 else var
        self._outside = self._outside + 1 if abs(sample.log_score - centre) > half else 0
        if self._outside < self.plan.watch_sustain:
            return
        if checked:
            self._begin_check()
        else:
            self._reopen()

    def _begin_check(self) -> None:
        """Step time left the locked configuration's interval: before a search, ask whether the host moved
        or the optimum did.  One block of the locked configuration between two of the default: paired,
        their ratio cancels what the host does to both (:meth:`_end_check`)."""
        locked = self.decisions[-1].knobs
        self.phase = "check"
        self._queue = [(self.default, "check", "check"), (locked, "check", "check"), (self.default, "check", "check")]

    def _end_check(self) -> None:
        """The check's verdict.  Its ratio (the locked block's log rate less the mean of the default's two
        around it) is set against the gain the lock claimed (the centre of its interval, and its
        spread read off the interval's width at the plan's confidence): the optimum moved when the
        ratio falls below that gain by more than ``check_z`` sigmas of the two together (the ratio's
        from one watched block's variance, as the watch last estimated it (the larger of its spread and
        of the window's scatter about its line), times 1 + 1/2).  Then the
        search re-opens; else the locked configuration still leads as it did, the host moved, and the
        watch starts afresh from the next locked block.  A ratio above the claim re-opens nothing."""
        last = self.decisions[-1]
        blocks = self.samples[-3:]
        mine = [b.log_score for b in blocks if b.knobs == last.knobs]
        refs = [b.log_score for b in blocks if b.knobs == self.default]
        ratio = mine[0] - sum(refs) / len(refs)
        iv = last.interval
        z90 = noise.t_quantile(self.plan.confidence, 1e6)
        claimed, spread = math.log(iv.gain), (math.log(iv.high) - math.log(iv.low)) / (2.0 * z90)
        sigma = math.sqrt(1.5 * self._watch_var + spread * spread)
        moved = ratio < claimed - self.plan.check_z * sigma
        self.checks.append(Check(blocks[0].index, math.exp(ratio), iv.gain, moved))
        self._outside = 0
        if moved:
            self._reopen()
        else:  # the line starts afresh after the check; what blocks differ by carries on
            watched = [s.log_score for s in self.samples[self._watch_from:] if s.role == "locked" and s.epoch == self.epoch]
            diffs = np.diff(np.asarray(watched[:len(watched) - self.plan.watch_sustain]))
            self._watch_ss = (self._watch_ss[0] + float(np.sum(diffs * diffs)), self._watch_ss[1] + diffs.size)
            self.phase = "locked"
            self._watch_from = len(self.samples)

    def _reopen(self) -> None:
        earlier = [Observation(o.knobs, o.value, o.variance + self.plan.warm_start_noise ** 2)
                   for o in self.strategy.live]
        self.epoch += 1
        self.strategy = self.make_strategy(self.epoch)
        self.strategy.warm_start(earlier)
        self._told_at, self._remeasures = {}, 0
        self.stop_reason, self._explored, self._since_ref = "", 0, 0
        # a search warm-started from earlier trials may stop after explore_more candidates; one that holds
        # none (a loaded profile's first retune, its store without trials) explores as a first search does
        first = self.plan.explore_first if self.plan.explore_first is not None else len(self.space.names) + 2
        self._stint, self._stint_goal = 0, self.plan.explore_more if self.strategy.live else first
        self._epoch_start = (self.elapsed_s, self.steps)
        self.phase = "explore"
        self._queue = [(self.decisions[-1].knobs, "explore", "candidate")] \
            if self.decisions[-1].adopted else []
        self._queue.insert(0, (self.default, "explore", "reference"))

    # ---- statistics -----------------------------------------------------------------------------------
    def _epoch_refs(self) -> list[Sample]:
        return [s for s in self.samples if s.role == "reference" and s.epoch == self.epoch]

    def _refs(self) -> list[tuple[float, float, int]]:
        """This epoch's reference blocks as (position, log score, steps), disturbed ones set aside: with four or
        more, a block further from their median than 3.5 robust sigmas (MAD) and than 3.5 sigmas of its
        own step noise, e.g. the host busy with something else for seconds, pairs with nothing (a slow
        trend moves the median with it), nor do the blocks next to it (:meth:`_next_to_disturbed`)."""
        refs = [(float(s.index), s.log_score, s.steps) for s in self._epoch_refs()]
        if len(refs) < 4:
            return refs
        logs = np.asarray([r[1] for r in refs])
        centre = float(np.median(logs))
        limit = max(3.5 * 1.4826 * float(np.median(np.abs(logs - centre))), 0.02)
        # ... and further than its own step noise can reach (3.5 sigmas of a block of its length, from the
        # step variance inside the reference's blocks, as the noise model pools it): a handful of
        # references can agree closely by chance, and a robust spread read off four of them would set
        # ordinary blocks aside
        epoch = [(s.knobs, s.logs) for s in self.samples if s.epoch == self.epoch]
        model = noise.estimate(epoch, self.default, [])
        step_var = model.step_var.get(self.default, model.pooled_var)
        return [r for r in refs if abs(r[1] - centre) <= max(limit, 3.5 * math.sqrt(step_var / max(1, r[2])))]

    def _next_to_disturbed(self, position: float, kept: set[float] | None = None) -> bool:
        """Whether the reference block measured just before or just after ``position`` was set aside as
        disturbed.  Whatever disturbed it (another job, or a stretch when the host ran fast) may have
        reached the blocks next to it too; paired across it with references measured elsewhere, such a
        block would carry the disturbance into its ratio (a fast stretch the reference shared, set aside
        on the reference's side only, reads as a gain).  So it pairs with nothing either.  ``kept``: the
        positions :meth:`_refs` keeps, when the caller has them already."""
        around = [float(s.index) for s in self._epoch_refs()]
        before = [r for r in around if r < position]
        after = [r for r in around if r > position]
        kept = kept if kept is not None else {r[0] for r in self._refs()}
        return bool(before and before[-1] not in kept) or bool(after and after[0] not in kept)

    def disturbed_references(self) -> int:
        """Reference blocks of this epoch set aside as disturbed (see :meth:`_refs`)."""
        return len(self._epoch_refs()) - len(self._refs())

    def noise(self) -> noise.Noise:
        """This epoch's noise model (:mod:`.noise`), refreshed when a block is added."""
        if self._noise is None or self._noise[0] != len(self.samples):
            kept = {r[0] for r in self._refs()}
            epoch = [s for s in self.samples if s.epoch == self.epoch]
            refs = [s.logs for s in self._epoch_refs() if float(s.index) in kept]
            self._noise = (len(self.samples), noise.estimate([(s.knobs, s.logs) for s in epoch], self.default, refs))
        return self._noise[1]

    def sigma(self) -> tuple[float, float]:
        """One reference block's noise (log units) and its degrees of freedom."""
        model = self.noise()
        var = model.block_var(self.default, self.block_steps)
        return noise.sigma_of(model, self.default, self.block_steps), model.df(var, model.tau2)

    def _pair(self, sample: Sample, bracket: bool = True,
              refs: list[tuple[float, float, int]] | None = None) -> tuple[float, float, float] | None:
        """(paired log ratio, its step-noise variance, its block-noise variance) of a candidate block
        (``refs``: :meth:`_refs`, when the caller has them already)."""
        pair = stats.paired(float(sample.index), sample.log_score, self._refs() if refs is None else refs, bracket)
        if pair is None:
            return None
        per_step = pair.per_step if pair.per_step is not None else pair.weight2 / self.block_steps
        steps_part, block_part = self.noise().pair_var(sample.knobs, sample.steps, self.default, pair.weight2,
                                                       per_step)
        return pair.log_ratio, steps_part, block_part

    def interval_of(self, knobs: Knobs, phase: str = "remeasure", confidence: float | None = None,
                    model: noise.Noise | None = None) -> stats.Interval | None:
        """Gain of ``knobs`` over the reference from this epoch's blocks of ``phase`` (re-measured ones by
        default), bracketed, at ``confidence`` (the plan's by default); blocks next to a reference set
        aside as disturbed are left out with it."""
        refs = self._refs()  # once, not per block: it reads every block's steps
        kept = {r[0] for r in refs}
        blocks = [s for s in self.samples
                  if s.knobs == knobs and s.phase == phase and s.role == "candidate" and s.epoch == self.epoch
                  and not self._next_to_disturbed(float(s.index), kept)]
        pairs = [(s, stats.paired(float(s.index), s.log_score, refs)) for s in blocks]
        pairs = [(s, p) for s, p in pairs if p is not None]
        if not pairs:
            return None
        # the variance of the mean ratio, each block counted once: a reference block between two
        # re-measurements is subtracted from both ratios, so its weight in the mean adds up
        model, n = model or self.noise(), len(pairs)
        ref_var = model.step_var.get(self.default, model.pooled_var)
        weights = stats.reference_weights([p for _, p in pairs])
        mine = sum(model.block_var(s.knobs, s.steps) for s, _ in pairs) / n ** 2
        theirs = sum(w * w * ref_var / (k or 1) for w, k in weights.values())
        steps_part = mine + theirs
        block_part = model.tau2 * (1.0 / n + sum(w * w for w, _ in weights.values()))
        df = model.df(steps_part, block_part, model.steps_df([(mine, knobs), (theirs, self.default)]))
        mean = sum(p.log_ratio for _, p in pairs) / n
        return stats.interval_of_mean(mean, steps_part + block_part, df,
                                      self.plan.confidence if confidence is None else confidence, n)
