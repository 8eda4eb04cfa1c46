"""How well the model predicts measured runs: error summaries and the crossover, measured vs predicted."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..knobs import Knobs
from .costs import Topology
from .data import Observation
from .fit import ScaleModel
from .predict import TIE, Crossover, onset

GOAL = 0.15


def summarize(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, p90 and max of |relative error|, and how many points are within 15 %."""
    e = np.abs([x["rel_error"] for x in errors]) if errors else np.zeros(1)
    return {"points": len(errors), "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "max": float(e.max()), "within_15pct": int((e <= GOAL).sum()) if errors else 0}


def _winner(d: float) -> str:
    return "tie" if abs(d) < TIE else ("flat" if d < 0 else "hierarchical")


def crossover_of(diffs: dict[int, float]) -> Crossover | None:
    """Where flat and hierarchical trade places among ``{size: log(flat time / hierarchical time)}``,
    and the onset of the larger sizes' winner (:func:`tunelab.model.predict.onset`).

    A crossover needs a winner on each side: a size where one is faster by more than 10 % followed
    (past sizes closer than that: ties, whose sign noise on a shared machine flips) by a size where
    the other is.  Between those two, the crossing is where the difference changes sign for good:
    the last sign change before the new winner's lead, interpolated geometrically between the two
    sizes around it.  The two times cross there even when the new winner's lead grows slowly (a
    shallow angle): the middle of the band of ties would name a size well past the crossing.
    ``faster_below``/``faster_above`` are ``tie`` when no size has a winner."""
    sizes = sorted(diffs)
    if len(sizes) < 2:
        return None
    pairs = [(s, diffs[s]) for s in sizes]
    sig = [i for i, (_, d) in enumerate(pairs) if abs(d) >= TIE]
    start, below = onset(sizes, [d for _, d in pairs])
    if not sig:
        return Crossover((), "tie", "tie")
    found = [_crossing(pairs[i:j + 1]) for i, j in itertools.pairwise(sig) if (pairs[i][1] < 0) != (pairs[j][1] < 0)]
    return Crossover(tuple(found), _winner(pairs[sig[0]][1]), _winner(pairs[sig[-1]][1]), start, below,
                     len(sig) < len(pairs))


def _crossing(span: list[tuple[int, float]]) -> float:
    """``span``: (size, difference) from a winner's lead to the other's, ties between: the size where
    the difference last changes sign, interpolated geometrically."""
    first = span[0][1] > 0
    k = max(i for i, (_, d) in enumerate(span[:-1]) if (d > 0) == first and d != 0)
    (s0, d0), (s1, d1) = span[k], span[k + 1]
    return s0 * (s1 / s0) ** (d0 / (d0 - d1))


def crossover_check(model: ScaleModel, obs: Sequence[Observation]) -> list[dict[str, Any]]:
    """Per multi-host layout (hosts, ranks per host, link, knobs): the crossover of its measurements and
    of the model's predictions at the same sizes (same tie rule), the winner at each size, and the
    factor between the onsets (and between the first crossovers, where both have one).

    ``obs`` keeps repeats apart (files of the same layout, e.g. ``run.json``, ``run.r2.json``): at each
    size the measured difference is the **median over repeats** of each repeat's own log(flat /
    hierarchical), so one disturbed repeat neither makes nor hides a winner; a size measured by only
    some repeats takes the median of those.  On hosts of one rank each, hierarchical is the flat ring
    (the engine takes it whole): no crossover exists, and the row gives instead how far apart the two
    measurements of that one path are (``same_path_spread``: median and max |log ratio| over sizes
    and repeats, as a fraction) -- the run-to-run noise."""
    layouts: dict[tuple, list[Observation]] = {}
    for o in obs:
        if o.topo.hosts > 1 and o.algorithm in ("flat", "hierarchical"):
            layouts.setdefault((o.topo, o.knobs), []).append(o)
    out = []
    for mine in layouts.values():
        sources = list(dict.fromkeys(o.run or o.source for o in mine))  # each repeat, by its file
        per_size = _log_ratios(mine, sources)
        if not per_size:
            continue
        name, topo = mine[0].source.split(".")[0], mine[0].topo
        if topo.ranks_per_host == 1:
            spread = [abs(d) for ds in per_size.values() for d in ds]
            out.append({"source": name, "repeats": len(sources), "same_path": True, "sizes": len(per_size),
                        "same_path_spread": {"median": math.expm1(float(np.median(spread))),
                                             "max": math.expm1(max(spread))}})
            continue
        row = _compare(model, topo, mine[0].knobs, {s: float(np.median(d)) for s, d in sorted(per_size.items())})
        if row is not None:
            out.append({"source": name, "repeats": len(sources), **row, **_repeat_spread(mine, sources, row)})
    return out


def _repeat_spread(mine: Sequence[Observation], sources: list[str], row: dict[str, Any]) -> dict[str, Any]:
    """How well the measurement itself names the crossover: each repeat's own first crossover (None where
    it has none) and how many of them are within a factor of 2 of the one the median over repeats names
    (what the model is held to).  A model cannot be expected to agree with the median more closely than
    the repeats agree with it."""
    if len(sources) < 2:
        return {}
    own = []
    for src in sources:
        cross = crossover_of({s: d[0] for s, d in sorted(_log_ratios(mine, [src]).items())})
        own.append(cross.sizes[0] if cross is not None and cross.sizes else None)
    measured = row.get("measured_crossover")
    within = sum(1 for c in own if c is not None and measured is not None and 0.5 <= c / measured <= 2.0)
    return {"repeat_crossovers": own, "repeats_within_2x": within if measured is not None else None}


def _log_ratios(mine: Sequence[Observation], sources: list[str]) -> dict[int, list[float]]:
    """Per size: each repeat's own log(flat time / hierarchical time), both measured in that repeat."""
    per_size: dict[int, list[float]] = {}
    for src in sources:
        flat = {o.size: o for o in mine if (o.run or o.source) == src and o.algorithm == "flat"}
        hier = {o.size: o for o in mine if (o.run or o.source) == src and o.algorithm == "hierarchical"}
        for size in set(flat) & set(hier):
            per_size.setdefault(size, []).append(math.log(flat[size].time_s / hier[size].time_s))
    return per_size


def _compare(model: ScaleModel, topo: Topology, knobs: Knobs, diffs: dict[int, float]) -> dict[str, Any] | None:
    """The measured crossover of ``diffs`` ({size: median log ratio}) against the model's at the same sizes."""
    measured = crossover_of(diffs)
    if measured is None:
        return None
    sizes = list(diffs)
    from .fit import ModelError

    try:
        pdiffs = {s: math.log(model.time_s("flat", topo, s, knobs) / model.time_s("hierarchical", topo, s, knobs))
                  for s in sizes}
    except ModelError:
        return None  # (a path the model was not fitted for: the check's error table says what it left out)
    predicted = crossover_of(pdiffs)
    mw, pw = [_winner(diffs[s]) for s in sizes], [_winner(pdiffs[s]) for s in sizes]
    row: dict[str, Any] = {"layout": topo.describe(), "measured": measured.describe(),
                           "predicted": predicted.describe(),
                           "winners_agree": sum(a == b or "tie" in (a, b) for a, b in zip(mw, pw)),
                           "sizes": len(sizes),
                           "measured_onset": measured.onset, "predicted_onset": predicted.onset,
                           "measured_onset_below_range": measured.onset_below_range,
                           "predicted_onset_below_range": predicted.onset_below_range}
    if measured.sizes:
        row["measured_crossover"] = measured.sizes[0]
    if measured.sizes and predicted.sizes:
        if measured.faster_below == predicted.faster_below:  # (the same way round: else no factor holds)
            row["factor"] = predicted.sizes[0] / measured.sizes[0]
        else:
            row["opposite"] = True
    if measured.onset is not None and predicted.onset is not None \
            and measured.faster_above == predicted.faster_above:
        # An onset at the smallest size is only a bound (at most that size), and so is a factor with one:
        # "<=" when only the predicted one is, ">=" when only the measured one is; both: they agree as far
        # as the sizes measured can tell.
        both = measured.onset_below_range and predicted.onset_below_range
        row["onset_factor"] = 1.0 if both else predicted.onset / measured.onset
        row["onset_factor_bound"] = "" if both or measured.onset_below_range == predicted.onset_below_range \
            else ("<=" if predicted.onset_below_range else ">=")
    return row


def step_check(model: ScaleModel, landscape: dict[str, Any], workload: Any, link: str) -> list[dict[str, Any]]:
    """Per grid point of a ``bench landscape`` file (measured on the workload's scenario): the measured
    step time vs the simulated one, on the landscape's layout (its nodes, ranks and cores; ``link``: the
    link it ran behind).  Measured is the median step of the point's fastest visit: on a shared machine
    other work only slows a visit down, as the allreduce fit keeps the fastest repeat
    (``median_all_s``: the median of every step of every visit, for comparison)."""
    from ..errors import UsageError
    from ..knobs import Knobs
    from .costs import Topology
    from .data import MAX_RANKS
    from .step import simulate_step

    try:
        world, nodes = int(landscape["world_size"]), int(landscape["nodes"])
        cores = int((landscape.get("hardware") or {}).get("cpu_cores") or 0)
        points = [(Knobs(**p["knobs"]), [list(map(float, visit)) for visit in p["steps_s"] if visit])
                  for p in landscape["points"]]
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise UsageError(f"not a bench landscape file with step times ({type(exc).__name__}: {exc})") from None
    if not 1 <= world <= MAX_RANKS:
        raise UsageError(f"landscape: world_size must be 1 .. {MAX_RANKS} ranks, got {world}")
    if not 1 <= nodes <= world:
        raise UsageError(f"landscape: nodes must be 1 .. world_size ({world}), got {nodes}")
    bad = next((t for _, visits in points for v in visits for t in v if not (math.isfinite(t) and t > 0)), None)
    if bad is not None:
        raise UsageError(f"landscape: a step time must be a positive number of seconds, got {bad!r}")
    if world % nodes:
        raise UsageError(f"landscape: {world} ranks do not split evenly over {nodes} nodes")
    topo = Topology(nodes, world // nodes, link if nodes > 1 else "none", max(1.0, world / cores) if cores else 1.0,
                    baselines_on_link=False)
    out = []
    for knobs, visits in points:
        if not visits:
            continue
        measured = min(float(np.median(v)) for v in visits)
        predicted = simulate_step(model, workload, topo, knobs).step_s
        out.append({"knobs": knobs.as_dict(), "measured_s": measured, "predicted_s": predicted,
                    "rel_error": (predicted - measured) / measured, "visits": len(visits),
                    "median_all_s": float(np.median([t for v in visits for t in v]))})
    return out


def merge_landscapes(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One landscape of several runs of the same grid on the same layout: each point's visits from all."""
    from ..errors import UsageError

    if not docs:
        raise UsageError("no landscape to merge")
    first = docs[0]
    merged: dict[str, dict[str, Any]] = {}
    for doc in docs:
        if (doc.get("world_size"), doc.get("nodes")) != (first.get("world_size"), first.get("nodes")):
            raise UsageError("--check-steps: landscapes of different layouts cannot be combined; check them apart")
        points = doc.get("points") or []
        if not isinstance(points, list) or not all(isinstance(p, dict) and isinstance(p.get("knobs") or {}, dict)
                                                   and isinstance(p.get("steps_s") or [], list) for p in points):
            raise UsageError("--check-steps: not a bench landscape file (its points must be objects with knobs "
                             "and a list of visits' step times)")
        for p in points:
            key = repr(sorted((p.get("knobs") or {}).items()))
            merged.setdefault(key, {"knobs": p.get("knobs"), "steps_s": []})["steps_s"] += list(p.get("steps_s") or [])
    return {**first, "points": list(merged.values())}
