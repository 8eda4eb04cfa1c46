"""Tuning-run sections: hardware, default vs tuned, convergence, GP landscape, trials, locked config."""

from __future__ import annotations

from typing import Any

from ..knobs import knob_text
from ..units import format_size
from . import figures
from .tables import table_block

GRID = 40


def tuning_section(run: dict[str, Any], n: int) -> dict[str, Any]:
    sid = f"tune-{n}"
    blocks: list[dict[str, Any]] = [{"kind": "text", "text": outcome_text(run)}]
    # the facts say where it ran; the profile's short hardware name only where they were not recorded
    where = "" if run["hardware_facts"] else f" on {run['hardware_name']}"
    blocks.append({"kind": "text", "text": f"Model {run['model']}{where} ({run['label']}). "
                                           + hardware_text(run["hardware_facts"])})
    first = first_proposals_text(run)
    if first:
        blocks.append({"kind": "text", "text": first})
    drift = drift_text(run)
    if drift:
        blocks.append({"kind": "text", "text": drift})
    blocks.append(_throughput(run))
    scores = [float(s["score"]) for s in run["samples"]]
    phases = [_phase_label(s) for s in run["samples"]]
    blocks.append(_figure(f"{sid}-convergence", "every measured block: the default's reference blocks (grey) "
                          "show the host's drift; candidates are scored against them",
                          figures.convergence(scores, phases, float(run["default"]["score"]))))
    blocks.append(landscape_block(run, sid))
    blocks.append(table_block("trials", [_trial_row(s) for s in run["samples"]]))
    blocks.extend(_locked(run))
    return {"id": sid, "title": f"Tuning: {run['model']} ({run['label']})", "blocks": blocks}


def outcome_text(run: dict[str, Any]) -> str:
    """The result in words: what was locked, its gain with the interval, what tuning cost, how it ended."""
    out = run.get("outcome") or {}
    iv = out.get("gain_interval")
    cost = ""
    if out.get("samples_to_lock") is not None:
        reason = out.get("stop_reason") or ""
        ending = ("converged" if out.get("converged") else "ran out of its budget" if "budget" in reason
                  else "ended")
        steps = f"{out['steps_to_lock']} training steps, " if out.get("steps_to_lock") is not None else ""
        # else the ending said it ("converged (a promising ...)" says it too, then what it was)
        said = reason and reason not in ("converged", "budget exhausted")
        if said and out.get("converged") and reason.startswith("converged ("):
            reason = reason[len("converged ("):].removesuffix(")")
        # a tune result's seconds are its training's until the lock (warm-up and discarded steps
        # included); a profile's store keeps only its measured blocks' seconds
        what = "measured steps" if out.get("seconds_measured") else "training"
        blocks = out["samples_to_lock"]
        cost = (f" Tuning measured {blocks} block{'s' if blocks != 1 else ''} ({steps}{out['seconds_to_lock']:.0f} s of "
                f"{what}) before locking; the search"
                + (" (one a retune re-opened after an earlier lock)" if out.get("retuned") else "")
                + f" {ending}" + (f" ({reason})." if said else "."))
    if out.get("adopted") and iv:
        n = iv.get("n")
        if n is None:
            source = " (as the profile store recorded it)"
        elif out.get("locked_from") == "exploration":
            source = (f" from its {n} exploration block{'s' if n != 1 else ''} paired with the default, at a "
                      "confidence that holds for every configuration explored at once (no re-measurement "
                      "was needed)")
        else:
            source = f" from {n} re-measurement{'s' if n != 1 else ''} paired with the default"
        if iv.get("gain") is None:  # stored before the store kept the estimate
            return (f"Locked a tuned configuration: 90 % interval [{iv['low']:.2f}, {iv['high']:.2f}]x the "
                    f"default's throughput{source}." + cost)
        return (f"Locked a tuned configuration: {iv['gain']:.2f}x the default's throughput, 90 % interval "
                f"[{iv['low']:.2f}, {iv['high']:.2f}]{source}." + cost)
    up = out.get("runner_up_interval")
    if up:
        return (f"Kept the default configuration: the best finalist measured {up['gain']:.2f}x, 90 % interval "
                f"[{up['low']:.2f}, {up['high']:.2f}], and {out.get('decision', '')}." + cost)
    if out:
        return f"Kept the default configuration ({out.get('decision', 'no decision recorded')})." + cost
    gain = run["best"]["score"] / run["default"]["score"] if run["default"]["score"] else float("nan")
    return f"Tuned configuration at {gain:.2f}x the default (a run recorded without an interval)."


def hardware_text(facts: dict[str, Any]) -> str:
    if not facts:
        return "Hardware facts were not recorded for this run."
    usable = f"{facts['cpu_usable']} of " if facts.get("cpu_usable") else ""  # a job held to some cores
    parts = [f"CPU {facts.get('cpu_model', '?')} ({usable}{facts.get('cpu_cores', '?')} cores"
             + (f", {facts['cpu_sockets']} sockets" if int(facts.get("cpu_sockets", 1) or 1) > 1 else "") + ")"]
    if facts.get("memory_gib") is not None:
        parts.append(f"{facts['memory_gib']} GiB memory")
    gpus = int(facts.get("gpu_count", 0) or 0)
    parts.append(f"{gpus}x {facts.get('gpu_model', 'GPU')} ({facts.get('gpu_memory_gib', '?')} GiB)" if gpus
                 else "no GPU")
    layout = facts.get("ranks_per_node") or []
    nodes = facts.get("nodes", len(layout) or 1)
    parts.append(f"{nodes} node{'s' if nodes != 1 else ''}" + (f" of {', '.join(map(str, layout))} ranks" if layout else ""))
    if facts.get("emulated_link"):
        parts.append(f"emulated link {facts['emulated_link']}")
    if facts.get("lab_link"):
        parts.append(f"lab link {facts['lab_link']}")
    if facts.get("mpi_library"):
        parts.append(f"MPI: {str(facts['mpi_library']).strip()}")
    frameworks = facts.get("frameworks") or {}
    if isinstance(frameworks, dict) and frameworks:
        parts.append("frameworks installed: " + ", ".join(f"{k} {v}" for k, v in frameworks.items()))
    return "Hardware: " + "; ".join(parts) + "."


def first_proposals_text(run: dict[str, Any]) -> str:
    """Where the search started, when the scale model gave it its first candidates (else "")."""
    first = run.get("first_proposals")
    if not first:
        return ""
    settings = "; ".join(", ".join(f"{name.removesuffix('_bytes').removesuffix('_ms').replace('_', ' ')} "
                                   f"{knob_text(name, value)}" + (" ms" if name.endswith("_ms") else "")
                                   for name, value in k.items() if name in run["searched"])
                         for k in first["knobs"])
    return (f"The search started from the scale model's predicted best settings ({first['model_file']}; this "
            f"hardware had no stored trials): {settings}.")


def drift_text(run: dict[str, Any]) -> str:
    drift = (run.get("outcome") or {}).get("drift") or {}
    refs = drift.get("reference_scores") or []
    if len(refs) < 2:
        return ""
    return (f"Drift seen: the default configuration, measured {len(refs)} times between candidates, ranged from "
            f"{min(refs):.2f} to {max(refs):.2f} samples/s ({100 * drift['range_frac']:.1f} % of its mean)"
            + ("; one block's noise, drift between neighbouring blocks included, was about "
               f"{100 * drift['block_sigma_frac']:.1f} %" if drift.get("block_sigma_frac") is not None else "")
            + ". Candidates are scored as ratios to the "
            "default's blocks around them, so a drift this size does not pass for a knob's effect."
            + _disturbed(drift.get("disturbed_blocks") or 0))


def _disturbed(n: int) -> str:
    if not n:
        return ""
    what = "reference block far outside the others (the host busy with something else) was" if n == 1 else \
        "reference blocks far outside the others (the host busy with something else) were"
    return f" {n} {what} set aside."


def _phase_label(s: dict[str, Any]) -> str:
    return "default" if s.get("role") == "reference" or s["phase"] == "default" else str(s["phase"])


def _throughput(run: dict[str, Any]) -> dict[str, Any]:
    d, b = run["default"], run["best"]
    rows = [{"config": "default", "samples/s": d["score"], "spread": _pct(d["spread"])},
            {"config": "locked", "samples/s": b["score"], "spread": _pct(b["spread"])}]
    if run.get("runner_up"):
        up = run["runner_up"]
        rows.append({"config": "best finalist (not adopted: its interval did not clear the minimum gain)",
                     "samples/s": up["score"], "spread": _pct(up["spread"])})
    if run.get("locked_final") is not None:
        rows.append({"config": "locked (final run)", "samples/s": run["locked_final"], "spread": ""})
        recent = run.get("default_recent")
        if recent:  # the final run's nearest comparison: a drifting host moves both alike
            n = recent["blocks"]
            rows.append({"config": f"default (its last {n} reference block{'s' if n > 1 else ''}, just before "
                                   "the final run)", "samples/s": recent["score"], "spread": ""})
    return table_block("default vs locked throughput (spread: p90 - p10 of step rates, as % of the median)", rows)


def _pct(frac: Any) -> str:
    return f"{100 * float(frac):.1f}%"


def _trial_row(s: dict[str, Any]) -> dict[str, Any]:
    k = s["knobs"]
    return {"#": s["index"] + 1, "phase": s["phase"],  # numbered from 1, as tune's progress and profiles show
            "fusion": knob_text("fusion_threshold_bytes", k["fusion_threshold_bytes"], exact=False),
            "cycle ms": k["cycle_time_ms"], "segment": knob_text("segment_bytes", k["segment_bytes"], exact=False),
            "hierarchical": knob_text("hierarchical", k["hierarchical"]), "role": s.get("role", ""), "samples/s": s["score"],
            "vs default": f"{s['ratio']:.3f}x" if s.get("ratio") else "", "spread": _pct(s.get("spread", 0.0))}


def _locked(run: dict[str, Any]) -> list[dict[str, Any]]:
    k = run["best"]["knobs"]
    rows = [{"knob": name, "value": knob_text(name, v)} for name, v in k.items()]
    if run.get("store_error"):  # (the store stopped taking the run's writes: no profile to export)
        return [table_block("locked configuration", rows),
                {"kind": "text", "text": f"This run was not stored: the profile store failed ({run['store_error']}). "
                                         "Training jobs do not load it: pin these knobs with --knob, or tune "
                                         "again once the store takes writes."}]
    if run.get("profile_id") is None:  # (tune --no-store: nothing was stored, and no profile to export)
        return [table_block("locked configuration", rows),
                {"kind": "text", "text": "This run was not stored (--no-store): training jobs do not load it. "
                                         "Pin these knobs with --knob, or tune again without --no-store."}]
    return [table_block("locked configuration", rows),
            {"kind": "text", "text": "Training jobs on this hardware load it automatically; "
                                     "export with tunelab profiles export:"},
            {"kind": "code", "text": f"tunelab profiles export {run['profile_id']} --out profile.json"}]


def landscape_block(run: dict[str, Any], sid: str) -> dict[str, Any]:
    """The GP posterior mean over fusion threshold x cycle time, refitted from the run's samples."""
    import numpy as np

    from ..tuning.space import SCALES

    names = tuple(run["searched"])
    if "fusion_threshold_bytes" not in names or "cycle_time_ms" not in names:
        return {"kind": "note", "text": "knob landscape: fusion threshold or cycle time was pinned"}
    tuner = _refit(run, names)
    if len(tuner.observations) < 3:
        return {"kind": "note", "text": "knob landscape: too few samples to fit the model"}
    fi, ci = names.index("fusion_threshold_bytes"), names.index("cycle_time_ms")
    fs, cs = SCALES["fusion_threshold_bytes"], SCALES["cycle_time_ms"]
    units = np.linspace(0.0, 1.0, GRID)
    anchor = tuner.space.unit_point(_knobs(run["best"]["knobs"]))
    grid = []
    for uc in units:
        for uf in units:
            p = list(anchor)
            p[fi], p[ci] = float(uf), float(uc)
            grid.append(p)
    mean, _ = tuner.fit().predict(np.asarray(grid))
    z = np.exp(mean.reshape(GRID, GRID)) * float(run["default"]["score"])
    fx = fs.low + units * (fs.high - fs.low)
    cy = np.exp(np.log(cs.low) + units * (np.log(cs.high) - np.log(cs.low)))
    points = [(fs.to_coordinate(o.knobs.fusion_threshold_bytes), o.knobs.cycle_time_ms) for o in tuner.observations]
    ticks = [(fs.low, "off")] + [(float(e), format_size(1 << e)) for e in range(int(fs.low) + 4, int(fs.high) + 1, 3)]
    uri = figures.heatmap(fx, cy, z, points, "fusion threshold", "cycle time (ms)", "samples/s (GP mean)", ticks)
    span = 100 * float(z.max() - z.min()) / float(run["default"]["score"])
    return _figure(f"{sid}-landscape", "knob landscape: GP posterior mean, fusion threshold x cycle time "
                   "(other knobs at the locked values); dots are samples, the square is the default; the "
                   f"colours span {span:.1f} % of the default's throughput", uri)


def _refit(run: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The GP as told in the run: each candidate's ratio to the default (from the run's own blocks when
    it recorded no ratios), the default's blocks at 1."""
    import math

    from ..tuning.space import SearchSpace
    from ..tuning.tuner import Tuner

    space = SearchSpace(names, _knobs(run["default"]["knobs"]))
    tuner = Tuner(space, seed=0)
    default_score = float(run["default"]["score"])
    for s in run["samples"]:
        if s["phase"] not in ("default", "explore") or not s["score"] or not default_score:
            continue
        ratio = s.get("ratio") or (1.0 if _phase_label(s) == "default" else s["score"] / default_score)
        tuner.tell(_knobs(s["knobs"]), math.log(ratio), 0.03 ** 2)
    return tuner


def _knobs(d: dict[str, Any]) -> Any:
    from ..knobs import Knobs

    return Knobs(**d)


def _figure(fig_id: str, caption: str, uri: str) -> dict[str, Any]:
    return {"kind": "figure", "id": fig_id, "caption": caption, "uri": uri}
