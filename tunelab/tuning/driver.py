"""The tuning protocol, one state machine fed step times by any objective.

The live session (:mod:`.session`) feeds it the training loop's step times; ``bench tuner``
(:mod:`.replay`) feeds it step times replayed from a recorded landscape.  Both run this code.

Phases (``Driver.phase``):

1. ``warmup``: steps that are not measured;
2. ``explore``: blocks of ``discard_steps`` (only after a knob change) + ``measure_steps`` steps.  The
   first block is the default configuration, the *reference*; after every ``reference_every``
   candidate blocks the reference is measured again.  A candidate's score is its paired ratio to the
   reference (:mod:`.stats`), told to the strategy with its variance;
3. ``remeasure``: the strategy's recommendation and its best measured configurations are measured again
   (the recommendation may be new: a GP's best guess near its best samples), in rounds, each between
   blocks of the reference.  Their gains and confidence intervals rest on these fresh blocks only (not
   on the exploration that picked them, which favours the lucky).  The best finalist is adopted as soon
   as its interval's low end clears ``1 + min_gain``; finalists whose high end cannot are dropped; after
   ``max_rounds`` the default is kept;
4. ``locked``: the decision is applied.  With ``retune``, blocks of the locked configuration go on being
   measured; when ``watch_sustain`` blocks in a row leave its interval, the search re-opens (a fresh
   strategy warm-started with this run's trials) and locks again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..knobs import Knobs
from . import stats
from .space import SearchSpace
from .strategies import Observation, Told


@dataclass(frozen=True)
class Plan:
    warmup_steps: int = 2
    discard_steps: int = 1
    measure_steps: int = 3
    budget_samples: int = 14        # blocks measured in exploration, the reference's included
    time_budget_s: float | None = None
    reference_every: int = 2        # candidate blocks between two blocks of the reference
    finalists: int = 2
    remeasure_steps: int | None = None  # measured steps of a re-measurement block (None: 2 x measure_steps)
    max_rounds: int = 5
    futility_after: int = 2         # from this round on, finalists whose gain estimate is below the goal drop
    min_rounds: int = 2             # rounds before a finalist may be adopted: one slow reference block must not decide
    finalist_distance: float = 0.1  # finalists at least this far apart (unit coordinates)
    min_gain: float = 0.01          # a gain smaller than this is not worth changing a user's job for
    confidence: float = 0.9         # two-sided: the low end is a 95 % one-sided bound
    retune: bool = False
    watch_sustain: int = 4          # locked blocks in a row outside the interval that re-open the search
    watch_z: float = 3.0            # the watched interval: locked mean +- watch_z block sigmas
    warm_start_noise: float = 0.10  # extra sigma (log units) of earlier trials (a retune, a stored profile)


@dataclass(frozen=True)
class Sample:
    index: int
    phase: str            # explore | remeasure | locked
    role: str             # reference | candidate | locked
    knobs: Knobs
    score: float          # samples/s: median over the block's measured steps
    spread: float         # (p90 - p10) / median of those steps' samples/s
    steps: int
    seconds: float
    at_s: float           # end of the block, seconds of measured training since the driver started
    epoch: int = 0        # 0 for the first search, +1 per retune
    told: float | None = None  # the paired log ratio told to the strategy (candidates in exploration)


@dataclass(frozen=True)
class Decision:
    epoch: int
    knobs: Knobs          # what was locked
    adopted: bool         # False: the default was kept
    best: Knobs | None    # the best finalist (the one locked, or the one that did not clear)
    interval: stats.Interval | None
    reason: str
    stop_reason: str      # why exploration ended
    converged: bool
    samples: int          # blocks measured until this lock (references included)
    steps: int            # training steps until this lock (warm-up and discarded ones included)
    seconds: float


@dataclass
class _Block:
    knobs: Knobs
    phase: str
    role: str
    discard_left: int
    times: list[float] = field(default_factory=list)


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
        self._explored = 0
        self._epoch_start = (0.0, 0)
        self._finalists: list[Knobs] = []
        self._round = 0
        self._outside = 0

    # ---- the step loop --------------------------------------------------------------------------------
    @property
    def tuning(self) -> bool:
        return self.phase != "locked"

    @property
    def locked(self) -> Knobs | None:
        return self.decisions[-1].knobs if self.decisions else None

    def step_done(self, step_s: float) -> Knobs | None:
        self.steps += 1
        self.elapsed_s += step_s
        if self.phase == "warmup":
            self._warmup_left -= 1
            return self._start(self._next_block()) if self._warmup_left <= 0 else None
        block = self._block
        if block is None:
            return None
        if block.discard_left > 0:
            block.discard_left -= 1
            return None
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
        """Measured steps of a block: re-measurements are longer (their precision decides the lock)."""
        if block.phase == "remeasure":
            return self.plan.remeasure_steps or 2 * self.plan.measure_steps
        return self.plan.measure_steps

    def _finish(self, block: _Block) -> None:
        rates = self.samples_per_step / np.asarray(block.times)
        score = float(np.median(rates))
        spread = float((np.percentile(rates, 90) - np.percentile(rates, 10)) / score)
        told = None
        if block.phase == "explore" and block.role == "candidate":
            told = self._tell(block.knobs, math.log(score))
        sample = Sample(len(self.samples), block.phase, block.role, block.knobs, score, spread,
                        len(block.times), float(np.sum(block.times)), self.elapsed_s, self.epoch, told)
        self.samples.append(sample)
        self._explored += block.phase == "explore"
        if block.role == "candidate":
            self._since_ref += 1
        elif block.role == "reference":
            self._since_ref = 0
        if self.on_sample is not None:
            self.on_sample(sample)
        if block.role == "locked":
            self._watch(sample)

    def _tell(self, knobs: Knobs, log_score: float) -> float | None:
        """Provisional paired ratio against the reference blocks so far (the strategy learns now; the
        lock decision later uses bracketed ratios)."""
        pair = stats.paired(len(self.samples), log_score, self._refs(), bracket=False)
        if pair is None:
            return None
        sigma, _ = self.sigma()
        self.strategy.tell(knobs, pair.log_ratio, sigma ** 2 * (1.0 + pair.weight2))
        return pair.log_ratio

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
        return (self.knobs, "locked", "locked") if self.plan.retune else None

    def _explore_done(self) -> str:
        if not self.space.names:
            return "every knob is pinned"
        if self._explored >= self.plan.budget_samples:
            return f"budget of {self.plan.budget_samples} samples spent"
        t0 = self._epoch_start[0]
        if self.plan.time_budget_s is not None and self.elapsed_s - t0 >= self.plan.time_budget_s:
            return f"time budget of {self.plan.time_budget_s:g} s spent"
        if self.strategy.converged():
            return "converged (no meaningful expected improvement)"
        return ""

    def _begin_remeasure(self) -> tuple[Knobs, str, str] | None:
        pick = self.strategy.recommend()
        ranked = [pick] if pick is not None else []
        self._finalists = []
        for k in [*ranked, *self.strategy.ranked()]:  # distinct regions: near-twins would tell nothing new
            if k != self.default and all(self._distance(k, f) >= self.plan.finalist_distance for f in self._finalists):
                self._finalists.append(k)
            if len(self._finalists) == self.plan.finalists:
                break
        self._round = 0
        if not self._finalists:
            return self._lock(None, None, "no configuration measured beside the default")
        return self._queue_round()

    def _queue_round(self) -> tuple[Knobs, str, str] | None:
        self._round += 1
        for i, knobs in enumerate(self._finalists):
            if i and i % self.plan.reference_every == 0:
                self._queue.append((self.default, "remeasure", "reference"))
            self._queue.append((knobs, "remeasure", "candidate"))
        return self._queue.pop(0)

    def _after_round(self) -> tuple[Knobs, str, str] | None:
        goal = 1.0 + self.plan.min_gain
        scored = [(k, self.interval_of(k)) for k in self._finalists]
        scored = [(k, iv) for k, iv in scored if iv is not None]
        if not scored:
            return self._lock(None, None, "no finalist could be paired with the reference")
        best_k, best_iv = max(scored, key=lambda s: s[1].gain)
        if best_iv.low >= goal and self._round >= min(self.plan.min_rounds, self.plan.max_rounds):
            return self._lock(best_k, best_iv, f"its interval clears the minimum gain ({goal:.2f}x)")
        futile = self._round >= self.plan.futility_after  # by then a point estimate below the goal is a no
        self._finalists = [k for k, iv in scored if iv.high >= goal and not (futile and iv.gain < goal)]
        if not self._finalists:
            return self._lock(None, (best_k, best_iv), f"no finalist can reach the minimum gain ({goal:.2f}x)")
        if self._round >= self.plan.max_rounds:
            return self._lock(None, (best_k, best_iv),
                              f"no finalist cleared the minimum gain ({goal:.2f}x) in {self._round} rounds")
        return self._queue_round()

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
        self._outside = 0
        return (knobs, "locked", "locked")

    def _watch(self, sample: Sample) -> None:
        """Retune: count locked blocks outside the locked configuration's interval."""
        locked = self.decisions[-1].knobs
        mine = [math.log(s.score) for s in self.samples if s.epoch == self.epoch and s.knobs == locked
                and s.role in ("reference", "candidate")]
        sigma, _ = self.sigma()
        if not mine:
            return
        centre = float(np.mean(mine))
        half = self.plan.watch_z * sigma * math.sqrt(1.0 + 1.0 / len(mine))
        self._outside = self._outside + 1 if abs(math.log(sample.score) - centre) > half else 0
        if self._outside >= self.plan.watch_sustain:
            self._reopen()

    def _reopen(self) -> None:
        earlier = [Observation(o.knobs, o.value, o.variance + self.plan.warm_start_noise ** 2)
                   for o in self.strategy.observations]
        self.epoch += 1
        self.strategy = self.make_strategy(self.epoch)
        self.strategy.warm_start(earlier)
        self.stop_reason, self._explored, self._since_ref = "", 0, 0
        self._epoch_start = (self.elapsed_s, self.steps)
        self.phase = "explore"
        self._queue = [(self.decisions[-1].knobs, "explore", "candidate")] \
            if self.decisions[-1].adopted else []
        self._queue.insert(0, (self.default, "explore", "reference"))

    # ---- statistics -----------------------------------------------------------------------------------
    def _refs(self) -> list[tuple[float, float]]:
        """This epoch's reference blocks as (position, log score), disturbed ones set aside: with four or
        more, a block further than 3.5 robust sigmas (MAD) from their median, e.g. the host busy with
        something else for seconds, pairs with nothing (a slow trend moves the median with it)."""
        refs = [(float(s.index), math.log(s.score)) for s in self.samples
                if s.role == "reference" and s.epoch == self.epoch]
        if len(refs) < 4:
            return refs
        logs = np.asarray([y for _, y in refs])
        centre = float(np.median(logs))
        limit = max(3.5 * 1.4826 * float(np.median(np.abs(logs - centre))), 0.02)
        return [r for r in refs if abs(r[1] - centre) <= limit]

    def disturbed_references(self) -> int:
        """Reference blocks of this epoch set aside as disturbed (see :meth:`_refs`)."""
        return sum(1 for s in self.samples if s.role == "reference" and s.epoch == self.epoch) - len(self._refs())

    def sigma(self) -> tuple[float, int]:
        """One block's noise (log units) and its degrees of freedom, from this epoch's reference blocks."""
        return stats.block_sigma([y for _, y in self._refs()])

    def interval_of(self, knobs: Knobs) -> stats.Interval | None:
        """Gain of ``knobs`` over the reference from this epoch's re-measured blocks, bracketed."""
        refs = self._refs()
        pairs = [stats.paired(float(s.index), math.log(s.score), refs) for s in self.samples
                 if s.knobs == knobs and s.phase == "remeasure" and s.role == "candidate" and s.epoch == self.epoch]
        sigma, df = self.sigma()
        return stats.interval([p for p in pairs if p is not None], sigma, df, self.plan.confidence)
