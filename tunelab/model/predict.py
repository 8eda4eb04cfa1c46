"""Predictions from a fitted model: allreduce times per size and algorithm, the flat vs hierarchical
crossover, and step time over a grid of knob settings."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..knobs import Knobs
from ..units import human_size
from .costs import BASELINES, Topology
from .fit import ScaleModel
from .step import Workload, simulate_step

DEFAULT_SIZES = tuple(1 << e for e in range(12, 31, 2))  # 4 KiB .. 1 GiB
# The grid ``bench landscape`` measures by default, and hierarchical on several hosts.
DEFAULT_GRID: dict[str, tuple] = {
    "fusion_threshold_bytes": (0, 1 << 20, 8 << 20, 64 << 20),
    "cycle_time_ms": (0.5, 2.0, 8.0, 32.0),
    "segment_bytes": (256 << 10, 4 << 20),
    "hierarchical": (False, True),
}


EMULATED = "*"  # a baseline fitted on emulated nodes, whose bytes did not cross the link


def algorithms_for(model: ScaleModel, topo: Topology) -> list[str]:
    """What the model can predict on ``topo``: the engine's paths, then fitted baselines; ``mpi*``: MPI
    as measured beside emulated nodes (its bytes did not cross the link), when no lab fit exists."""
    engine = ["flat", "hierarchical"] if topo.hosts > 1 else ["flat"]
    out = [a for a in engine if model.can_predict(a, topo)]
    for b in BASELINES:
        if model.can_predict(b, topo):
            out.append(b)
        elif topo.hosts > 1 and model.can_predict(b, replace(topo, baselines_on_link=False)):
            out.append(b + EMULATED)
    return out


def time_s(model: ScaleModel, label: str, topo: Topology, size: int, knobs: Knobs | None = None) -> float:
    """:meth:`ScaleModel.time_s` for a label of :func:`algorithms_for`."""
    if label.endswith(EMULATED):
        return model.time_s(label[:-1], replace(topo, baselines_on_link=False), size, knobs)
    return model.time_s(label, topo, size, knobs)


def allreduce_table(model: ScaleModel, topo: Topology, sizes: Sequence[int],
                    knobs: Knobs | None = None) -> list[dict]:
    """One row per size and algorithm: predicted time, algbw and busbw (nccl-tests' definitions)."""
    knobs = knobs or Knobs()
    rows = []
    for size in sizes:
        for algo in algorithms_for(model, topo):
            t = _finite(time_s(model, algo, topo, size, knobs), f"{algo} at {human_size(size)}")
            algbw = size / t / 1e9
            rows.append({"algorithm": algo if topo.hosts > 1 or algo != "flat" else "engine", "size": size,
                         "time_us": t * 1e6, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * 2 * (topo.ranks - 1) / topo.ranks})
    return rows


@dataclass(frozen=True)
class Crossover:
    """Where flat ring and hierarchical trade places, and from which size the larger sizes' winner
    leads by more than 10 % (its *onset*: on a shared machine the two are often a tie at small sizes,
    where there is no sign change to find but there is a size from which one of them pays)."""

    sizes: tuple[float, ...]     # sizes (bytes, geometric interpolation) where the faster one changes
    faster_below: str            # the faster algorithm at the smallest size searched
    faster_above: str            # ... and at the largest
    onset: float | None = None   # from this size on, ``faster_above`` leads by > 10 % at every size
    onset_below_range: bool = False  # it already does at the smallest size: the onset is at most that
    ties: bool = False           # some sizes are ties (within 10 %): the winners are named at the others

    def describe(self) -> str:
        if not self.sizes:
            if self.faster_below == "tie" or self.faster_above == "tie":
                text = "no crossover: flat and hierarchical within 10 % at every size with a winner" \
                    if self.faster_below != self.faster_above else "a tie (within 10 %) at every size"
            elif self.ties:
                text = f"no crossover: {self.faster_below} is faster at every size with a winner (the others within 10 %)"
            else:
                text = f"no crossover: {self.faster_below} is faster at every size searched"
        elif len(self.sizes) == 1:
            text = f"crossover at {human_size(self.sizes[0])}: {self.faster_below} below, {self.faster_above} above"
        else:  # each crossing is a change of winner, so the winners alternate between them
            flip = {"flat": "hierarchical", "hierarchical": "flat"}
            spans, winner = [f"{self.faster_below} below {human_size(self.sizes[0])}"], self.faster_below
            for lo, hi in itertools.pairwise(self.sizes):
                winner = flip.get(winner, winner)
                spans.append(f"{winner} from {human_size(lo)} to {human_size(hi)}")
            spans.append(f"{self.faster_above} above {human_size(self.sizes[-1])}")
            text = f"crossovers at {', '.join(human_size(s) for s in self.sizes)}: {', '.join(spans)}"
        if self.onset is not None and self.faster_above != "tie":
            bound = "at most " if self.onset_below_range else ""
            text += f"; {self.faster_above} faster by > 10 % from {bound}{human_size(self.onset)} on"
        return text


TIE = math.log(1.10)  # flat and hierarchical within 10 %: a tie, not a winner


def onset(sizes: Sequence[float], diffs: Sequence[float]) -> tuple[float | None, bool]:
    """``diffs``: log(flat time / hierarchical time) at ascending ``sizes``.  The size from which the
    largest size's winner (by more than 10 %) wins at every larger size, interpolated geometrically
    where the difference crosses the 10 % line; ``(None, False)`` when the largest size is a tie, and
    ``(sizes[0], True)`` when it wins everywhere (the onset is then at most the smallest size)."""
    if not diffs or abs(diffs[-1]) < TIE:
        return None, False
    sign = 1.0 if diffs[-1] > 0 else -1.0
    i = len(diffs) - 1
    while i > 0 and sign * diffs[i - 1] >= TIE:
        i -= 1
    if i == 0:
        return float(sizes[0]), True
    (s0, d0), (s1, d1) = (sizes[i - 1], sign * diffs[i - 1]), (sizes[i], sign * diffs[i])
    f = (TIE - d0) / (d1 - d0) if d1 != d0 else 1.0
    return float(s0 * (s1 / s0) ** min(1.0, max(0.0, f))), False


def crossover(model: ScaleModel, topo: Topology, knobs: Knobs | None = None,
              low: int = 1 << 10, high: int = 1 << 32, points_per_octave: int = 4,
              route: str = "call") -> Crossover | None:
    """The crossover on ``topo`` (None on one host, or on hosts of one rank each: there both are the same
    path, the engine taking hierarchical as the flat ring), for single tensors (``route="call"``, as
    ``bench allreduce`` times them: small ones take the short route) or a training job's fused buckets
    (``"bucket"``)."""
    if topo.hosts < 2 or topo.ranks_per_host == 1:
        return None
    knobs = knobs or Knobs()
    steps = round(math.log2(high / low) * points_per_octave)
    sizes = [low * 2 ** (s / points_per_octave) for s in range(steps + 1)]
    diff = [math.log(_finite(model.time_s("flat", topo, int(s), knobs, route), f"flat at {human_size(s)}")
                     / _finite(model.time_s("hierarchical", topo, int(s), knobs, route),
                               f"hierarchical at {human_size(s)}")) for s in sizes]
    found = []
    for (s0, d0), (s1, d1) in zip(zip(sizes, diff), zip(sizes[1:], diff[1:])):
        if (d0 < 0) != (d1 < 0) and d0 != d1:
            f = d0 / (d0 - d1)
            found.append(s0 * (s1 / s0) ** f)
    name = {True: "flat", False: "hierarchical"}
    start, below = onset(sizes, diff)
    return Crossover(tuple(found), name[diff[0] < 0], name[diff[-1] < 0], start, below)


def grid_knobs(grid: dict[str, Sequence] | None, topo: Topology, base: Knobs | None = None,
               pinned: Sequence[str] = ()) -> list[Knobs]:
    """Every combination of ``grid`` on top of ``base`` (hierarchical only on several hosts); the
    ``pinned`` knobs keep ``base``'s value."""
    grid = {k: v for k, v in (grid or DEFAULT_GRID).items() if k not in pinned}
    if topo.hosts < 2:
        grid.pop("hierarchical", None)
    names = list(grid)
    base = base or Knobs()
    return [base.replace(**dict(zip(names, combo))) for combo in itertools.product(*(grid[n] for n in names))]


def step_table(model: ScaleModel, workload: Workload, topo: Topology,
               knobs_list: Sequence[Knobs]) -> list[dict]:
    """Predicted step time per knob setting, fastest first."""
    rows = []
    for k in knobs_list:
        p = simulate_step(model, workload, topo, k)
        _finite(p.step_s, "a step")
        rows.append({"knobs": k, "step_ms": p.step_s * 1e3, "compute_ms": p.compute_s * 1e3,
                     "exposed_comm_ms": p.exposed_comm_s * 1e3, "cycles": p.cycles, "buckets": p.buckets})
    rows.sort(key=lambda r: r["step_ms"])
    return rows


def _finite(t: float, what: str) -> float:
    """``t``, a predicted time; ModelError (a usage error) where the model's values make it no time
    at all (inf, NaN, 0: parameters out of any measured range, a model file edited by hand), or days:
    sizes and ranks past any job's (99999GiB), or values no fit gives though the loader lets them by."""
    from .fit import ModelError

    if math.isfinite(t) and t >= LONGEST_S:
        raise ModelError(f"the model predicts {t:.3g} s ({t / 86400:.3g} days) for {what}, past the longest time "
                         f"it answers for ({LONGEST_S:g} s): ask for smaller sizes or fewer ranks (or refit the model, "
                         "if its values are wrong)")
    if not (math.isfinite(t) and t > 0):
        raise ModelError(f"the model predicts {t!r} s for {what}: its values are out of range (refit it)")
    return t


LONGEST_S = 1e6  # no collective nor step takes days: a model that predicts it has values no fit makes
