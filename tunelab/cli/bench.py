"""``tunelab bench``: allreduce, fusion and train here; kernels, landscape and tuner register themselves
from their ``tunelab.bench`` modules (``add_parser``), with the same types and the same finish."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from ..units import format_size
from .finish import add_output_flags, finish
from .types import Parser, choice_list, knob, non_negative_int, positive_int, size_list


def register(subparsers: argparse._SubParsersAction) -> None:
    from ..bench.kernels import add_parser as add_kernels
    from ..bench.landscape import add_parser as add_landscape
    from ..bench.tuner import add_parser as add_tuner

    bench = subparsers.add_parser("bench", help="benchmarks (allreduce, fusion, kernels, train, landscape, tuner)")
    bsub = bench.add_subparsers(dest="bench", required=True, parser_class=Parser)
    _add_allreduce(bsub)
    _add_fusion(bsub)
    add_kernels(bsub)  # rank-free, runs in this process
    add_landscape(bsub)  # a grid of knob settings measured in one training run
    add_tuner(bsub)  # search strategies replayed on recorded landscapes, no ranks
    _add_train(bsub)


def _common(p: argparse.ArgumentParser, iters: int, warmup: int) -> None:
    p.add_argument("--np", type=positive_int, default=None,
                   help="ranks to launch (default 2; with --lab, the lab's hosts x ranks per host)")
    p.add_argument("--lab", action="store_true",
                   help="run the ranks on the hosts of 'tunelab lab up' (spread evenly, TCP over shaped links)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="emulate nodes of K ranks on one host")
    p.add_argument("--iters", type=positive_int, default=iters, help="timed iterations (steps) per measurement "
                   "(default %(default)s)")
    p.add_argument("--warmup", type=non_negative_int, default=warmup,
                   help="untimed iterations before them (default %(default)s)")
    p.add_argument("--knob", type=knob, action="append", default=[], metavar="NAME=VALUE",
                   help="set an engine knob, e.g. segment_bytes=1MiB (repeatable)")


def _check_lab_flags(args: argparse.Namespace) -> None:
    if args.lab and (args.ranks_per_node is not None or getattr(args, "link_gbps", None) is not None):
        raise UsageError("--lab hosts are real hosts with real links: drop --ranks-per-node and --link-gbps "
                         "(the emulated nodes)")


def _params(args: argparse.Namespace) -> dict:
    return {"iters": args.iters, "warmup": args.warmup, "ranks_per_node": args.ranks_per_node,
            "knobs": dict(args.knob)}


# ---- bench allreduce ------------------------------------------------------------------------------
def _add_allreduce(bsub: argparse._SubParsersAction) -> None:
    from ..bench.allreduce import ALGORITHMS
    from ..dtypes import supported_names
    from ..engine.link import add_link_flags

    ar = bsub.add_parser("allreduce", help="allreduce time/algbw/busbw per size and algorithm")
    _common(ar, iters=20, warmup=5)
    ar.add_argument("--sizes", type=size_list, default=size_list("1KiB,1MiB,64MiB"),
                    help="comma-separated sizes (default 1KiB,1MiB,64MiB)")
    ar.add_argument("--dtype", choices=supported_names(), default="float32", help="element type (default float32)")
    ar.add_argument("--algorithms", type=choice_list(ALGORITHMS), default=None,
                    help=f"comma-separated, from {','.join(ALGORITHMS)} (default: all; hierarchical left out "
                         "on nodes of unequal size)")
    add_link_flags(ar)
    ar.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the buffers live (cuda: the engine's device path, CUDA IPC within a node)")
    add_output_flags(ar)
    ar.set_defaults(func=_run_allreduce)


def _run_allreduce(args: argparse.Namespace) -> int:
    from ..bench.allreduce import add_link_bound, add_ratios
    from ..bench.common import format_table
    from ..lab import job_ranks
    from ..lab import session as lab_session
    from ..launch import run_job

    if args.link_gbps is not None and args.ranks_per_node is None:
        raise UsageError("--link-gbps emulates the link between emulated nodes: give --ranks-per-node too")
    _check_lab_flags(args)
    from ..dtypes import dtype_from_name

    itemsize = dtype_from_name(args.dtype).itemsize
    odd = [s for s in args.sizes if s % itemsize]
    if odd:
        raise UsageError(f"--sizes: {format_size(odd[0])} is not a whole number of {args.dtype} elements "
                         f"({itemsize} B each)")
    from ..bench.allreduce import ALGORITHMS

    params = {**_params(args), "sizes": args.sizes, "dtype": args.dtype,
              "algorithms": args.algorithms or list(ALGORITHMS), "algorithms_given": args.algorithms is not None,
              "link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us, "device": args.device}
    with lab_session(args.lab) as lab:
        ranks = job_ranks(lab, args.np)
        _refuse_sizes_memory_cannot_hold(max(args.sizes), ranks)
        result = run_job("bench-allreduce", params, ranks, lab=lab)
    add_link_bound(result["rows"], result["hardware"])
    add_ratios(result["rows"])
    hw = result["hardware"]
    print(f"# allreduce  np={hw['world_size']}  nodes={hw['nodes']} {hw['ranks_per_node']}  device={args.device}  "
          f"dtype={args.dtype}  iters={args.iters}  warmup={args.warmup}  (time: median of slowest rank)")
    if lab is not None:
        per_host = hw["lab"]["ranks_per_host"]
        print(f"# lab: {hw['lab']['hosts']} hosts x {per_host} rank{'s' if per_host != 1 else ''}, "
              f"{lab.spec.link_gbps:g} Gb/s links; one TCP stream sustained "
              + (f"{lab.sustained_gbps:.2f} Gb/s" if lab.sustained_gbps else "(not measured)")
              + " at lab up; link-bound = 2(H-1)/H x size / link rate, computed")
    columns = [("algorithm", "algorithm", ""), ("size_h", "size", ""), ("count", "count", "d"),
               ("dtype", "type", ""), ("time_us", "time_us", ".1f"),
               ("algbw_gbps", "algbw_GB/s", ".2f"), ("busbw_gbps", "busbw_GB/s", ".2f"),
               ("busbw_vs_mpi", "busbw/mpi", ".2f"), ("time_vs_bound", "time/bound", ".1f")]
    if any("time_vs_link" in r for r in result["rows"]):
        columns.append(("time_vs_link", "time/link", ".2f"))
    rows = [{**r, "size_h": format_size(r["size"])} for r in result["rows"]]
    print(format_table(rows, [*columns, ("wrong", "#wrong", "d")]))
    return finish(args, result, "allreduce", "bench", bad=(r["algorithm"] for r in result["rows"] if r["wrong"]))


ALLREDUCE_HOST_BYTES_PER_BYTE = 4  # a rank's input, output and reference at a size, and some slack


def _refuse_sizes_memory_cannot_hold(size: int, ranks: int) -> None:
    """A usage error before anything starts where ``ranks`` ranks of this machine, each holding its
    arrays at ``size``, exceed the memory available (the kernel kills a process whose allocation it let
    through, which no error reports).  Not under the user's mpiexec, whose ranks may be on other hosts."""
    from ..launch import RANK_MEMORY_MIB, available_memory_bytes, check_ranks_fit, job_size

    available = available_memory_bytes()
    if available is None or job_size() is not None:
        return
    check_ranks_fit(ranks)  # (too many ranks is said as such, whatever the sizes)
    each = (RANK_MEMORY_MIB << 20) + ALLREDUCE_HOST_BYTES_PER_BYTE * size
    if ranks * each > available:
        raise UsageError(f"--sizes {format_size(size)} on {ranks} ranks does not fit in memory here: each rank "
                         f"holds about {each / 2**30:.1f} GiB and {available / 2**30:.1f} GiB is available; "
                         "give smaller --sizes or fewer ranks")


# ---- bench fusion ---------------------------------------------------------------------------------
def _add_fusion(bsub: argparse._SubParsersAction) -> None:
    from ..workloads.shapes import MODELS

    fu = bsub.add_parser("fusion", help="a model's gradients: per-tensor vs fused vs contiguous, and a copy (the bound)")
    _common(fu, iters=10, warmup=3)
    fu.add_argument("--model", choices=sorted(MODELS), default="resnet50",
                    help="whose gradient tensors (default resnet50)")
    add_output_flags(fu)
    fu.set_defaults(func=_run_fusion)


def _run_fusion(args: argparse.Namespace) -> int:
    from ..bench.common import format_table
    from ..knobs import knob_text
    from ..lab import job_ranks
    from ..lab import session as lab_session
    from ..launch import run_job

    _check_lab_flags(args)
    params = {**_params(args), "model": args.model}
    with lab_session(args.lab) as lab:
        result = run_job("bench-fusion", params, job_ranks(lab, args.np), lab=lab)
    knobs = result["knobs"]
    print(f"# fusion  model={result['model']}  np={result['world_size']}  "
          f"fusion_threshold={knob_text('fusion_threshold_bytes', knobs['fusion_threshold_bytes'])}  iters={args.iters}")
    print(format_table(result["rows"], [("mode", "mode", ""), ("tensors", "tensors", "d"),
                                        ("bytes", "bytes", "d"), ("time_us", "time_us", ".0f"),
                                        ("time_us_p10", "p10_us", ".0f"), ("time_us_p90", "p90_us", ".0f"),
                                        ("speedup_vs_per_tensor", "vs_per_tensor", ".2f"),
                                        ("vs_contiguous", "vs_contiguous", ".3f"), ("vs_bound", "vs_bound", ".2f"),
                                        ("wrong", "#wrong", "d")]))
    return finish(args, result, "fusion", "bench", bad=(r["mode"] for r in result["rows"] if r["wrong"]))


# ---- bench train ----------------------------------------------------------------------------------
def _add_train(bsub: argparse._SubParsersAction) -> None:
    from ..workloads.shapes import MODELS

    tr = bsub.add_parser("train", help="training samples/s: tunelab vs the framework's data-parallel path")
    _common(tr, iters=10, warmup=3)
    tr.add_argument("--model", choices=sorted(MODELS), default="resnet50", help="the model to train (default resnet50)")
    tr.add_argument("--framework", choices=["torch", "tensorflow"], default="torch",
                    help="the training framework and its baseline: DDP or MultiWorkerMirroredStrategy (default torch)")
    tr.add_argument("--image-size", type=positive_int, default=64, help="square input images (default %(default)s)")
    tr.add_argument("--batch-size", type=positive_int, default=8, help="per rank (default %(default)s)")
    tr.add_argument("--rounds", type=positive_int, default=2,
                    help="alternating rounds per system; the table gives their median, min and max (default %(default)s)")
    tr.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where each rank trains (cuda: its GPU; torch only)")
    add_output_flags(tr)
    tr.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from ..bench.common import format_table
    from ..bench.train import SYSTEMS
    from ..launch import run_job

    if args.device == "cuda" and args.framework != "torch":
        raise UsageError("bench train --device cuda trains torch models; TensorFlow places its own devices")
    from ..scenarios import image_size_problem

    image = image_size_problem(args.model, args.image_size)
    if image is not None:
        raise UsageError(f"--image-size {image}")
    params = {**_params(args), "model": args.model, "framework": args.framework, "steps": args.iters,
              "image_size": args.image_size, "batch_size": args.batch_size, "rounds": args.rounds,
              "systems": list(SYSTEMS[args.framework]), "device": args.device}
    from ..lab import job_ranks
    from ..lab import session as lab_session

    _check_lab_flags(args)
    with lab_session(args.lab) as lab:
        result = run_job("bench-train", params, job_ranks(lab, args.np), lab=lab)
    rows = result["rows"]
    ref = "vs_" + rows[-1]["system"]
    for r in rows:
        r[ref] = r["samples_per_s"] / rows[-1]["samples_per_s"]
    print(f"# train  model={args.model}  framework={args.framework}  device={args.device}  np={result['world_size']}  "
          f"batch={args.batch_size}/rank  image={args.image_size}  steps={args.iters}x{args.rounds} rounds  "
          f"threads/rank={result['threads_per_rank']}" + (f"  lab: {lab.describe()}" if lab else ""))
    print(format_table(rows, [("system", "system", ""), ("samples_per_s", "samples/s", ".2f"),
                              ("samples_per_s_min", "min", ".2f"), ("samples_per_s_max", "max", ".2f"),
                              ("step_ms", "step_ms", ".0f"), (ref, ref, ".3f"),
                              ("weights_identical", "same_weights", "")]))
    return finish(args, result, "train", "bench", bad=(r["system"] for r in rows if not r["weights_identical"]),
                  problem="weights diverged across ranks for")

