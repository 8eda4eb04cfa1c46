"""A tuning session inside one training run.

Call ``step_done()`` after every training step on every rank.  Rank 0 times the steps
(data-parallel steps are synchronous, so one rank's step time is the job's), decides, and
asks the coordinator for new knobs, which every rank then applies at the same cycle.

Rank 0 goes through these phases:

1. ``warmup``: steps that are not measured (caches, allocators, first traces);
2. ``default``: the default configuration is measured first, as the baseline;
3. ``explore``: the tuner proposes knobs; each *sample* drops ``discard_steps`` steps after
   the change, then measures ``measure_steps`` steps; score = samples/s from their median;
4. ``remeasure``: when the budget is spent or the tuner converged, the best few candidates
   and the default are measured again, so the winner and its gain rest on repeated samples;
5. ``locked``: the winner is applied for the rest of the run.

A per-step broadcast of rank 0's phase keeps every rank's view of "still tuning" equal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..knobs import Knobs

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..engine.coordinator import Coordinator
    from .tuner import Tuner


@dataclass(frozen=True)
class SessionPlan:
    warmup_steps: int = 2
    discard_steps: int = 1
    measure_steps: int = 3
    budget_samples: int = 20        # explored samples, the default included
    time_budget_s: float | None = None
    remeasure_top: int = 3
    remeasure_rounds: int = 2       # candidates re-measured in interleaved rounds (ABCABC): drift hits all
    # Adopt a config other than the default only if each of its re-measurements beat each of the
    # default's: a "gain" inside the noise would change a user's job for nothing.
    clear_win: bool = True


@dataclass(frozen=True)
class Sample:
    index: int
    phase: str            # default | explore | remeasure | locked
    knobs: Knobs
    score: float          # samples/s
    spread: float         # (p90 - p10) / median of the measured steps' samples/s
    steps: int
    seconds: float


@dataclass
class _Measuring:
    knobs: Knobs
    phase: str
    discard_left: int
    times: list[float] = field(default_factory=list)


class TuningSession:
    def __init__(self, coordinator: "Coordinator", comm: "MPI.Comm", samples_per_step: float,
                 tuner: "Tuner | None", plan: SessionPlan = SessionPlan(),
                 on_sample: Callable[[Sample], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.coordinator, self.comm, self.plan = coordinator, comm, plan
        self.samples_per_step = samples_per_step
        self.tuner = tuner if comm.rank == 0 else None
        self.on_sample = on_sample
        self.clock = clock
        self.samples: list[Sample] = []
        self.phase = "warmup"
        self.stop_reason = ""
        self.locked: Knobs | None = None
        self.kept_default = False  # the best finalist did not beat the default clearly
        self.runner_up: Knobs | None = None  # that finalist, when so
        self._warmup_left = plan.warmup_steps
        self._queue: list[tuple[Knobs, str]] = []
        self._current: _Measuring | None = None
        self._last = clock()
        self._start = self._last
        self._explored = 0

    @property
    def tuning(self) -> bool:
        return self.phase not in ("locked",)

    def step_done(self) -> bool:
        """Account one finished step; returns True while tuning goes on (the same on every rank)."""
        now = self.clock()
        elapsed, self._last = now - self._last, now
        if self.comm.rank == 0:
            self._advance(elapsed)
        self.phase = self.comm.bcast(self.phase, root=0)
        return self.tuning

    # ---- rank 0 -------------------------------------------------------------------------------
    def _advance(self, step_s: float) -> None:
        if self.phase == "locked":
            return
        if self.phase == "warmup":
            self._warmup_left -= 1
            if self._warmup_left <= 0:
                self._start_sample(self.tuner.space.base, "default")
            return
        cur = self._current
        if cur.discard_left > 0:
            cur.discard_left -= 1
            return
        cur.times.append(step_s)
        if len(cur.times) >= self.plan.measure_steps:
            self._finish_sample(cur)

    def _start_sample(self, knobs: Knobs, phase: str) -> None:
        self.coordinator.set_knobs(knobs)
        self._current = _Measuring(knobs, phase, self.plan.discard_steps)
        self.phase = phase

    def _finish_sample(self, cur: _Measuring) -> None:
        rates = self.samples_per_step / np.asarray(cur.times)
        score = float(np.median(rates))
        spread = float((np.percentile(rates, 90) - np.percentile(rates, 10)) / score)
        sample = Sample(len(self.samples), cur.phase, cur.knobs, score, spread, len(cur.times),
                        float(np.sum(cur.times)))
        self.samples.append(sample)
        if cur.phase in ("default", "explore"):
            self._explored += 1
            self.tuner.tell(cur.knobs, score, spread)
        if self.on_sample is not None:
            self.on_sample(sample)
        self._next()

    def _next(self) -> None:
        if self.phase in ("default", "explore"):
            reason = self._explore_done()
            if not reason:
                self._start_sample(self.tuner.ask(), "explore")
                return
            self.stop_reason = reason
            top = self._top_candidates()
            self._queue = [(k, "remeasure") for _ in range(self.plan.remeasure_rounds) for k in top]
        if self._queue:
            knobs, phase = self._queue.pop(0)
            self._start_sample(knobs, phase)
            return
        self.locked = self.best_knobs()
        self.coordinator.set_knobs(self.locked)
        self.phase = "locked"

    def _explore_done(self) -> str:
        if not self.tuner.searchable:
            return "every knob is pinned"
        if self._explored >= self.plan.budget_samples:
            return f"budget of {self.plan.budget_samples} samples spent"
        if self.plan.time_budget_s is not None and self.clock() - self._start >= self.plan.time_budget_s:
            return f"time budget of {self.plan.time_budget_s:g} s spent"
        if self.tuner.converged():
            return "converged (no meaningful expected improvement)"
        return ""

    def _top_candidates(self) -> list[Knobs]:
        ranked = sorted(self.samples, key=lambda s: -s.score)
        top: list[Knobs] = []
        for s in ranked:
            if s.knobs not in top:
                top.append(s.knobs)
            if len(top) == self.plan.remeasure_top:
                break
        default = self.tuner.space.base
        return top if default in top else [*top, default]

    # ---- results ------------------------------------------------------------------------------
    def scores_of(self, knobs: Knobs) -> list[float]:
        """Scores of ``knobs``: its re-measurements when it has any (taken side by side with the other
        finalists, so they compare fairly), otherwise its exploration samples."""
        again = [s.score for s in self.samples if s.knobs == knobs and s.phase == "remeasure"]
        return again or [s.score for s in self.samples if s.knobs == knobs]

    def best_knobs(self) -> Knobs:
        """The finalist with the best mean over its re-measurements; the default instead when that
        finalist did not beat it clearly (see ``SessionPlan.clear_win``)."""
        candidates = {s.knobs for s in self.samples if s.phase == "remeasure"} or {s.knobs for s in self.samples}
        best = max(candidates, key=lambda k: float(np.mean(self.scores_of(k))))
        default = self.tuner.space.base
        if self.plan.clear_win and default in candidates and best != default and \
                min(self.scores_of(best)) <= max(self.scores_of(default)):
            self.kept_default, self.runner_up = True, best
            return default
        return best
