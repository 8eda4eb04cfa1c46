"""What the tuning protocol (:mod:`.driver`) is told and what it tells: the :class:`Plan` (how long
each phase runs and what counts as a gain), each measured block (:class:`Sample`) and each lock
(:class:`Decision`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..knobs import Knobs
from . import stats


@dataclass(frozen=True)
class Plan:
    warmup_steps: int = 2
    discard_steps: int = 1
    measure_steps: int = 3
    block_seconds: float | None = 1.0  # a measuring block lasts at least about this long: measure_steps is
                                       # raised to ceil(block_seconds / the fastest warm-up step), once per
                                       # run (None: measure_steps as given)
    budget_samples: int = 14        # most blocks measured in exploration, the reference's included
    time_budget_s: float | None = None  # seconds of training a search may take, from its start (warm-up,
                                        # discarded steps and every block): exploration ends while one round of
                                        # re-measurement still fits, and rounds stop when the next would not
    reference_every: int = 3        # candidate blocks between two blocks of the reference
    explore_first: int | None = None  # candidates before exploration may stop early (None: searched knobs + 2)
    explore_more: int = 2           # candidates after a failed re-measurement before it may stop again
    confirm_z: float = 1.0          # promising: estimate - z sd clears the goal, and nothing else is expected
    near_best: float | None = 0.02  # ... to beat it by more than this (estimate + z sd; None: not asked)
    futile_z: float = 2.0           # futile: no configuration's estimate + z sd reaches the goal
    finalists: int = 1
    remeasure_steps: int | None = None  # measured steps of a re-measurement block (None: from remeasure_sigma)
    remeasure_sigma: float | None = 0.02  # ... as many as bring the step-noise part of a round's ratio to this
    remeasure_max_steps: int | None = None  # ... at most (None: 4 x a block's steps), at least a block's steps
    max_rounds: int = 4
    futility_after: int = 2         # from this round on, finalists whose gain estimate is below the goal drop
    min_rounds: int = 1             # rounds before a finalist may be adopted
    finalist_distance: float = 0.1  # finalists at least this far apart (unit coordinates)
    min_gain: float = 0.01          # a gain smaller than this is not worth changing a user's job for
    confidence: float = 0.9         # two-sided: the low end is a 95 % one-sided bound
    lock_from_exploration: bool = True  # lock without re-measuring when a simultaneous interval already clears
    retune: bool = False
    retell: bool = True             # a candidate's bracketed ratio replaces its provisional one once the
                                    # reference after it is measured
    watch_sustain: int = 4          # locked blocks in a row outside the interval that re-open the search
    watch_z: float = 3.0            # the watched interval: the blocks' line +- t at the level of watch_z sigmas,
    check_watch_z: float = 2.0      # ... or of check_watch_z where a check would follow (a lock that claims a gain)
    watch_baseline: int = 4         # locked blocks measured before the watch begins
    watch_window: int = 8           # the watched interval centres on the last this many locked blocks
    check_z: float | None = 1.0     # a run outside the interval is checked first (locked vs default, paired):
                                    # the search re-opens when the ratio falls this many sigmas below the
                                    # lock's claimed gain (None: no check, re-open at once); in doubt it
                                    # re-opens: a missed move costs for good, a needless search a few blocks
    warm_start_noise: float = 0.10  # extra sigma (log units) of earlier trials (a retune, a stored profile)

    def __post_init__(self) -> None:
        steps = {"measure_steps": self.measure_steps, "remeasure_steps": self.remeasure_steps,
                 "remeasure_max_steps": self.remeasure_max_steps}
        bad = [f"{k}={v}" for k, v in steps.items() if v is not None and (int(v) != v or v < 1)]
        if self.remeasure_sigma is not None and not self.remeasure_sigma > 0:
            bad.append(f"remeasure_sigma={self.remeasure_sigma}")
        if self.block_seconds is not None and not (math.isfinite(self.block_seconds) and self.block_seconds > 0):
            bad.append(f"block_seconds={self.block_seconds}")
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            bad.append(f"time_budget_s={self.time_budget_s}")
        if not (isinstance(self.reference_every, int) and self.reference_every >= 1):
            bad.append(f"reference_every={self.reference_every}")
        if not 0 < self.confidence < 1:
            bad.append(f"confidence={self.confidence}")
        if bad:
            raise ValueError(f"tuning plan: {', '.join(bad)} (steps and reference_every must be whole numbers "
                             ">= 1, the sigma and seconds > 0, the confidence between 0 and 1)")


def block_steps_for(measure_steps: int, block_seconds: float | None, fastest_s: float) -> int:
    """Measured steps of a block: ``measure_steps``, or more when the fastest warm-up step (``fastest_s``;
    inf: none was timed) is shorter than ``block_seconds / measure_steps``, so that a block lasts at least
    ``block_seconds`` (None: no minimum).  The tuning driver and ``bench landscape``'s visits use it."""
    if block_seconds is None or not math.isfinite(fastest_s) or fastest_s <= 0:
        return measure_steps
    return max(measure_steps, math.ceil(block_seconds / fastest_s - 1e-9))


@dataclass(frozen=True)
class Sample:
    index: int
    phase: str            # explore | remeasure | locked | check
    role: str             # reference | candidate | locked
    knobs: Knobs
    score: float          # samples/s: geometric mean over the block's measured steps
    spread: float         # (p90 - p10) / median of those steps' samples/s
    steps: int
    seconds: float
    at_s: float           # end of the block, seconds of measured training since the driver started
    epoch: int = 0        # 0 for the first search, +1 per retune
    told: float | None = None  # the paired log ratio told to the strategy (candidates)
    logs: tuple[float, ...] = ()  # log samples/s of each measured step (what the statistics read)

    @property
    def log_score(self) -> float:
        return sum(self.logs) / len(self.logs) if self.logs else math.log(self.score)


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
