"""The ``tunelab`` command line.

Errors are one line on stderr: bad usage exits 2, a failed run exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .engine.link import add_link_flags
from .errors import TunelabError, UsageError
from .units import format_size, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _size_list(text: str) -> list[int]:
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def _choice_list(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        items = [part.strip() for part in text.split(",") if part.strip()]
        for item in items:
            if item not in choices:
                raise argparse.ArgumentTypeError(f"unknown choice {item!r} (choose from {', '.join(choices)})")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return list(dict.fromkeys(items))
    return parse


def _knob(text: str) -> tuple[str, str]:
    from .knobs import SPECS, Knobs

    name, sep, value = text.partition("=")
    if not sep or name not in SPECS:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(SPECS)}, "
                                         f"got {text!r}")
    try:
        Knobs(**{name: value})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, value


def build_parser() -> argparse.ArgumentParser:
    from .bench.allreduce import ALGORITHMS
    from .dtypes import supported_names
    from .report.auto import add_report_flag
    from .workloads.shapes import MODELS

    parser = _Parser(prog="tunelab", description="Bayesian autotuning lab for data-parallel communication.")
    parser.add_argument("--version", action="version", version=f"tunelab {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    bench = sub.add_parser("bench", help="benchmarks (allreduce, fusion, kernels)")
    bsub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser, iters: int, warmup: int) -> None:
        p.add_argument("--np", type=_positive_int, default=2, help="ranks to launch (default 2)")
        p.add_argument("--ranks-per-node", type=_positive_int, default=None,
                       help="emulate nodes of K ranks on one host")
        p.add_argument("--iters", type=_positive_int, default=iters)
        p.add_argument("--warmup", type=_non_negative_int, default=warmup)
        p.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                       help="set an engine knob, e.g. segment_bytes=1MiB (repeatable)")
        p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")

    ar = bsub.add_parser("allreduce", help="allreduce time/algbw/busbw per size and algorithm")
    common(ar, iters=20, warmup=5)
    ar.add_argument("--sizes", type=_size_list, default=_size_list("1KiB,1MiB,64MiB"),
                    help="comma-separated sizes (default 1KiB,1MiB,64MiB)")
    ar.add_argument("--dtype", choices=supported_names(), default="float32")
    ar.add_argument("--algorithms", type=_choice_list(ALGORITHMS), default=list(ALGORITHMS),
                    help=f"comma-separated, from {','.join(ALGORITHMS)}")
    add_link_flags(ar)
    ar.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the buffers live (cuda: the engine's device path, CUDA IPC within a node)")
    add_report_flag(ar)
    ar.set_defaults(func=_cmd_bench_allreduce)

    fu = bsub.add_parser("fusion", help="a model's gradients: per-tensor vs fused vs contiguous")
    common(fu, iters=10, warmup=3)
    fu.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    add_report_flag(fu)
    fu.set_defaults(func=_cmd_bench_fusion)

    from .bench.kernels import add_parser as add_kernels_parser

    add_kernels_parser(bsub)  # bench kernels: rank-free, runs in this process

    from .bench.landscape import add_parser as add_landscape_parser
    from .bench.tuner import add_parser as add_tuner_parser

    add_landscape_parser(bsub)  # bench landscape: a grid of knob settings measured in one training run
    add_tuner_parser(bsub)  # bench tuner: search strategies replayed on recorded landscapes, no ranks

    tr = bsub.add_parser("train", help="training samples/s: tunelab vs the framework's data-parallel path")
    common(tr, iters=10, warmup=3)
    tr.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    tr.add_argument("--framework", choices=["torch", "tensorflow"], default="torch")
    tr.add_argument("--image-size", type=_positive_int, default=64)
    tr.add_argument("--batch-size", type=_positive_int, default=8, help="per rank")
    tr.add_argument("--rounds", type=_positive_int, default=2, help="alternating rounds per system")
    tr.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where each rank trains (cuda: its GPU; torch only)")
    add_report_flag(tr)
    tr.set_defaults(func=_cmd_bench_train)

    tune = sub.add_parser("tune", help="tune the engine's knobs live, inside one training run")
    tune.add_argument("--model", default="resnet50", help="scenario name (scenarios/NAME.toml)")
    tune.add_argument("--scenario", type=Path, default=None, help="a scenario file (instead of --model)")
    tune.add_argument("--framework", choices=["torch", "tensorflow"], default=None)
    tune.add_argument("--np", type=_positive_int, default=None, help="ranks to launch")
    tune.add_argument("--ranks-per-node", type=_positive_int, default=None)
    add_link_flags(tune)
    tune.add_argument("--device", choices=["cpu", "cuda"], default=None,
                      help="where each rank trains (cuda: its GPU, torch models); default: the scenario's")
    tune.add_argument("--image-size", type=_positive_int, default=None)
    tune.add_argument("--batch-size", type=_positive_int, default=None, help="per rank")
    budget = tune.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=_positive_int, default=None, metavar="SAMPLES")
    budget.add_argument("--time-budget", type=_positive_float, default=None, metavar="SECONDS")
    tune.add_argument("--seed", type=_non_negative_int, default=0)
    tune.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                      help="pin a knob (excluded from the search); repeatable")
    tune.add_argument("--no-store", action="store_true", help="do not write the profile store")
    tune.add_argument("--retune", type=_positive_int, nargs="?", const=200, default=0, metavar="STEPS",
                      help="after the lock, train STEPS more steps (default 200) and tune again if step time "
                           "leaves the locked configuration's interval")
    tune.add_argument("--json", type=Path, default=None, metavar="PATH")
    add_report_flag(tune)
    tune.set_defaults(func=_cmd_tune)

    hw = sub.add_parser("hw", help="print this host's hardware and software facts")
    hw.set_defaults(func=_cmd_hw)

    from .report import add_parser as add_report_parser

    add_report_parser(sub)  # report: one self-contained HTML file from tuning runs and benchmarks

    from .profiles_cli import add_parser as add_profiles_parser

    add_profiles_parser(sub)  # profiles list/show/export/import/delete: the tuning profile store
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def _params(args: argparse.Namespace) -> dict:
    return {"iters": args.iters, "warmup": args.warmup, "ranks_per_node": args.ranks_per_node,
            "knobs": dict(args.knob)}


def _cmd_bench_allreduce(args: argparse.Namespace) -> int:
    from .bench.allreduce import add_ratios
    from .bench.common import format_table
    from .launch import run_job

    if args.link_gbps is not None and args.ranks_per_node is None:
        raise UsageError("--link-gbps emulates the link between emulated nodes: give --ranks-per-node too")
    params = {**_params(args), "sizes": args.sizes, "dtype": args.dtype, "algorithms": args.algorithms,
              "link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us, "device": args.device}
    result = run_job("bench-allreduce", params, args.np)
    add_ratios(result["rows"])
    hw = result["hardware"]
    print(f"# allreduce  np={hw['world_size']}  nodes={hw['nodes']} {hw['ranks_per_node']}  device={args.device}  "
          f"dtype={args.dtype}  iters={args.iters}  warmup={args.warmup}  (time: median of slowest rank)")
    rows = [{**r, "size_h": format_size(r["size"])} for r in result["rows"]]
    print(format_table(rows, [("algorithm", "algorithm", ""), ("size_h", "size", ""), ("count", "count", "d"),
                              ("dtype", "type", ""), ("time_us", "time_us", ".1f"),
                              ("algbw_gbps", "algbw_GB/s", ".2f"), ("busbw_gbps", "busbw_GB/s", ".2f"),
                              ("busbw_vs_mpi", "busbw/mpi", ".2f"), ("time_vs_bound", "time/bound", ".1f"),
                              ("wrong", "#wrong", "d")]))
    for note in result.get("notes", []):
        print(f"# note: {note}")
    return _finish(result, args.json, [r for r in result["rows"] if r["wrong"]], "algorithm",
                   ("allreduce", "bench") if args.report else None)


def _cmd_bench_fusion(args: argparse.Namespace) -> int:
    from .bench.common import format_table
    from .launch import run_job

    params = {**_params(args), "model": args.model}
    result = run_job("bench-fusion", params, args.np)
    knobs = result["knobs"]
    print(f"# fusion  model={result['model']}  np={result['world_size']}  "
          f"fusion_threshold={format_size(knobs['fusion_threshold_bytes'])}  iters={args.iters}")
    print(format_table(result["rows"], [("mode", "mode", ""), ("tensors", "tensors", "d"),
                                        ("bytes", "bytes", "d"), ("time_us", "time_us", ".0f"),
                                        ("time_us_p10", "p10_us", ".0f"), ("time_us_p90", "p90_us", ".0f"),
                                        ("speedup_vs_per_tensor", "vs_per_tensor", ".2f"),
                                        ("vs_contiguous", "vs_contiguous", ".3f"), ("wrong", "#wrong", "d")]))
    return _finish(result, args.json, [r for r in result["rows"] if r["wrong"]], "mode",
                   ("fusion", "bench") if args.report else None)


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from .bench.common import format_table
    from .bench.train import SYSTEMS
    from .launch import run_job

    params = {**_params(args), "model": args.model, "framework": args.framework, "steps": args.iters,
              "image_size": args.image_size, "batch_size": args.batch_size, "rounds": args.rounds,
              "systems": list(SYSTEMS[args.framework]), "device": args.device}
    if args.device == "cuda" and args.framework != "torch":
        raise UsageError("bench train --device cuda trains torch models; TensorFlow places its own devices")
    result = run_job("bench-train", params, args.np)
    rows = result["rows"]
    base = rows[-1]["samples_per_s"]
    for r in rows:
        r["vs_" + rows[-1]["system"]] = r["samples_per_s"] / base
    print(f"# train  model={args.model}  framework={args.framework}  device={args.device}  np={result['world_size']}  "
          f"batch={args.batch_size}/rank  image={args.image_size}  steps={args.iters}x{args.rounds} rounds  "
          f"threads/rank={result['threads_per_rank']}")
    print(format_table(rows, [("system", "system", ""), ("samples_per_s", "samples/s", ".2f"),
                              ("samples_per_s_min", "min", ".2f"), ("samples_per_s_max", "max", ".2f"),
                              ("step_ms", "step_ms", ".0f"), ("vs_" + rows[-1]["system"], "vs_" + rows[-1]["system"], ".3f"),
                              ("weights_identical", "same_weights", "")]))
    for note in result.get("notes", []):
        print(f"# note: {note}")
    bad = [r for r in rows if not r["weights_identical"]]
    if bad:
        sys.stderr.write("tunelab: error: weights diverged across ranks for " +
                         ", ".join(r["system"] for r in bad) + "\n")
        return 1
    return _finish(result, args.json, [], "system", ("train", "bench") if args.report else None)


def _cmd_tune(args: argparse.Namespace) -> int:
    from .launch import run_job
    from .scenarios import load_scenario
    from .tuning.report_text import print_tune_summary

    scenario = load_scenario(str(args.scenario) if args.scenario else args.model)
    scenario = scenario.with_overrides(
        framework=args.framework, np=args.np, ranks_per_node=args.ranks_per_node, link_gbps=args.link_gbps,
        link_latency_us=args.link_latency_us, image_size=args.image_size, device=args.device,
        batch_size=args.batch_size, budget_samples=args.budget, time_budget_s=args.time_budget,
        knobs={**scenario.knobs, **dict(args.knob)} if args.knob else None)
    params = {**scenario.as_params(), "seed": args.seed, "store": not args.no_store, "retune_steps": args.retune}
    print(f"# tuning {scenario.name}: {scenario.model} ({scenario.framework if scenario.workload == 'train' else 'replay'})"
          f" on {scenario.np} ranks, budget {scenario.budget_samples} samples"
          + (f", pinned {', '.join(scenario.knobs)}" if scenario.knobs else ""), flush=True)
    result = run_job("tune", params, scenario.np)
    print_tune_summary(result)
    return _finish(result, args.json, [], "model", ("tune", "tune") if args.report else None)


def _finish(result: dict, json_path: Path | None, bad_rows: list[dict], key: str,
            report: tuple[str, str] | None = None) -> int:
    """Write ``--json``, the HTML report (``report`` = (name, "bench"|"tune"), None for none), and turn
    wrong results into exit 1."""
    from .report.auto import write_outputs

    write_outputs(result, json_path, report[0] if report else "result", report[1] if report else None)
    if bad_rows:
        names = ", ".join(sorted({str(r[key]) for r in bad_rows}))
        sys.stderr.write(f"tunelab: error: wrong results from {names}\n")
        return 1
    return 0


def _cmd_hw(args: argparse.Namespace) -> int:
    from .hardware import host_info

    for key, value in host_info().items():
        print(f"{key}: {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .launch import inside_mpi_job, job_rank

    if inside_mpi_job() and job_rank() != 0:  # under the user's mpiexec/srun: rank 0 speaks for the job
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
    try:
        return args.func(args)
    except UsageError as exc:
        sys.stderr.write(f"tunelab: error: {exc}\n")
        return 2
    except TunelabError as exc:
        sys.stderr.write(f"tunelab: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("tunelab: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
