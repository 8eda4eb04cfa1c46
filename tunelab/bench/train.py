"""``tunelab bench train``: training throughput of tunelab next to the framework's own data-parallel
path (torch DDP with gloo), measured in the same run (rank side).

Systems alternate in rounds (tunelab, ddp, tunelab, ddp, ...) so drift on a shared machine hits
both alike; each system is started and shut down inside its phase, so neither has threads
running while the other is measured.  Every round starts from the same initial weights and data;
after each phase the ranks check that their weights are identical.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SYSTEMS = {"torch": ("tunelab", "ddp")}


def run_rank(p: dict) -> dict:
    if p["framework"] != "torch":
        raise ValueError(f"framework {p['framework']!r} is not supported by bench train yet")
    return _torch_bench(p)


def _threads_per_rank(comm: Any) -> int:
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = host.size
    host.Free()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // ranks_here)


def _timed(comm: Any, step: Callable[[], None], steps: int, warmup: int) -> tuple[float, list[float]]:
    """(slowest rank's wall time for ``steps`` steps, this rank's per-step times)."""
    from mpi4py import MPI

    for _ in range(warmup):
        step()
    comm.Barrier()
    t0 = time.perf_counter()
    per_step = []
    for _ in range(steps):
        s = time.perf_counter()
        step()
        per_step.append(time.perf_counter() - s)
    total = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return total, per_step


def _weights_identical(comm: Any, model: Any) -> bool:
    """Trainable parameters bitwise equal on every rank (BatchNorm running statistics are local
    to each rank in both systems, so buffers are not compared)."""
    import torch

    h = hashlib.sha256()
    for t in model.parameters():
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digests = comm.allgather(h.hexdigest())
    return len(set(digests)) == 1


def _torch_bench(p: dict) -> dict:
    import torch
    from mpi4py import MPI

    from ..workloads.torch_models import build, synthetic_batch

    comm = MPI.COMM_WORLD
    torch.set_num_threads(_threads_per_rank(comm))
    x, y = synthetic_batch(p["model"], p["batch_size"], p["image_size"], seed=1 + comm.rank)
    runs: dict[str, list[dict]] = {s: [] for s in p["systems"]}
    for _ in range(p["rounds"]):
        for system in p["systems"]:
            torch.manual_seed(0)
            model = build(p["model"])
            phase = _tunelab_phase if system == "tunelab" else _ddp_phase
            total, per_step, identical = phase(comm, model, x, y, p)
            runs[system].append({"samples_per_s": p["steps"] * p["batch_size"] * comm.size / total,
                                 "step_ms_median": float(np.median(per_step)) * 1e3,
                                 "weights_identical": identical})
    rows = []
    for system, rounds in runs.items():
        sps = [r["samples_per_s"] for r in rounds]
        rows.append({"system": system, "samples_per_s": float(np.median(sps)), "samples_per_s_min": min(sps),
                     "samples_per_s_max": max(sps), "step_ms": float(np.median([r["step_ms_median"] for r in rounds])),
                     "rounds": len(rounds), "weights_identical": all(r["weights_identical"] for r in rounds)})
    return {"rows": rows, "model": p["model"], "framework": "torch", "world_size": comm.size,
            "batch_size": p["batch_size"], "image_size": p["image_size"], "steps": p["steps"],
            "threads_per_rank": torch.get_num_threads()}


def _train_step(model: Any, opt: Any, x: Any, y: Any) -> Callable[[], None]:
    import torch

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _tunelab_phase(comm: Any, model: Any, x: Any, y: Any, p: dict) -> tuple[float, list[float], bool]:
    import torch

    import tunelab.torch as tl

    tl.init(comm, ranks_per_node=p.get("ranks_per_node"), **p.get("knobs", {}))
    try:
        tl.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                      named_parameters=model.named_parameters())
        total, per_step = _timed(comm, _train_step(model, opt, x, y), p["steps"], p["warmup"])
        return total, per_step, _weights_identical(comm, model)
    finally:
        tl.shutdown()


def _ddp_phase(comm: Any, model: Any, x: Any, y: Any, p: dict) -> tuple[float, list[float], bool]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from .baselines import GlooGroup

    group = GlooGroup(comm)
    try:
        ddp = DistributedDataParallel(model)  # default buckets (25 MiB), broadcasts rank 0's weights
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        total, per_step = _timed(comm, _train_step(ddp, opt, x, y), p["steps"], p["warmup"])
        return total, per_step, _weights_identical(comm, model)
    finally:
        group.close()
