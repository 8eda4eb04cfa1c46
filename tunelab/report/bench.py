"""Benchmark sections: allreduce bus bandwidth, fusion modes, kernels, training, knob landscapes, tuner quality.

Several results of one kind are compared side by side: one series (or column) per input, labelled
by its hardware (host name) when that tells them apart, else by file name.
"""

from __future__ import annotations

import math
from typing import Any

from ..units import format_size
from . import figures
from .tables import table_block

Result = tuple[str, dict[str, Any]]  # (label, parsed JSON)


def kind_of(data: dict[str, Any]) -> str:
    """Which bench command wrote ``data``, from its first row ("unknown" when it has no rows to tell)."""
    if "curves" in data:
        return "tuner"
    if "points" in data and "space" in data:
        return "landscape"
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return "unknown"
    for key, kind in (("algorithm", "allreduce"), ("mode", "fusion"), ("kernel", "kernels"), ("system", "train")):
        if key in rows[0]:
            return kind
    return "unknown"


# a table's headings with their units (bandwidths are GB/s, bytes; a link's speed is Gb/s, bits)
_HEADS = {"time_us": "time (us)", "algbw_gbps": "algbw (GB/s)", "busbw_gbps": "busbw (GB/s)",
          "time_vs_link": "time / link bound", "gbps": "GB/s", "copy_gbps": "copy (GB/s)"}


def allreduce_section(results: list[Result]) -> dict[str, Any]:
    series: dict[str, tuple[list[float], list[float]]] = {}
    tables = []
    multi = len(results) > 1
    for label, data in results:
        for alg in dict.fromkeys(r["algorithm"] for r in data["rows"]):
            rows = sorted((r for r in data["rows"] if r["algorithm"] == alg), key=lambda r: r["size"])
            name = f"{alg} ({label})" if multi else alg
            series[name] = ([r["size"] for r in rows], [r["busbw_gbps"] for r in rows])
        cols = ["size", "count", "dtype", "algorithm", "time_us", "algbw_gbps", "busbw_gbps", "wrong"]
        if any("time_vs_link" in r for r in data["rows"]):
            cols.append("time_vs_link")
        table = [{_HEADS.get(c, c): (format_size(r[c]) if c == "size" else "n/a" if c == "wrong" and r.get(c) is None
                                     else r.get(c)) for c in cols} for r in data["rows"]]
        tables.append(table_block(f"nccl-tests style results: {label}", table))
        hw = data.get("hardware")
        if hw:
            tables.append(table_block(f"hardware: {label}", hardware_rows(hw)))
    fig = figures.line_chart(series, "message size (bytes)", "bus bandwidth (GB/s)", logx=True)
    blocks = [_figure("fig-busbw", "bus bandwidth vs message size, every algorithm incl. baselines", fig)]
    return {"id": "bench-allreduce", "title": "Allreduce bandwidth", "blocks": blocks + tables}


def fusion_section(results: list[Result]) -> dict[str, Any]:
    modes = list(dict.fromkeys(r["mode"] for _, d in results for r in d["rows"]))
    series = {label: [_lookup(d["rows"], "mode", m, "time_us") / 1000.0 for m in modes] for label, d in results}
    fig = figures.grouped_bars(modes, series, "time per step (ms)")
    blocks = [_figure("fig-fusion", "allreduce time per fusion mode", fig)]
    for label, d in results:
        blocks.append(table_block(f"fusion modes: {label} (model {d.get('model', '?')})",
                                  [{_HEADS.get(k, k): v for k, v in r.items()} for r in d["rows"]]))
        hw = d.get("hardware")
        if isinstance(hw, dict) and hw:
            blocks.append(table_block(f"hardware: {label}", hardware_rows(hw)))
    return {"id": "bench-fusion", "title": "Tensor fusion", "blocks": blocks}


def kernels_section(results: list[Result]) -> dict[str, Any]:
    groups = list(dict.fromkeys(f"{r['kernel']} {format_size(r['size'])}" for _, d in results for r in d["rows"]))
    series: dict[str, list[float]] = {}
    for label, d in results:
        by_key = {f"{r['kernel']} {format_size(r['size'])}": r for r in d["rows"]}
        series[f"kernel ({label})"] = [by_key[g]["gbps"] if g in by_key else 0.0 for g in groups]
        series[f"copy ({label})"] = [by_key[g]["copy_gbps"] if g in by_key else 0.0 for g in groups]
    fig = figures.grouped_bars(groups, series, "GB/s")
    blocks = [_figure("fig-kernels", "kernel bandwidth next to a plain copy", fig)]
    for label, d in results:
        blocks.append(table_block(f"kernels: {label} ({d.get('backend', '?')}, {d.get('device', '?')})",
                                  [{_HEADS.get(k, k): v for k, v in r.items()} for r in d["rows"]]))
    return {"id": "bench-kernels", "title": "Kernels", "blocks": blocks}


def tuner_section(results: list[Result]) -> dict[str, Any]:
    series: dict[str, tuple[list[float], list[float]]] = {}
    multi = len(results) > 1
    for label, d in results:
        for strategy, curve in d["curves"].items():
            name = f"{strategy} ({label})" if multi else strategy
            series[name] = (list(range(1, len(curve) + 1)), curve)
    fig = figures.line_chart(series, "samples", "best so far / landscape best", step=True)
    blocks = [_figure("fig-tuner", "tuner quality: median best-so-far vs samples, per strategy", fig)]
    for label, d in results:
        keys = list(dict.fromkeys(k for r in d["rows"] if isinstance(r, dict) for k in r))
        rows = [{k: _tuner_cell(r.get(k)) for k in keys} for r in d["rows"] if isinstance(r, dict)]
        blocks.append(table_block(f"tuner quality: {label} (target {d.get('target', '?')})", rows))
        board = _scoreboard_rows(d.get("scoreboard"))
        if board:
            blocks.append(table_block(f"targets met: {label} (landscapes where each strategy meets each target; "
                                      "within 3 % against the first strategy, landscape by landscape)", board))
        seeded = _model_first_rows(d.get("model_first"))
        if seeded:
            blocks.append(table_block(f"starting from the scale model's first proposals: {label} (each strategy "
                                      "seeded against itself, landscape by landscape)", seeded))
        lands = d.get("landscapes")
        if isinstance(lands, dict) and lands:
            blocks.append(table_block(f"landscapes: {label}", [_landscape_row(n, i) for n, i in lands.items()]))
    return {"id": "bench-tuner", "title": "Tuner quality", "blocks": blocks}


def landscape_section(results: list[Result]) -> dict[str, Any]:
    """Each recorded landscape: its points ranked by mean samples/s, every visit beside the mean, the
    default marked; and what was recorded, where."""
    from ..knobs import Knobs
    from ..tuning.run import describe

    blocks: list[dict[str, Any]] = []
    for label, d in results:
        base = d["space"].get("base") if isinstance(d["space"], dict) else None
        ranked = sorted(((sum(pt["scores"]) / len(pt["scores"]), pt) for pt in d["points"]), key=lambda m: -m[0])
        means, ranked = [m for m, _ in ranked], [pt for _, pt in ranked]
        best = means[0]
        try:
            knobs_of_base = Knobs(**base) if isinstance(base, dict) else None
        except (TypeError, ValueError):
            knobs_of_base = None  # a base the report cannot read marks no point
        knobs = [Knobs(**pt["knobs"]) for pt in ranked]
        default = next((i for i, k in enumerate(knobs) if k == knobs_of_base), None)
        hier = "hierarchical" in (d["space"].get("names") or ())
        names = [describe(k, hier=hier) for k in knobs]
        fig = figures.ranked_points(names, [pt["scores"] for pt in ranked], default, "samples/s")
        what = (f"{d.get('model', '?')} ({d.get('framework') or d.get('workload', '?')}) on "
                f"{d.get('world_size', '?')} ranks")
        blocks.append(_figure(f"fig-landscape-{len(blocks)}", f"{label}: {what}, {len(ranked)} points, best first; "
                              "a bar to each point's mean over its visits, a dot for each visit"
                              + ("; the default it was recorded with in orange" if default is not None else ""), fig))
        rows = [{"rank": i + 1, "knobs": names[i] + (" (recorded default)" if i == default else ""),
                 "samples/s": means[i], "min": min(pt["scores"]), "max": max(pt["scores"]),
                 "vs best": means[i] / best, "visits": len(pt["scores"])} for i, pt in enumerate(ranked)]
        blocks.append(table_block(f"landscape: {label}", rows))
        facts = [("scenario", d.get("scenario")), ("device", d.get("device")), ("nodes", d.get("nodes")),
                 ("link (Gb/s)", d.get("link_gbps")), ("visits a point", d.get("repeats")),
                 ("visiting order seed", d.get("seed")), ("seconds", d.get("seconds")),
                 ("measured steps a visit", d.get("measure_steps"))]
        blocks.append(table_block(f"recorded: {label}", [{"fact": k, "value": str(v)} for k, v in facts
                                                         if v is not None]))
        hw = d.get("hardware")
        if isinstance(hw, dict) and hw:
            blocks.append(table_block(f"hardware: {label}", hardware_rows(hw)))
    return {"id": "bench-landscape", "title": "Knob landscapes", "blocks": blocks}


def hardware_rows(facts: dict[str, Any]) -> list[dict[str, str]]:
    """A run's recorded hardware facts as a table's rows, as people read them (sizes in binary units, a
    link in Gb/s, a lab's or a framework's dict as words), never a Python repr."""
    from ..hardware import fact_text

    return [{"fact": k, "value": f"{v:g} Gb/s" if k == "link_gbps" and isinstance(v, (int, float)) else fact_text(k, v)}
            for k, v in facts.items()]


def _scoreboard_rows(board: Any) -> list[dict[str, Any]]:
    """One row per strategy from a tuner result's scoreboard (none when it has none, e.g. an older file)."""
    from ..bench.tuner import TARGET_SAMPLES, TARGET_WITHIN, TARGET_WORSE

    targets = board.get("targets") if isinstance(board, dict) else None
    if not isinstance(targets, dict) or not targets:
        return []
    versus = board.get("within_3pct_versus")
    versus = versus if isinstance(versus, dict) else {}
    first = next(iter(targets))
    rows = []
    for strategy, t in targets.items():
        t = t if isinstance(t, dict) else {}
        v = versus.get(f"{first} vs {strategy}")
        of = t.get("landscapes", "?")
        rows.append({"strategy": strategy,
                     f"samples to lock <= {TARGET_SAMPLES}": f"{t.get('samples_to_lock', '?')} of {of}",
                     f"within 3 % in >= {TARGET_WITHIN:.2f} of seeds": f"{t.get('within_3pct', '?')} of {of}",
                     f"worse than default in <= {TARGET_WORSE:.2f}": f"{t.get('worse_than_default', '?')} of {of}",
                     f"{first}, within 3 %: ahead / level / behind":
                         f"{v.get('ahead', '?')} / {v.get('level', '?')} / {v.get('behind', '?')}"
                         if isinstance(v, dict) else "–"})
    c = board.get("ceiling")
    if isinstance(c, dict) and c.get("landscapes"):  # (for scale: not a strategy, and costs every point)
        rows.append({"strategy": f"for scale: every point once, exact reference ({c.get('exhaustive_blocks', '?')} "
                                 "blocks), the best kept",
                     f"samples to lock <= {TARGET_SAMPLES}": "–",
                     f"within 3 % in >= {TARGET_WITHIN:.2f} of seeds":
                         f"{c.get('exhaustive_within_3pct', '?')} of {c.get('landscapes', '?')}",
                     f"worse than default in <= {TARGET_WORSE:.2f}": "–",
                     f"{first}, within 3 %: ahead / level / behind": "–"})
    return rows


def _model_first_rows(comparison: Any) -> list[dict[str, Any]]:
    """One row per strategy from a tuner result's ``model_first`` (none when it has none)."""
    if not isinstance(comparison, dict):
        return []
    rows = []
    for strategy, m in comparison.items():
        m = m if isinstance(m, dict) else {}
        n = m.get("samples_to_lock") if isinstance(m.get("samples_to_lock"), dict) else {}
        k = m.get("within_3pct") if isinstance(m.get("within_3pct"), dict) else {}
        rows.append({"strategy": f"{strategy}+model vs {strategy}", "landscapes": m.get("landscapes", "?"),
                     "median samples to lock: fewer / same / more":
                         f"{n.get('fewer', '?')} / {n.get('same', '?')} / {n.get('more', '?')}",
                     "within 3 %: ahead / level / behind": f"{k.get('ahead', '?')} / {k.get('level', '?')} / "
                                                           f"{k.get('behind', '?')}"})
    return rows


def _tuner_cell(value: Any) -> Any:
    """A tuner row's value as a cell: an interval (two numbers) as "[low, high]", knob settings (the model's
    first proposals) as words, nothing as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        from ..bench.landscape import describe
        from ..knobs import Knobs

        try:
            return "; ".join(describe(Knobs(**v)) for v in value)
        except (TypeError, ValueError):
            return "; ".join(", ".join(f"{k} {x}" for k, x in v.items()) for v in value)
    if isinstance(value, list) and len(value) == 2 and all(_number(v) for v in value):
        return f"[{value[0]:.2f}, {value[1]:.2f}]"
    return value


def _landscape_row(name: str, info: Any) -> dict[str, Any]:
    """What a tuner result says of one landscape, in words: its size, the default against the best, the
    yardstick (every point measured once), how well the recording knows its own best (visits resampled),
    the recording's own drift that the replay took out and the host's state between visits it replays."""
    info = info if isinstance(info, dict) else {}
    best, default = info.get("best"), info.get("default")
    drift = info.get("recording_drift_removed")
    drift = drift if isinstance(drift, dict) else {}
    yardstick = info.get("exhaustive_within_3pct")
    steps = info.get("block_steps")
    ceiling = info.get("truth_ceiling_within_3pct")
    visits = info.get("visit_noise")
    visits = visits if isinstance(visits, dict) else {}
    return {"landscape": name, "points": info.get("points", "n/a"),
            "default / best": f"{default / best:.3f}" if _number(best) and best > 0 and _number(default) else "n/a",
            "every point measured once: within 3 %":
                (f"{yardstick:.2f}" + (f" ({steps}-step blocks)" if isinstance(steps, int) else ""))
                if _number(yardstick) else "n/a",
            "best point, visits resampled: within 3 %": f"{ceiling:.2f}" if _number(ceiling) else "n/a",
            "recording's drift taken out": (f"sd {100 * drift['sigma']:.2f} %, lag-1 {drift['lag1']:.2f}"
                                            if _number(drift.get("sigma")) and _number(drift.get("lag1"))
                                            else "none"),
            "host state between visits": (f"sd {100 * visits['sigma']:.1f} % for {visits['seconds']:.1f} s"
                                          + ("" if visits.get("replayed", True) else ", not replayed")
                                          + (", pooled over every point" if visits.get("mode") == "pooled" else "")
                                          if _number(visits.get("sigma")) and _number(visits.get("seconds"))
                                          else "none")}


def _number(x: object) -> bool:
    """A finite number (not a bool): what a figure or a formatted cell can take."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def train_section(results: list[Result]) -> dict[str, Any]:
    systems = list(dict.fromkeys(r["system"] for _, d in results for r in d["rows"]))
    series = {label: [_lookup(d["rows"], "system", s, "samples_per_s") for s in systems] for label, d in results}
    fig = figures.grouped_bars(systems, series, "samples/s")
    blocks = [_figure("fig-train", "training throughput per system, measured in the same run", fig)]
    names = {"system": "system", "samples_per_s": "samples/s (median round)", "samples_per_s_min": "min",
             "samples_per_s_max": "max", "step_ms": "step ms", "rounds": "rounds", "weights_identical": "same weights"}
    for label, d in results:
        title = f"training: {label} (model {d.get('model', '?')}, {d.get('framework', '?')}, {d.get('world_size', '?')} ranks)"
        blocks.append(table_block(title, [{names.get(k, k): v for k, v in r.items()} for r in d["rows"]]))
        for note in d.get("notes", []):
            blocks.append({"kind": "text", "text": f"Note: {note}."})
        hw = d.get("hardware")
        if isinstance(hw, dict) and hw:  # (recorded with every run, as bench allreduce's is)
            blocks.append(table_block(f"hardware: {label}", hardware_rows(hw)))
    return {"id": "bench-train", "title": "Training throughput", "blocks": blocks}


SECTIONS = {"train": train_section, "allreduce": allreduce_section, "fusion": fusion_section, "kernels": kernels_section,
            "tuner": tuner_section, "landscape": landscape_section}


# What each section reads of every row: its name field, and the numbers it plots.
ROW_FIELDS = {"allreduce": ("algorithm", ("size", "busbw_gbps")), "fusion": ("mode", ("time_us",)),
              "kernels": ("kernel", ("size", "gbps", "copy_gbps")), "train": ("system", ("samples_per_s",))}


def bench_sections(results: list[Result]) -> list[dict[str, Any]]:
    from ..errors import UsageError

    by_kind: dict[str, list[Result]] = {}
    for label, data in results:
        kind = kind_of(data)
        if kind not in SECTIONS:  # the file the command line named is not what it says: exit 2
            raise UsageError(f"{label}: not a tunelab bench --json result")
        damage = _damage(kind, data)
        if damage:
            raise UsageError(f"{label}: a damaged tunelab bench {kind} result ({damage})")
        by_kind.setdefault(kind, []).append((label, data))
    return [SECTIONS[k](v) for k, v in by_kind.items()]


def _damage(kind: str, data: dict[str, Any]) -> str:
    """What is wrong with a bench result's rows (or its tuner curves), or "" when the report can read it."""
    if kind == "tuner":
        curves = data.get("curves")
        if not isinstance(curves, dict) or not isinstance(data.get("rows"), list) or not all(
                isinstance(c, list) and all(_number(x) for x in c) for c in curves.values()):
            return "its curves must be lists of numbers per strategy, beside a list of rows"
        return ""
    if kind == "landscape":
        return _landscape_damage(data)
    name, numbers = ROW_FIELDS[kind]
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or not isinstance(row.get(name), str):
            return f"row {i + 1} has no {name}"
        bad = [f for f in numbers if not _number(row.get(f))]
        if bad:
            must = "must be a number" if len(bad) == 1 else "must be numbers"
            return f"row {i + 1} ({row[name]}): {', '.join(bad)} {must}, got {', '.join(repr(row.get(f)) for f in bad)}"
        if "size" in numbers and not row["size"] > 0:  # (plotted on a log axis)
            return f"row {i + 1} ({row[name]}): size must be > 0 bytes, got {row['size']!r}"
    return ""


def _landscape_damage(data: dict[str, Any]) -> str:
    from ..knobs import Knobs

    points = data["points"]
    if not isinstance(points, list) or not points or not isinstance(data["space"], dict):
        return "it must hold a space and a list of points"
    for i, pt in enumerate(points):
        scores = pt.get("scores") if isinstance(pt, dict) else None
        if not isinstance(scores, list) or not scores or not all(_number(x) and x > 0 for x in scores):
            return f"point {i + 1}: its scores must be a list of positive numbers"
        try:
            Knobs(**pt["knobs"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"point {i + 1}: its knobs are not knobs ({exc})"
    return ""


def _lookup(rows: list[dict[str, Any]], key: str, value: object, field: str) -> float:
    return next((float(r[field]) for r in rows if r[key] == value), 0.0)


def _figure(fig_id: str, caption: str, uri: str) -> dict[str, Any]:
    return {"kind": "figure", "id": fig_id, "caption": caption, "uri": uri}
