"""Step time of a workload under given knobs, simulated on the fitted allreduce model.

The workload is what a replay scenario holds (:mod:`tunelab.workloads.replay`): a model's gradient
tensors in backward order, a forward pass of ``forward_ms`` and a backward pass of ``backward_ms``
that makes each gradient ready after its share (proportional to its elements) of the backward time.

The coordinator (:mod:`tunelab.engine.coordinator`) is simulated as it runs:

* it sleeps while nothing is pending; a submission wakes it, and its next cycle starts on the cycle
  grid (the last cycle's start plus a whole number of cycle times), so the first cycle of a step starts
  half a cycle after the first gradient on average (the grid's phase against a new step is taken as
  uniform);
* a cycle negotiates (``negotiation_s``), takes every gradient ready at the cycle's start, plans
  fusion buckets of at most ``fusion_threshold_bytes`` (:func:`tunelab.engine.fusion.plan_buckets`),
  and runs them one after another on the single communication channel (each bucket's time from the
  model: flat ring or hierarchical by the knob, pieces of ``segment_bytes``, on the general path: a
  fused bucket takes no short route, and the cycle's negotiation is its agreement);
* if gradients arrived meanwhile, the next cycle starts ``cycle_time_ms`` after this one started
  (or when this one ends, if later); otherwise the coordinator sleeps until the next submission, and
  the cycle it wakes for starts at the first grid point after it;
* from the end of backward the step waits for its gradients, and a waiter hurries the coordinator:
  cycles then start as soon as the channel is free, off the grid.

Communication overlaps the remaining backward compute (another thread).  With a core per rank the
compute does not slow down; on an oversubscribed machine (``over = ranks / cores - 1 > 0``, as the lab
and emulated nodes are) the communication thread takes cores from the compute: a share
``over / (1 + over)`` of the channel's busy time is added to the compute (processor sharing, a
heuristic: it is not fitted).  The step ends when the last bucket is reduced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..knobs import Knobs
from .costs import Topology
from .fit import ScaleModel

NEGOTIATION_BYTES = 64  # the coordinator's per-cycle bit-set allreduce, a few words


@dataclass(frozen=True)
class Workload:
    """Gradient sizes in bytes (backward order) and the compute that produces them."""

    name: str
    gradient_bytes: tuple[int, ...]
    forward_ms: float
    backward_ms: float
    assumed: bool = False  # the compute times are a replay's defaults (a training scenario records none)

    @property
    def total_bytes(self) -> int:
        return sum(self.gradient_bytes)

    def ready_times_s(self) -> list[float]:
        """When each gradient is submitted, from the start of the step (seconds)."""
        total = max(1, self.total_bytes)
        out, acc = [], 0
        for b in self.gradient_bytes:
            acc += b
            out.append((self.forward_ms + self.backward_ms * acc / total) / 1000.0)
        return out

    @classmethod
    def from_scenario(cls, name_or_path: str, element_bytes: int = 4) -> Workload:
        """The workload of a scenario (shipped name or file; ScenarioError, exit 2, when bad), its
        gradients of ``element_bytes`` an element."""
        from ..scenarios import load_scenario

        sc = load_scenario(name_or_path)
        work = cls.of_model(sc.name, sc.model, sc.replay_forward_ms, sc.replay_backward_ms, element_bytes)
        return replace(work, assumed=sc.workload != "replay")

    @classmethod
    def of_model(cls, name: str, model: str, forward_ms: float, backward_ms: float,
                 element_bytes: int = 4) -> Workload:
        """A shipped model's gradients (float32, or ``element_bytes`` an element: 2 for a half-precision
        replay) with the given compute times."""
        from ..workloads.shapes import gradient_shapes

        return cls(name, tuple(element_bytes * _elements(s) for s in gradient_shapes(model)), float(forward_ms),
                   float(backward_ms))


def _elements(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass
class StepPrediction:
    """One simulated step: its time, the compute alone, and how the communication went."""

    step_s: float
    compute_s: float
    cycles: int
    buckets: int
    comm_s: float  # time the channel was busy (negotiations included)
    bucket_log: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, bytes)

    @property
    def exposed_comm_s(self) -> float:
        return self.step_s - self.compute_s


def algorithm_for(knobs: Knobs, topo: Topology) -> str:
    return "hierarchical" if knobs.hierarchical and topo.hosts > 1 else "flat"


def negotiation_s(model: ScaleModel, topo: Topology) -> float:
    """One negotiation: a tiny allreduce over every rank (MPI's, when the model has it: through the
    link when fitted so, else as measured beside emulated nodes, which do not slow it either)."""
    from dataclasses import replace

    if topo.ranks == 1:
        return 0.0
    for t in (topo, replace(topo, baselines_on_link=False)):
        if model.can_predict("mpi", t):
            return model.time_s("mpi", t, NEGOTIATION_BYTES)
    return model.time_s("flat", topo, NEGOTIATION_BYTES, Knobs(oneshot_max_bytes=1 << 20))


def simulate_step(model: ScaleModel, workload: Workload, topo: Topology, knobs: Knobs,
                  keep_log: bool = False) -> StepPrediction:
    """Simulate one step (see the module doc)."""
    from ..engine.fusion import Entry, plan_buckets

    ready = workload.ready_times_s()
    sizes = workload.gradient_bytes
    compute_s = (workload.forward_ms + workload.backward_ms) / 1000.0
    if not sizes:
        return StepPrediction(compute_s, compute_s, 0, 0, 0.0)
    algo, neg = algorithm_for(knobs, topo), negotiation_s(model, topo)
    cache: dict[int, float] = {}

    def bucket_s(nbytes: int) -> float:
        if nbytes not in cache:
            cache[nbytes] = model.time_s(algo, topo, nbytes, knobs, route="bucket")
        return cache[nbytes]

    cycle_s = knobs.cycle_time_ms / 1000.0
    eps = 1e-9  # (a second's billionth: ready times and grid points that are equal up to rounding)

    def begins(natural: float, earliest: float) -> float:
        """When a cycle starts: on its grid point, or once the step waits for its gradients (the end of
        backward, when a waiter hurries the coordinator) if that comes first."""
        return min(natural, max(earliest, compute_s))

    t, i, n = begins(ready[0] + cycle_s / 2.0, ready[0]), 0, len(sizes)
    cycles = buckets = 0
    busy = 0.0
    log: list[tuple[float, float, int]] = []
    while i < n:
        start, cycles = t, cycles + 1
        j = i
        while j < n and ready[j] <= start + eps:
            j += 1
        end = start + neg
        plan = plan_buckets([Entry(sizes[q], "float32") for q in range(i, j)], knobs.fusion_threshold_bytes, True)
        for b in plan:
            dt = bucket_s(b.nbytes)
            if keep_log:
                log.append((end, end + dt, b.nbytes))
            end += dt
        buckets += len(plan)
        busy += end - start
        i = j
        if i < n:
            if ready[i] <= end + eps:
                t = begins(max(end, start + cycle_s), end)
            else:  # idle until the submission, then the next point of the cycle grid
                t = begins(start + math.ceil((ready[i] - start) / cycle_s - eps) * cycle_s, ready[i])
        else:
            t = end
    # Oversubscribed (more ranks than cores): communication runs on the cores the compute needs, so a
    # share over / (1 + over) of the channel's busy time delays the compute (processor sharing).
    shared = busy * topo.over / (1.0 + topo.over)
    return StepPrediction(max(t, compute_s + shared), compute_s, cycles, buckets, busy, log)
