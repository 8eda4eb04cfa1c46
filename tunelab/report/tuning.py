"""Tuning-run sections: hardware, default vs tuned, convergence, GP landscape, trials, locked config."""

from __future__ import annotations

from typing import Any

from ..units import format_size
from . import figures
from .tables import table_block

GRID = 40


def tuning_section(run: dict[str, Any], n: int) -> dict[str, Any]:
    sid = f"tune-{n}"
    blocks: list[dict[str, Any]] = [{"kind": "text", "text": f"Model {run['model']} on {run['hardware_name']} "
                                     f"({run['label']})."}]
    facts = run["hardware_facts"]
    if facts:
        blocks.append(table_block("hardware facts", [{"fact": k, "value": str(v)} for k, v in facts.items()]))
    else:
        blocks.append({"kind": "note", "text": "hardware facts not recorded for this run"})
    blocks.append(_throughput(run))
    scores = [float(s["score"]) for s in run["samples"]]
    phases = [str(s["phase"]) for s in run["samples"]]
    blocks.append(_figure(f"{sid}-convergence", "convergence: score per sample and best so far",
                          figures.convergence(scores, phases, float(run["default"]["score"]))))
    blocks.append(landscape_block(run, sid))
    blocks.append(table_block("trials", [_trial_row(s) for s in run["samples"]]))
    blocks.extend(_locked(run))
    return {"id": sid, "title": f"Tuning: {run['model']} ({run['label']})", "blocks": blocks}


def _throughput(run: dict[str, Any]) -> dict[str, Any]:
    d, b = run["default"], run["best"]
    rows = [{"config": "default", "samples/s": d["score"], "spread": f"±{d['spread'] * 100:.1f}%"},
            {"config": "tuned", "samples/s": b["score"], "spread": f"±{b['spread'] * 100:.1f}%"}]
    if run.get("runner_up"):
        up = run["runner_up"]
        rows.append({"config": "best finalist (not adopted: did not beat the default in every re-measurement)",
                     "samples/s": up["score"], "spread": f"±{up['spread'] * 100:.1f}%"})
    if run.get("locked_final") is not None:
        rows.append({"config": "locked (final run)", "samples/s": run["locked_final"], "spread": ""})
    gain = b["score"] / d["score"] if d["score"] else float("nan")
    return table_block(f"default vs tuned throughput (gain {gain:.3f}x)", rows)


def _trial_row(s: dict[str, Any]) -> dict[str, Any]:
    k = s["knobs"]
    return {"#": s["index"], "phase": s["phase"], "fusion": format_size(int(k["fusion_threshold_bytes"])),
            "cycle ms": k["cycle_time_ms"], "segment": format_size(int(k["segment_bytes"])),
            "hierarchical": k["hierarchical"], "samples/s": s["score"], "spread": s.get("spread", 0.0)}


def _locked(run: dict[str, Any]) -> list[dict[str, Any]]:
    k = run["best"]["knobs"]
    rows = [{"knob": name, "value": format_size(int(v)) if name.endswith("_bytes") else str(v)}
            for name, v in k.items()]
    export = "tunelab profiles export" + (f" {run['profile_id']}" if run.get("profile_id") is not None else "")
    return [table_block("locked configuration", rows),
            {"kind": "text", "text": "Training jobs on this hardware load it automatically; "
                                     "export with tunelab profiles export:"},
            {"kind": "code", "text": f"{export} --out profile.json"}]


def landscape_block(run: dict[str, Any], sid: str) -> dict[str, Any]:
    """The GP posterior mean over fusion threshold x cycle time, refitted from the run's samples."""
    names = tuple(run["searched"])
    if "fusion_threshold_bytes" not in names or "cycle_time_ms" not in names:
        return {"kind": "note", "text": "knob landscape: fusion threshold or cycle time was pinned"}
    tuner, points = _refit(run, names)
    model = tuner._opt.models[-1] if tuner._opt.models else None
    if model is None:
        return {"kind": "note", "text": "knob landscape: too few samples to fit the model"}
    import numpy as np

    fi, ci = names.index("fusion_threshold_bytes"), names.index("cycle_time_ms")
    fx = np.linspace(13.0, 28.0, GRID)
    cy = np.geomspace(0.1, 100.0, GRID)
    anchor = tuner.space.to_point(_knobs(run["best"]["knobs"]))
    grid = []
    for c in cy:
        for f in fx:
            p = list(anchor)
            p[fi], p[ci] = float(f), float(c)
            grid.append(p)
    mean = model.predict(tuner._opt.space.transform(grid)).reshape(GRID, GRID)
    z = -mean * float(tuner.reference)
    uri = figures.heatmap(fx, cy, z, [(p[fi], p[ci]) for p in points],
                          "fusion threshold (log2 bytes; 13 = no fusion)", "cycle time (ms)", "samples/s (GP mean)")
    return _figure(f"{sid}-landscape", "knob landscape: GP posterior mean, fusion threshold x cycle time "
                   "(other knobs at the tuned values); dots are samples, the square is the default", uri)


def _refit(run: dict[str, Any], names: tuple[str, ...]) -> tuple[Any, list[list[Any]]]:
    from ..tuning.space import SearchSpace
    from ..tuning.tuner import Tuner

    # what the tuner itself was told: the default first, then the explored points in order
    told = [s for s in run["samples"] if s["phase"] in ("default", "explore")] or run["samples"]
    samples = sorted(told, key=lambda s: (s["phase"] != "default", s["index"]))
    space = SearchSpace(names, _knobs(run["default"]["knobs"]))
    tuner = Tuner(space, seed=0, initial_points=max(1, min(8, len(samples))))
    points = []
    for s in samples:
        knobs = _knobs(s["knobs"])
        tuner.tell(knobs, float(s["score"]), float(s.get("spread", 0.0)))
        points.append(space.to_point(knobs))
    return tuner, points


def _knobs(d: dict[str, Any]) -> Any:
    from ..knobs import Knobs

    return Knobs(**d)


def _figure(fig_id: str, caption: str, uri: str) -> dict[str, Any]:
    return {"kind": "figure", "id": fig_id, "caption": caption, "uri": uri}
