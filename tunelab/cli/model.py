"""``tunelab model fit`` and ``tunelab model predict``: the scale model (:mod:`tunelab.model`).

``fit`` reads ``tunelab bench allreduce --json`` files and writes the fitted α-β-γ model;
``predict`` prints, for a topology up to 1024 ranks and beyond, the predicted allreduce time per size
and algorithm, the flat vs hierarchical crossover, and a scenario's step time per knob setting (the
best first).  ``--check FILES`` compares the prediction with measured bench files (held out from the
fit).  A missing or foreign file, or too few points to fit, is a usage error: one line, exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..knobs import knob_text
from ..model.data import MAX_RANKS  # (past a million ranks: minutes of work, and meaningless)
from ..units import format_size, human_size
from .finish import add_output_flags, finish

_LANDSCAPE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # a landscape's gradients: bytes an element
from .types import (
    Parser,
    input_file,
    knob,
    link_gbps,
    named_input,
    output_file,
    positive_float,
    positive_int,
    scenario_input,
    size_list,
)

DEFAULT_SIZES = "4KiB,64KiB,1MiB,16MiB,64MiB,256MiB,1GiB"
STEP_ROWS = 12
LARGE = 1 << 20  # error summaries apart below (latency-bound) and from (bandwidth-bound) this size


def _oversubscription(text: str) -> float:
    value = positive_float(text)
    if value > 1024:
        raise argparse.ArgumentTypeError(f"expected at most 1024 ranks a core, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="the scale model: fit on bench runs, predict up to 1024 ranks")
    msub = model.add_subparsers(dest="model_command", required=True, parser_class=Parser)
    fit = msub.add_parser("fit", help="fit the alpha-beta-gamma model on bench allreduce --json files")
    fit.add_argument("files", type=input_file, nargs="+", metavar="FILE.json")
    fit.add_argument("--out", type=output_file, required=True, metavar="MODEL.json", help="where to write the model")
    fit.add_argument("--link-gbps", type=link_gbps, default=None, metavar="GBPS",
                     help="link speed of files that do not record theirs")
    fit.add_argument("--sizes", type=size_list, default=None, metavar="LIST",
                     help="fit only the measurements at these sizes (hold the others out for predict --check)")
    add_output_flags(fit, report=False, what="the fit's summary")
    fit.set_defaults(func=run_fit)

    pr = msub.add_parser("predict", help="predicted allreduce times, crossover and step time per knob setting")
    pr.add_argument("--model-file", type=input_file, required=True, metavar="MODEL.json",
                    help="a model written by tunelab model fit")
    named_input(pr.add_argument("--scenario", default=None, metavar="NAME|FILE",
                                help="a scenario (its model's gradients and backward timing) for the step-time table"),
                scenario_input)
    pr.add_argument("--hosts", type=positive_int, required=True, help="hosts to predict for (any number)")
    pr.add_argument("--ranks-per-host", type=positive_int, required=True, help="ranks on each host")
    pr.add_argument("--link-gbps", type=link_gbps, default=None, metavar="GBPS",
                    help="the link between hosts (default: the model's only fitted link; an unfitted speed "
                         "is derived from the nearest fitted one)")
    pr.add_argument("--oversubscription", type=_oversubscription, default=1.0, metavar="X",
                    help="ranks per machine over its cores, up to 1024 (default 1: a core per rank)")
    pr.add_argument("--sizes", type=size_list, default=size_list(DEFAULT_SIZES),
                    help=f"comma-separated allreduce sizes (default {DEFAULT_SIZES})")
    pr.add_argument("--knob", type=knob, action="append", default=[], metavar="NAME=VALUE",
                    help="pin a knob for every prediction (repeatable)")
    pr.add_argument("--check", type=input_file, nargs="+", default=[], metavar="FILE.json",
                    help="bench allreduce files to compare with the model (held-out runs)")
    pr.add_argument("--check-sizes", type=size_list, default=None, metavar="LIST",
                    help="compare only the --check measurements at these sizes (those held out of the fit)")
    pr.add_argument("--check-steps", type=input_file, nargs="+", default=[], metavar="LANDSCAPE.json",
                    help="bench landscape files of --scenario (behind --link-gbps): measured vs predicted step time")
    add_output_flags(pr, what="the predictions")
    pr.set_defaults(func=run_predict)


# ---- fit ----------------------------------------------------------------------------------------------
def run_fit(args: argparse.Namespace) -> int:
    from ..model.data import load_many
    from ..model.fit import fit_model

    obs = _at_sizes(load_many(args.files, args.link_gbps), args.sizes, "fit")
    model = fit_model(obs)
    model.save(args.out)
    print(f"# scale model fitted on {model.points} allreduces from {len(args.files)} files "
          f"(links: {', '.join(model.links) or 'none'}; baselines: {', '.join(model.baselines) or 'none'})")
    _print_parameters(model.values)
    _print_errors(model.fit_points, "fit")
    print(f"# wrote {args.out}")
    return finish(args, {**model.to_dict(), "command": "model fit"}, "model-fit")


def _print_parameters(values: dict[str, float]) -> None:
    from ..bench.common import format_table
    from ..model.costs import OVER, WAKE, parameter_kind

    unit = {"alpha": ("us", 1e6), "beta": ("ns/B", 1e9), "gamma": ("ns/B", 1e9)}
    rows = []
    for name, v in sorted(values.items()):
        if OVER in name:
            u, scale = "per unit of oversubscription", 1.0
        elif WAKE in name:
            u, scale = "us per unit of oversubscription", 1e6
        else:
            u, scale = unit[parameter_kind(name)]
        rows.append({"parameter": name, "value": v * scale, "unit": u})
    print(format_table(rows, [("parameter", "parameter", ""), ("value", "value", ".4g"), ("unit", "unit", "")]))


def _print_errors(errors: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """The per-point table and a one-line summary; returns the summary."""
    from ..bench.common import format_table
    from ..model.validate import summarize

    rows = [{**e, "size_h": format_size(e["size"]), "layout": f"{e['hosts']}x{e['ranks_per_host']}",
             "measured_ms": e["measured_s"] * 1e3, "predicted_ms": e["predicted_s"] * 1e3,
             "error_pct": 100 * e["rel_error"]} for e in errors]
    print(format_table(rows, [("source", "file", ""), ("algorithm", "algorithm", ""), ("layout", "hosts x K", ""),
                              ("size_h", "size", ""), ("measured_ms", "measured_ms", ".3f"),
                              ("predicted_ms", "predicted_ms", ".3f"), ("error_pct", "error_%", "+.1f")]))
    s = summarize(errors)
    print(f"# {what}: {s['points']} points, |error| median {100 * s['median']:.1f}%, p90 {100 * s['p90']:.1f}%, "
          f"max {100 * s['max']:.1f}%, within 15%: {s['within_15pct']}/{s['points']}")
    for name, part in (("below 1 MiB", [e for e in errors if e["size"] < LARGE]),
                       ("1 MiB and more", [e for e in errors if e["size"] >= LARGE])):
        if part and len(part) < len(errors):
            p = summarize(part)
            s[name] = p
            print(f"#   {name}: {p['points']} points, |error| median {100 * p['median']:.1f}%, "
                  f"max {100 * p['max']:.1f}%, within 15%: {p['within_15pct']}/{p['points']}")
    return s


# ---- predict ------------------------------------------------------------------------------------------
def run_predict(args: argparse.Namespace) -> int:
    from ..knobs import Knobs
    from ..model.fit import ScaleModel

    if args.hosts * args.ranks_per_host == 1:
        raise UsageError("one rank has nothing to reduce: give --hosts or --ranks-per-host above 1")
    if args.hosts * args.ranks_per_host > MAX_RANKS:
        raise UsageError(f"the model predicts up to {MAX_RANKS} ranks, got {args.hosts} x {args.ranks_per_host}")
    if args.check_sizes is not None and not args.check:
        raise UsageError("--check-sizes selects sizes of the --check files: give --check too")
    if args.check_steps and not args.scenario:
        raise UsageError("--check-steps needs --scenario (the workload the landscape measured)")
    model = ScaleModel.load(args.model_file)
    try:
        knobs = Knobs(**dict(args.knob))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # a bad scenario or check file is refused before any table is printed: both are read here, once
    from ..model.data import load_many
    from ..model.step import Workload

    work = Workload.from_scenario(args.scenario) if args.scenario else None
    checked = load_many(args.check, combine="all") if args.check else []
    _at_sizes(checked, args.check_sizes, "--check")  # (sizes the files lack: refused before any table)
    model, topo = _topology(model, args)
    _refuse_unpredictable(model, topo)
    step_rows = _step_rows(model, args.check_steps, args.scenario, work, topo.link) if args.check_steps else []
    print(f"# scale model {args.model_file} ({model.points} points); predicting {topo.describe()}")
    result: dict[str, Any] = {"command": "model predict", "model_file": str(args.model_file),
                              "topology": vars(topo), "knobs": knobs.as_dict()}
    result["allreduce"] = _allreduce(model, topo, args.sizes, knobs)
    result["crossover"] = _crossover(model, topo, knobs)
    if work is not None:
        result["step"] = _steps(model, topo, work, knobs, [name for name, _ in args.knob])
    if args.check:
        result["check"] = _check(model, checked, args.check_sizes)
    if args.check_steps:
        result["check_steps"] = _print_step_rows(step_rows, args.check_steps, work)
    if getattr(args, "report", False):
        _report(model, topo, args, result)
    return finish(args, result, "model")


def _refuse_unpredictable(model: Any, topo: Any) -> None:
    """A usage error, with the model's own reason, where it can predict none of the engine's paths on
    ``topo`` (a fit without the runs that layout needs): an empty table would read as a result."""
    from ..model.predict import algorithms_for

    if not any(a in ("flat", "hierarchical") for a in algorithms_for(model, topo)):
        model.time_s("flat", topo, 1 << 20)  # raises the ModelError (a UsageError) that says what is missing
        raise UsageError(f"the model cannot predict tunelab's allreduce on {topo.describe()}")


def _topology(model: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    from ..model.costs import Topology

    link = "none"
    if args.hosts > 1:
        model, link = model.for_link(args.link_gbps)
    elif args.link_gbps is not None:  # (it was ignored: the answer read as one for that link)
        raise UsageError("--link-gbps is the link between hosts, and --hosts 1 has none: leave it out, or "
                         "give --hosts 2 or more")
    return model, Topology(args.hosts, args.ranks_per_host, link, args.oversubscription)


def _allreduce(model: Any, topo: Any, sizes: list[int], knobs: Any) -> list[dict]:
    from ..bench.common import format_table
    from ..model.predict import allreduce_table

    rows = allreduce_table(model, topo, sizes, knobs)
    emulated = any(r["algorithm"].endswith("*") for r in rows)
    print(f"# predicted allreduce (float32; segment {format_size(knobs.segment_bytes)}"
          + ("; mpi*: MPI as measured beside emulated nodes, not through the link)" if emulated else ")"))
    table = [{**r, "size_h": format_size(r["size"]), "time_ms": r["time_us"] / 1e3} for r in rows]
    print(format_table(table, [("algorithm", "algorithm", ""), ("size_h", "size", ""), ("time_ms", "time_ms", ".3f"),
                               ("algbw_gbps", "algbw_GB/s", ".3f"), ("busbw_gbps", "busbw_GB/s", ".3f")]))
    return rows


def _crossover(model: Any, topo: Any, knobs: Any) -> dict | None:
    from ..model.fit import ModelError
    from ..model.predict import crossover

    try:
        c = crossover(model, topo, knobs)
    except ModelError as exc:  # (one of the two paths is not fitted: the table above has the other)
        print(f"# flat vs hierarchical: not predicted ({exc})")
        return None
    if c is None:
        if topo.hosts > 1:
            print("# flat vs hierarchical: no crossover: with one rank per host, hierarchical is the flat ring")
        return None
    print(f"# flat vs hierarchical: {c.describe()}")
    out = _crossover_dict(c)
    try:
        fused = crossover(model, topo, knobs, route="bucket")  # what the hierarchical knob does in training
    except ModelError:
        fused = None
    if fused is not None and fused.describe() != c.describe():
        print(f"# flat vs hierarchical for a training job's fused buckets (no short route): {fused.describe()}")
    if fused is not None:
        out["buckets"] = _crossover_dict(fused)
    return out


def _crossover_dict(c: Any) -> dict:
    return {"sizes": list(c.sizes), "faster_below": c.faster_below, "faster_above": c.faster_above,
            "onset": c.onset, "onset_below_range": c.onset_below_range}


def _steps(model: Any, topo: Any, work: Any, base: Any, pinned: list[str]) -> dict:
    from ..bench.common import format_table
    from ..model.predict import grid_knobs, step_table

    knobs_list = grid_knobs(None, topo, base, pinned)  # (a --knob holds for every setting)
    rows = step_table(model, work, topo, list(dict.fromkeys(knobs_list + [base])))
    default = next(r for r in rows if r["knobs"] == base)
    flat = [{**r["knobs"].as_dict(), **{k: v for k, v in r.items() if k != "knobs"}} for r in rows]
    for r in flat:  # as every command prints knobs: "off" for no fusion, on/off for hierarchical
        r["fusion"], r["segment"] = (knob_text("fusion_threshold_bytes", r["fusion_threshold_bytes"]),
                                     knob_text("segment_bytes", r["segment_bytes"]))
        r["hier"] = knob_text("hierarchical", r["hierarchical"])
    print(f"# step time of {work.name}: {len(work.gradient_bytes)} gradients, {human_size(work.total_bytes)}, "
          f"forward {work.forward_ms:g} ms + backward {work.backward_ms:g} ms"
          f"{' (assumed: a training scenario records no compute times)' if work.assumed else ''}; "
          f"{len(knobs_list)} knob settings, "
          f"fastest first (first {STEP_ROWS})")
    print(format_table(flat[:STEP_ROWS], [
        ("fusion", "fusion", ""), ("cycle_time_ms", "cycle_ms", "g"), ("segment", "segment", ""),
        ("hier", "hier", ""), ("step_ms", "step_ms", ".1f"), ("exposed_comm_ms", "exposed_ms", ".1f"),
        ("cycles", "cycles", "d"), ("buckets", "buckets", "d")]))
    best = rows[0]
    print(f"# best: {_knobs_text(best['knobs'])}: {best['step_ms']:.1f} ms/step; the given knobs "
          f"({_knobs_text(base)}): {default['step_ms']:.1f} ms ({default['step_ms'] / best['step_ms']:.2f}x the best)")
    return {"scenario": work.name, "rows": [{**r, "knobs": r["knobs"].as_dict()} for r in rows],
            "best": {**best, "knobs": best["knobs"].as_dict()}, "given": {**default, "knobs": base.as_dict()}}


def _knobs_text(k: Any) -> str:
    return ", ".join(f"{label} {knob_text(name, getattr(k, name))}{unit}" for label, name, unit in (
        ("fusion", "fusion_threshold_bytes", ""), ("cycle", "cycle_time_ms", " ms"), ("segment", "segment_bytes", ""),
        ("hierarchical", "hierarchical", "")))


def _at_sizes(obs: list, sizes: list[int] | None, what: str) -> list:
    """The observations at ``sizes`` (all when None); a usage error when none is left."""
    if sizes is None:
        return obs
    kept = [o for o in obs if o.size in set(sizes)]
    if not kept:
        raise UsageError(f"{what}: no measurement at the sizes given ({', '.join(map(format_size, sizes))})")
    return kept


def _check(model: Any, checked: list, sizes: list[int] | None = None) -> dict:
    """``checked``: every measurement of the --check files, repeats kept apart."""
    from ..model.data import combine_repeats
    from ..model.fit import relative_errors
    from ..model.validate import crossover_check

    every = combine_repeats(checked)
    obs = _at_sizes(every, sizes, "--check")
    skipped: list[str] = []
    errors = [{**e, "held_out": True} for e in relative_errors(model, obs, skipped)]
    if skipped:
        print(f"# check: {len(skipped)} measurements the model cannot predict are left out, e.g. {skipped[0]}")
    if not errors:
        raise UsageError("--check: the model predicts none of these measurements")
    print("# check: measured (held-out files) vs predicted")
    summary = _print_errors(errors, "check")
    # the crossover needs every size measured, and each repeat on its own (the median of their differences)
    crossings = crossover_check(model, checked)
    for c in crossings:
        runs = f"{c['source']} ({c['repeats']} run{'s' if c['repeats'] > 1 else ''})"
        if c.get("same_path"):
            sp = c["same_path_spread"]
            print(f"# crossover {runs}: none (one rank per host: hierarchical is the flat ring); the two "
                  f"measurements of that one path differ by {100 * sp['median']:.0f}% (median), "
                  f"{100 * sp['max']:.0f}% (max): run-to-run noise")
            continue
        factor = f"; first crossover predicted/measured {c['factor']:.2f}" if "factor" in c else \
            "; the first crossovers go opposite ways (no factor)" if c.get("opposite") else ""
        if "onset_factor" in c:
            bound = {"<=": "at most ", ">=": "at least "}.get(c["onset_factor_bound"], "")
            factor += f"; onset predicted/measured {bound}{c['onset_factor']:.2f}"
        print(f"# crossover {runs}: measured {c['measured']}; predicted {c['predicted']}; winner agrees at "
              f"{c['winners_agree']}/{c['sizes']} sizes{factor}")
        if c.get("repeats_within_2x") is not None:
            own = ", ".join(human_size(x) if x is not None else "none" for x in c["repeat_crossovers"])
            print(f"#   each run on its own: first crossover at {own}; {c['repeats_within_2x']} of "
                  f"{len(c['repeat_crossovers'])} within a factor of 2 of the median's "
                  f"{human_size(c['measured_crossover'])} (how well the lab itself names it)")
    return {"points": errors, "summary": summary, "crossover": crossings}


def _step_rows(model: Any, files: list[Path], scenario: str, work: Any, link: str) -> list[dict]:
    """Measured vs predicted step time; the files are runs of one landscape (repeats), their visits
    pooled per grid point and the fastest visit kept (as the fit keeps the fastest repeat).  Read and
    computed before any table is printed: a damaged file is refused first.  The gradients are the
    landscape's dtype (a half-precision replay moves half the bytes)."""

    from ..files import read_json
    from ..model.step import Workload
    from ..model.validate import merge_landscapes, step_check

    docs = []
    for path in files:
        try:
            doc = read_json(path)
        except OSError as exc:
            raise UsageError(f"{path}: cannot read a landscape ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise UsageError(f"{path}: not a landscape JSON file ({' '.join(str(exc).split())})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
            raise UsageError(f"{path}: not a bench landscape result (no list of points)")
        if not doc["points"]:
            raise UsageError(f"{path}: the landscape has no measured points")
        recorded = doc.get("scenario")
        if recorded is not None and recorded != work.name:
            raise UsageError(f"{path}: recorded on scenario {recorded!r}, not {work.name!r}: "
                             f"give --scenario {recorded}")
        docs.append(doc)
    dtypes = {str(d.get("dtype") or "float32") for d in docs}
    if len(dtypes) > 1:
        raise UsageError(f"--check-steps: landscapes of different dtypes ({', '.join(sorted(dtypes))}); check them apart")
    dtype = dtypes.pop()
    if dtype not in _LANDSCAPE_DTYPES:  # (what `bench landscape --dtype` records)
        raise UsageError(f"--check-steps: the landscape's dtype {dtype[:40]!r} is not one of {', '.join(_LANDSCAPE_DTYPES)}")
    element = _LANDSCAPE_DTYPES[dtype]
    if element != 4:  # (the scenario's workload as the landscape recorded it)
        work = Workload.from_scenario(scenario, element)
    source = ",".join(Path(p).stem for p in files)
    rows = [{**r, "source": source} for r in step_check(model, merge_landscapes(docs), work, link)]
    if not rows:
        raise UsageError(f"{source}: no landscape point has step times (recorded before step times were kept?)")
    return rows


def _print_step_rows(rows: list[dict], files: list[Path], work: Any) -> list[dict]:
    from ..bench.common import format_table
    from ..model.validate import summarize
    table = [{"fusion": knob_text("fusion_threshold_bytes", r["knobs"]["fusion_threshold_bytes"]),
              "cycle_ms": r["knobs"]["cycle_time_ms"], "segment": knob_text("segment_bytes", r["knobs"]["segment_bytes"]),
              "hier": knob_text("hierarchical", r["knobs"]["hierarchical"]),
              "visits": r["visits"], "median_all_ms": 1e3 * r["median_all_s"],
              "measured_ms": 1e3 * r["measured_s"], "predicted_ms": 1e3 * r["predicted_s"],
              "error_pct": 100 * r["rel_error"]} for r in rows]
    print(f"# step check: measured (median step of the fastest visit of each landscape point; median_all: of "
          f"every step) vs predicted, {work.name}, {len(files)} landscape run{'s' if len(files) > 1 else ''}")
    print(format_table(table, [("fusion", "fusion", ""), ("cycle_ms", "cycle_ms", "g"), ("segment", "segment", ""),
                               ("hier", "hier", ""), ("visits", "visits", "d"), ("median_all_ms", "median_all_ms", ".1f"),
                               ("measured_ms", "measured_ms", ".1f"), ("predicted_ms", "predicted_ms", ".1f"),
                               ("error_pct", "error_%", "+.1f")]))
    s = summarize(rows)
    print(f"# step check: {s['points']} points, |error| median {100 * s['median']:.1f}%, max {100 * s['max']:.1f}%, "
          f"within 15%: {s['within_15pct']}/{s['points']}")
    return rows


def _report(model: Any, topo: Any, args: argparse.Namespace, result: dict) -> None:
    try:
        import jinja2  # noqa: F401
        import matplotlib  # noqa: F401
        import pandas  # noqa: F401
    except ImportError as exc:
        print(f"# report skipped: {exc.name} is not installed (pip install 'tunelab[report]')")
        return
    from ..model.report import model_section, write_model_report

    errors = [{**e, "held_out": False} for e in model.fit_points] + result.get("check", {}).get("points", [])
    tables = [("predicted allreduce", [{**r, "size": format_size(r["size"])} for r in result["allreduce"]])]
    if "step" in result:
        tables.append(("predicted step time per knob setting (fastest first)",
                       [{**r.pop("knobs"), **r} for r in [dict(x) for x in result["step"]["rows"][:STEP_ROWS]]]))
    section = model_section(model, errors, topo.ranks_per_host, topo.link if topo.hosts > 1 else "none",
                            [1 << 20, 64 << 20], tables)
    from ..report.build import default_out

    out = default_out("model")
    write_model_report(out, section, [str(args.model_file)] + [str(p) for p in args.check])
    print(f"# report: {out}")
