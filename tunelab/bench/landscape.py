"""``tunelab bench landscape``: throughput of a grid of knob settings inside one training run.

A landscape is what a tuning strategy would see if it could measure every grid point: each point
is visited ``repeats`` times, in a freshly shuffled order per repeat (so slow drift on a shared
machine spreads over all points instead of biasing the ones measured last), and every visit is
measured exactly as a live tuning sample is (``discard_steps`` after the knob change, then
``measure_steps`` timed steps, or as many as last ``block_seconds`` where steps are short, sized once
from the fastest warm-up step; score = median samples/s).  ``tunelab bench tuner`` replays stored
landscapes to compare search strategies without running training again.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import time
from typing import Any

from ..cli.finish import add_output_flags, finish
from ..cli.types import (
    add_training_flags,
    chosen_scenario,
    default_scenario_input,
    input_file,
    named_input,
    positive_int,
    scenario_input,
)
from ..cli.types import seed as seed_type
from ..errors import UsageError
from ..knobs import Knobs, parse_bool

ALIASES = {"fusion": "fusion_threshold_bytes", "cycle": "cycle_time_ms", "segment": "segment_bytes",
           "hier": "hierarchical", "hierarchical": "hierarchical", "oneshot": "oneshot_max_bytes"}
DEFAULT_GRID = ("fusion=0,1MiB,8MiB,64MiB", "cycle=0.5,2,8,32", "segment=256KiB,4MiB")


def parse_grid_entry(text: str) -> tuple[str, list[Any]]:
    """``NAME=V1,V2,...`` -> (knob name, validated values); NAME is a knob or its short alias."""
    from ..knobs import SPECS
    from ..tuning.space import SCALES

    name, sep, values = text.partition("=")
    knob = ALIASES.get(name.strip(), name.strip())
    if not sep or knob not in SCALES:
        raise ValueError(f"expected NAME=V1,V2,... with NAME a searched knob ({', '.join(SCALES)}) or one of "
                         f"fusion, cycle, segment, hier, oneshot, got {text!r}")
    out: list[Any] = []
    for item in (v.strip() for v in values.split(",") if v.strip()):
        value: Any = parse_bool(knob, item) if SPECS[knob].kind is bool else item
        out.append(getattr(Knobs(**{knob: value}), knob))  # validated and normalised (sizes in bytes)
    if not out:
        raise ValueError(f"no values for {name} in {text!r}")
    return knob, list(dict.fromkeys(out))


def parse_grid(entries: list[str] | tuple[str, ...]) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for entry in entries:
        knob, values = parse_grid_entry(entry)
        if knob in grid:
            raise ValueError(f"{knob} is given twice in the grid")
        grid[knob] = values
    return grid


def grid_points(grid: dict[str, list[Any]], base: Knobs) -> list[Knobs]:
    """Every combination of the grid's values on top of ``base`` (the pinned knobs and defaults)."""
    names = list(grid)
    return [base.replace(**dict(zip(names, combo))) for combo in itertools.product(*(grid[n] for n in names))]


def visit_order(points: int, repeats: int, seed: int) -> list[int]:
    """Point indices: ``repeats`` rounds, each a fresh permutation of all points."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(repeats):
        round_ = list(range(points))
        rng.shuffle(round_)
        order += round_
    return order


def grid_space(grid: dict[str, list[Any]], pinned: dict[str, Any], num_nodes: int, device: bool = False,
               uniform_nodes: bool = True) -> Any:
    """The tuner's search space restricted to the grid's knobs, so a replay searches what was measured.
    A grid knob the tuner would not search here (pinned, hierarchical on one node, the device path's
    knobs for a job that is not on GPUs) is refused.  ``device``: the scenario trains on GPUs."""
    from ..tuning.space import SearchSpace, search_space

    full = search_space(pinned, num_nodes, base=Knobs(**pinned), device=device, uniform_nodes=uniform_nodes)
    for name in grid:
        if name not in full.names:
            why = "it is pinned by the scenario" if name in pinned else "the tuner does not search it here"
            if name == "hierarchical" and name not in pinned:
                why += (" (one node: use --ranks-per-node to emulate several)" if num_nodes == 1 else
                        " (nodes of unequal size: it needs as many ranks on every node)")
            if name == "oneshot_max_bytes" and name not in pinned:
                why += " (it is searched for GPU jobs only: a scenario with device = \"cuda\")"
            raise ValueError(f"grid knob {name} cannot be recorded: {why}")
    return SearchSpace(tuple(n for n in full.names if n in grid), full.base)


# ---- rank side --------------------------------------------------------------------------------------
def run_rank(p: dict) -> dict:
    from ..tuning.run import run_with_workload

    return run_with_workload(p, _record)


def _record(p: dict, rt: Any, workload: Any, pinned: dict) -> dict:
    """Visit every grid point ``repeats`` times; rank 0 changes the knobs, every rank runs the same steps."""
    import numpy as np

    from ..tuning.plan import block_steps_for

    comm = rt.sync_comm
    try:
        space = grid_space(p["grid"], pinned, rt.topology.num_nodes, device=p.get("device") == "cuda",
                           uniform_nodes=rt.topology.homogeneous)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    points = grid_points(p["grid"], space.base)
    order = visit_order(len(points), p["repeats"], p.get("seed", 0))
    scores: list[list[float]] = [[] for _ in points]
    steps_s: list[list[list[float]]] = [[] for _ in points]  # every visit's measured step times
    load_before = os.getloadavg()[0]  # other work on the host skews a landscape: keep the evidence
    fastest = math.inf
    for _ in range(p["warmup_steps"]):
        t = time.perf_counter()
        workload.step()
        fastest = min(fastest, time.perf_counter() - t)
    # a visit is as long as a tuning block: at least block_seconds (rank 0's steps decide for every rank)
    visit_steps = comm.bcast(block_steps_for(p["measure_steps"], p.get("block_seconds"), fastest)
                             if comm.rank == 0 else None, root=0)
    t0 = time.perf_counter()
    for n, i in enumerate(order):
        if comm.rank == 0:
            rt.coordinator.set_knobs(points[i])
        for _ in range(p["discard_steps"]):
            workload.step()
        times = []
        for _ in range(visit_steps):
            t = time.perf_counter()
            workload.step()
            times.append(time.perf_counter() - t)
        scores[i].append(float(np.median(workload.samples_per_step / np.asarray(times))))
        steps_s[i].append([float(t) for t in times])
        if comm.rank == 0:
            print(f"[{n + 1:>3}/{len(order)}] {describe(points[i]):<40} {scores[i][-1]:8.2f} samples/s",
                  flush=True)
    from .allreduce import lab_facts

    lab = lab_facts(comm)  # (every rank takes part)
    if comm.rank != 0:
        return {}
    result = _result({**p, "measure_steps": visit_steps}, rt, workload, space, points, scores, order,
                     time.perf_counter() - t0)
    result["hardware"].update(lab)
    result["block_seconds"] = p.get("block_seconds")
    for point, visits in zip(result["points"], steps_s):
        point["steps_s"] = visits
    result["samples_per_step"] = workload.samples_per_step
    result["host_load_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
    return result


def _result(p: dict, rt: Any, workload: Any, space: Any, points: list[Knobs], scores: list[list[float]],
            order: list[int], seconds: float) -> dict:
    from ..hardware import host_info

    topo = rt.topology
    return {
        "space": {"names": list(space.names), "base": space.base.as_dict(), "grid": p["grid"]},
        "points": [{"knobs": k.as_dict(), "scores": s} for k, s in zip(points, scores)],
        "model": workload.name, "workload": p["workload"],
        "framework": p["framework"] if p["workload"] == "train" else "replay",
        "signature": workload.signature, "world_size": topo.size, "nodes": topo.num_nodes,
        "device": p.get("device", "cpu"), "link_gbps": p.get("link_gbps"),  # (the emulated link between nodes)
        "dtype": p.get("replay_dtype", "float32") if p["workload"] == "replay" else None,
        "repeats": p["repeats"], "seed": p.get("seed", 0), "order": order,
        "warmup_steps": p["warmup_steps"], "discard_steps": p["discard_steps"],
        "measure_steps": p["measure_steps"], "seconds": seconds, "hardware": host_info(gpus=p.get("device") == "cuda"),
    }


def describe(knobs: Knobs) -> str:
    """A grid point as this command prints it: exact sizes, ``hier=on`` only where it is on."""
    from ..tuning.run import describe as knobs_line

    return knobs_line(knobs, exact=True)


# ---- command line -----------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench landscape`` under the ``bench`` sub-command parsers."""
    from ..engine.link import add_link_flags

    p = subparsers.add_parser("landscape", help="samples/s of a grid of knob settings in one training run")
    which = p.add_mutually_exclusive_group()
    named_input(which.add_argument("--model", default=None, help="scenario name (scenarios/NAME.toml; default resnet50)"),
                scenario_input, default_scenario_input)
    which.add_argument("--scenario", type=input_file, default=None, help="a scenario file (instead of --model)")
    p.add_argument("--np", type=positive_int, default=None, help="ranks to launch (default: the scenario's)")
    p.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="emulate nodes of K ranks on one host (hierarchical can be in the grid)")
    p.add_argument("--lab", action="store_true",
                   help="run on the hosts of 'tunelab lab up' (or give the scenario a [lab] table)")
    add_link_flags(p)
    add_training_flags(p)
    p.add_argument("--grid", type=_grid_arg, nargs="+", default=None, metavar="NAME=V1,V2",
                   help=f"knob values to combine (default: {' '.join(DEFAULT_GRID)})")
    p.add_argument("--repeats", type=positive_int, default=2, help="visits per grid point (default 2)")
    p.add_argument("--seed", type=seed_type, default=0, help="shuffles the visiting order")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="gradient dtype of a replay scenario (default float32)")
    add_output_flags(p, what="the landscape")
    p.set_defaults(func=_cmd)
    return p


def _grid_arg(text: str) -> str:
    try:
        parse_grid_entry(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cmd(args: argparse.Namespace) -> int:
    from ..cli.lab import scenario_ranks, scenario_session
    from ..launch import inside_mpi_job, run_job
    from ..scenarios import load_scenario

    scenario = load_scenario(chosen_scenario(args))
    scenario = scenario.with_overrides(np=args.np, ranks_per_node=args.ranks_per_node, link_gbps=args.link_gbps,
                                       link_latency_us=args.link_latency_us, device=args.device,
                                       image_size=args.image_size, batch_size=args.batch_size)
    if args.dtype is not None and scenario.workload != "replay":
        raise UsageError(f"--dtype applies to replay scenarios; {scenario.name} trains {scenario.model}")
    try:
        grid = parse_grid(args.grid or DEFAULT_GRID)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    count = len(grid_points(grid, Knobs()))
    params = {**scenario.as_params(), "grid": grid, "repeats": args.repeats, "seed": args.seed,
              "replay_dtype": args.dtype or "float32"}
    with scenario_session(args.lab, scenario) as lab:
        ranks = scenario_ranks(lab, args.np, scenario)
        if not inside_mpi_job():  # (inside the user's mpiexec the ranks are the job's world: they check)
            _check_grid(grid, scenario, lab, ranks)
        print(f"# landscape {scenario.name}: {scenario.model} "
              f"({scenario.framework if scenario.workload == 'train' else 'replay'}) on {ranks} ranks, "
              f"{count} grid points x {args.repeats} visits x {scenario.discard_steps}+{scenario.measure_steps}"
              f" steps or more (a visit lasts at least {scenario.block_seconds:g} s)", flush=True)
        result = run_job("bench-landscape", params, ranks, lab=lab)
    result["scenario"] = scenario.name
    _print_table(result)
    return finish(args, result, "landscape", "bench")


def _check_grid(grid: dict, scenario: Any, lab: Any, ranks: int) -> None:
    """A grid knob the job's ranks would refuse (see :func:`grid_space`), refused before they start:
    the nodes are the lab's hosts, or the emulated nodes, or this one host."""
    if lab is not None:
        nodes, uniform = lab.spec.hosts, True
    elif scenario.ranks_per_node:
        nodes, uniform = -(-ranks // scenario.ranks_per_node), ranks % scenario.ranks_per_node == 0
    else:
        nodes, uniform = 1, True
    try:
        grid_space(grid, scenario.knobs, nodes, device=scenario.device == "cuda", uniform_nodes=uniform)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _print_table(result: dict) -> None:
    import numpy as np

    from .common import format_table

    rows = [{"knobs": describe(Knobs(**pt["knobs"])), "mean": float(np.mean(pt["scores"])),
             "min": min(pt["scores"]), "max": max(pt["scores"])} for pt in result["points"]]
    best = max(r["mean"] for r in rows)
    for r in rows:
        r["vs_best"] = r["mean"] / best
    rows.sort(key=lambda r: -r["mean"])
    print(f"# {len(rows)} points, {result['repeats']} visits each, {result['seconds']:.0f} s")
    print(format_table(rows, [("knobs", "knobs", ""), ("mean", "samples/s", ".2f"), ("min", "min", ".2f"),
                              ("max", "max", ".2f"), ("vs_best", "vs_best", ".3f")]))
