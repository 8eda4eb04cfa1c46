"""``tunelab bench allreduce``: nccl-tests-style allreduce benchmark (rank side).

For every size and algorithm: warm-up, then timed iterations that start together
after a barrier; the reported time is the median over iterations of the slowest
rank.  Inputs are exact-sum integers, outputs are poisoned first and compared
bit for bit with a numpy reference: ``wrong`` counts mismatched elements.
"""

from __future__ import annotations

import numpy as np

from ..config import load_engine_config
from ..dtypes import dtype_from_name
from ..hardware import host_info
from .baselines import MPI_UNSUPPORTED, GlooGroup, torch_available
from .common import count_wrong, exact_input, exact_sum, timed_iterations

ALGORITHMS = ("ring", "hierarchical", "mpi", "gloo")


def run_rank(p: dict) -> dict:
    from mpi4py import MPI

    from ..engine.engine import Engine

    comm = MPI.COMM_WORLD
    dtype = dtype_from_name(p["dtype"])
    algorithms = list(p["algorithms"])
    notes: list[str] = []
    engines: dict[str, Engine] = {}
    for algo in ("ring", "hierarchical"):
        if algo in algorithms:
            cfg = load_engine_config(ranks_per_node=p.get("ranks_per_node"), link_gbps=p.get("link_gbps"),
                                     link_latency_us=p.get("link_latency_us"),
                                     **{**p.get("knobs", {}), "hierarchical": algo == "hierarchical"})
            engines[algo] = Engine(comm, cfg)
    if "mpi" in algorithms and dtype.name in MPI_UNSUPPORTED:
        algorithms.remove("mpi")
        notes.append(f"mpi: skipped, MPI has no standard {dtype.name} sum")
    if p.get("link_gbps") is not None and ({"mpi", "gloo"} & set(algorithms)):
        notes.append("mpi and gloo run outside the engine: the emulated link does not slow them")
    gloo = None
    if "gloo" in algorithms:
        if torch_available():
            gloo = GlooGroup(comm)
        else:
            algorithms.remove("gloo")
            notes.append("gloo: skipped, torch is not installed (pip install 'tunelab[torch]')")
    rows = []
    for size in p["sizes"]:
        count = max(1, size // dtype.itemsize)
        src = exact_input(count, comm.rank, comm.size, dtype)
        expected = exact_sum(count, comm.size, dtype)
        for algo in algorithms:
            out = np.empty_like(src)
            out.view(np.uint8).fill(0xFF)
            reset = None
            if algo in engines:
                def op(e=engines[algo], src=src, out=out) -> None:
                    e.allreduce(src, out=out)
            elif algo == "mpi":
                def op(src=src, out=out) -> None:
                    comm.Allreduce(src, out, op=MPI.SUM)
            else:
                def reset(src=src, out=out) -> None:
                    np.copyto(out, src)

                def op(out=out) -> None:
                    gloo.allreduce_(out)
            times = timed_iterations(comm, op, p["iters"], p["warmup"], reset)
            wrong = comm.allreduce(count_wrong(out, expected), op=MPI.SUM)
            rows.append(_row(algo, count, dtype, times, wrong, comm.size))
    topo = next(iter(engines.values())).topology if engines else None
    hardware = {**host_info(), "world_size": comm.size,
                "nodes": topo.num_nodes if topo else None,
                "ranks_per_node": list(topo.node_sizes) if topo else None}
    for e in engines.values():
        e.close()
    if gloo is not None:
        gloo.close()
    return {"rows": rows, "hardware": hardware, "notes": notes}


def _row(algo: str, count: int, dtype: np.dtype, times: np.ndarray, wrong: int, world: int) -> dict:
    nbytes = count * dtype.itemsize
    t = float(np.median(times))
    algbw = nbytes / t / 1e9
    return {"algorithm": algo, "size": nbytes, "count": count, "dtype": dtype.name,
            "time_us": t * 1e6, "time_us_p10": float(np.percentile(times, 10)) * 1e6,
            "time_us_p90": float(np.percentile(times, 90)) * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world,
            "wrong": int(wrong), "iters": int(times.size)}


def add_ratios(rows: list[dict], baseline: str = "mpi") -> None:
    """Add ``busbw_vs_<baseline>`` to every row whose size has a baseline row."""
    base = {r["size"]: r["busbw_gbps"] for r in rows if r["algorithm"] == baseline}
    for r in rows:
        b = base.get(r["size"])
        r[f"busbw_vs_{baseline}"] = (r["busbw_gbps"] / b) if b else None
