"""``tunelab bench fusion``: a model's real gradient set reduced three ways (rank side).

* ``per-tensor``: one allreduce per gradient tensor;
* ``fused``: all tensors in one batch, packed into fusion buffers at the threshold;
* ``contiguous``: one allreduce of a single array holding the same bytes;
* ``bound``: every rank copying that array into its output, with the engine's kernel threads (the
  memory system's limit, as in ``bench allreduce``).

The four take turns (:func:`.common.interleaved_iterations`), their outputs poisoned before every
timed iteration and compared bit for bit after it.
"""

from __future__ import annotations

import math

import numpy as np

from ..config import load_engine_config
from ..workloads.shapes import gradient_shapes
from .common import bound_copy, count_wrong, exact_input, exact_sum, interleaved_iterations

MODES = ("per-tensor", "fused", "contiguous", "bound")


def run_rank(p: dict) -> dict:
    from mpi4py import MPI

    from ..engine.engine import Engine

    comm = MPI.COMM_WORLD
    engine = Engine(comm, load_engine_config(ranks_per_node=p.get("ranks_per_node"), **p.get("knobs", {})))
    f32 = np.dtype(np.float32)
    shapes = gradient_shapes(p["model"])
    grads = [exact_input(math.prod(s), comm.rank, comm.size, f32, salt=i).reshape(s)
             for i, s in enumerate(shapes)]
    expected = [exact_sum(math.prod(s), comm.size, f32, salt=i).reshape(s) for i, s in enumerate(shapes)]
    flat = np.concatenate([g.reshape(-1) for g in grads])
    outs = [np.empty_like(g) for g in grads]
    flat_out = np.empty_like(flat)

    def per_tensor() -> None:
        for g, o in zip(grads, outs):
            engine.allreduce(g, out=o)

    def fused() -> None:
        engine.allreduce_batch(grads, outs=outs)

    def contiguous() -> None:
        engine.allreduce(flat, out=flat_out)

    bound = bound_copy(flat, flat_out, engine)
    flat_expected = np.concatenate([e.reshape(-1) for e in expected])
    wrong = [0] * len(MODES)

    def poison(i: int) -> None:  # before each timed iteration: a mode that writes nothing is caught
        for o in (*outs, flat_out):
            o.view(np.uint8).fill(0xFF)

    def check(i: int) -> None:  # after it: that iteration's results, bit for bit
        mode = MODES[i]
        bad = (count_wrong(flat_out, flat_expected) if mode == "contiguous"
               else count_wrong(flat_out, flat) if mode == "bound"  # (a copy: its input, bit for bit)
               else sum(count_wrong(o, e) for o, e in zip(outs, expected)))
        wrong[i] = max(wrong[i], bad)

    # the modes take turns (a slow stretch of a shared host falls on all of them alike)
    all_times = interleaved_iterations(comm, [(per_tensor, None), (fused, None), (contiguous, None), (bound, None)],
                                       p["iters"], p["warmup"], before=poison, after=check)
    rows = []
    for i, (mode, times) in enumerate(zip(MODES, all_times)):
        rows.append({"mode": mode, "tensors": len(grads) if i < 2 else 1,
                     "bytes": int(flat.nbytes), "time_us": float(np.median(times)) * 1e6,
                     "time_us_p10": float(np.percentile(times, 10)) * 1e6,
                     "time_us_p90": float(np.percentile(times, 90)) * 1e6,
                     "wrong": int(comm.allreduce(wrong[i], op=MPI.SUM))})
    knobs = engine.knobs.as_dict()
    topo_nodes = engine.topology.num_nodes
    engine.close()
    contig = rows[MODES.index("contiguous")]["time_us"]
    copy = rows[MODES.index("bound")]["time_us"]
    per = rows[0]["time_us"]
    for r in rows:
        r["vs_contiguous"] = r["time_us"] / contig
        r["speedup_vs_per_tensor"] = per / r["time_us"]
        r["vs_bound"] = r["time_us"] / copy
    from ..hardware import host_info
    from .allreduce import lab_facts

    hardware = {**host_info(), "world_size": comm.size, "nodes": topo_nodes, **lab_facts(comm)}
    return {"rows": rows, "model": p["model"], "world_size": comm.size, "knobs": knobs, "hardware": hardware}
