"""A tuning session inside one training run: the tuning driver fed the live training loop's steps.

Call ``step_done()`` after every training step on every rank.  Rank 0 times the steps (data-parallel
steps are synchronous, so one rank's step time is the job's) and feeds them to the
:class:`~tunelab.tuning.driver.Driver`, which decides; new knobs go to the coordinator, which every rank
then applies at the same cycle.  The protocol itself (reference blocks, exploration, re-measurement,
lock, retune) lives in :mod:`.driver`, where ``bench tuner`` runs it on replayed landscapes.

A per-step broadcast of rank 0's phase keeps every rank's view of "still tuning" equal.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..knobs import Knobs
from .driver import Driver
from .plan import Decision, Plan, Sample
from .space import SearchSpace
from .strategies import Told

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..engine.coordinator import Coordinator

SessionPlan = Plan  # the name earlier releases used

__all__ = ["Decision", "Sample", "SessionPlan", "TuningSession"]


class TuningSession:
    def __init__(self, coordinator: Coordinator, comm: MPI.Comm, samples_per_step: float,
                 space: SearchSpace | None, make_strategy: Callable[[int], Told] | None, plan: Plan | None = None,
                 on_sample: Callable[[Sample], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        plan = plan or Plan()
        self.coordinator, self.comm, self.plan, self.clock = coordinator, comm, plan, clock
        self.driver = (Driver(space, make_strategy, plan, samples_per_step, on_sample)
                       if comm.rank == 0 else None)
        self.phase = "warmup"
        self._last = clock()

    @property
    def tuning(self) -> bool:
        return self.phase != "locked"

    @property
    def locked(self) -> Knobs | None:
        return self.driver.locked if self.driver is not None else None

    def step_done(self) -> bool:
        """Account one finished step; returns True while tuning goes on (the same on every rank)."""
        elapsed = self.clock() - self._last
        if self.driver is not None:
            knobs = self.driver.step_done(elapsed)
            if knobs is not None:
                self.coordinator.set_knobs(knobs)
            self.phase = self.driver.phase
        self.phase = self.comm.bcast(self.phase, root=0)
        # The next step is timed from here: the decision just taken (a GP fit can take a second) and the
        # broadcast every rank waited in are not the training step's, and a block after no knob change
        # has no discarded step to absorb them.
        self._last = self.clock()
        return self.tuning
