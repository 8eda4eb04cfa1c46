"""How well the model predicts measured runs: error summaries and the crossover, measured vs predicted."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .data import Observation
from .fit import ScaleModel
from .predict import Crossover, crossover

GOAL = 0.15
TIE = math.log(1.10)  # measured flat and hierarchical within 10 %: a tie, not a winner


def summarize(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, p90 and max of |relative error|, and how many points are within 15 %."""
    e = np.abs([x["rel_error"] for x in errors]) if errors else np.zeros(1)
    return {"points": len(errors), "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "max": float(e.max()), "within_15pct": int((e <= GOAL).sum()) if errors else 0}


def measured_crossover(obs: Sequence[Observation]) -> Crossover | None:
    """Where flat and hierarchical trade places in one run's measurements (geometric interpolation
    between measured sizes where one is faster by more than 10 %: closer is a tie, and noise on a
    shared machine flips ties), or None without both measured at two sizes or more."""
    flat = {o.size: o.time_s for o in obs if o.algorithm == "flat"}
    hier = {o.size: o.time_s for o in obs if o.algorithm == "hierarchical"}
    sizes = sorted(set(flat) & set(hier))
    if len(sizes) < 2:
        return None
    pairs = [(s, math.log(flat[s] / hier[s])) for s in sizes]
    pairs = [(s, d) for s, d in pairs if abs(d) >= TIE] or pairs
    sizes, diff = [s for s, _ in pairs], [d for _, d in pairs]
    found = []
    for (s0, d0), (s1, d1) in zip(zip(sizes, diff), zip(sizes[1:], diff[1:])):
        if (d0 < 0) != (d1 < 0):
            found.append(s0 * (s1 / s0) ** (d0 / (d0 - d1)))
    name = {True: "flat", False: "hierarchical"}
    return Crossover(tuple(found), name[diff[0] < 0], name[diff[-1] < 0])


def crossover_check(model: ScaleModel, obs: Sequence[Observation]) -> list[dict[str, Any]]:
    """Per multi-host run: the measured and predicted crossover (predicted over the run's own size
    range), and the factor between them when both have one."""
    out = []
    for source in dict.fromkeys(o.source for o in obs):
        mine = [o for o in obs if o.source == source and o.topo.hosts > 1]
        measured = measured_crossover(mine)
        if measured is None:
            continue
        sizes = [o.size for o in mine]
        predicted = crossover(model, mine[0].topo, mine[0].knobs, low=min(sizes), high=max(sizes))
        row: dict[str, Any] = {"source": source, "measured": measured.describe(),
                               "predicted": predicted.describe() if predicted else "n/a"}
        if measured.sizes and predicted and predicted.sizes:
            row["factor"] = predicted.sizes[0] / measured.sizes[0]
        row["same_winners"] = bool(predicted) and (measured.faster_below, measured.faster_above) == \
            (predicted.faster_below, predicted.faster_above)
        out.append(row)
    return out


def step_check(model: ScaleModel, landscape: dict[str, Any], workload: Any, link: str) -> list[dict[str, Any]]:
    """Per grid point of a ``bench landscape`` file (measured on the workload's scenario): the median
    measured step time vs the simulated one, on the landscape's layout (its nodes, ranks and cores;
    ``link``: the link it ran behind)."""
    from ..errors import UsageError
    from ..knobs import Knobs
    from .costs import Topology
    from .step import simulate_step

    try:
        world, nodes = int(landscape["world_size"]), int(landscape["nodes"])
        cores = int((landscape.get("hardware") or {}).get("cpu_cores") or 0)
        points = [(Knobs(**p["knobs"]), [t for visit in p["steps_s"] for t in visit]) for p in landscape["points"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"not a bench landscape file with step times ({type(exc).__name__}: {exc})") from None
    if world % nodes:
        raise UsageError(f"landscape: {world} ranks do not split evenly over {nodes} nodes")
    topo = Topology(nodes, world // nodes, link if nodes > 1 else "none", max(1.0, world / cores) if cores else 1.0,
                    baselines_on_link=False)
    out = []
    for knobs, steps in points:
        if not steps:
            continue
        measured = float(np.median(steps))
        predicted = simulate_step(model, workload, topo, knobs).step_s
        out.append({"knobs": knobs.as_dict(), "measured_s": measured, "predicted_s": predicted,
                    "rel_error": (predicted - measured) / measured})
    return out
