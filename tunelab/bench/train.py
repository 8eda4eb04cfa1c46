"""``tunelab bench train``: training throughput of tunelab next to the framework's own data-parallel
path (torch DDP, TensorFlow's MultiWorkerMirroredStrategy), measured in the same run (rank side).

``no-comm`` is the physical bound: every rank trains the same model on its own, with no
communication at all, at the same time as its peers (so ranks that share cores or a GPU contend as
they do in the real job).  With ``--device cuda`` each rank trains on its GPU (local rank modulo the
visible GPUs); DDP runs over NCCL when every rank has a GPU of its own and over gloo when ranks
share one (NCCL refuses two ranks on one GPU).

Systems alternate in rounds so drift on a shared machine hits all alike, and the order rotates
from round to round (A B C, B C A, C A B, ...) so no system always follows the same one; each system is started and shut down inside its phase, so neither has threads
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

from .. import runtime

SYSTEMS = {"torch": ("tunelab-tuned", "tunelab", "no-comm", "ddp"),
           "tensorflow": ("tunelab-tuned", "tunelab", "no-comm", "mwms")}


def run_rank(p: dict) -> dict:
    if p["framework"] == "tensorflow":
        return _tf_bench(p)
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
    """(slowest rank's wall time for ``steps`` steps, the slowest rank's time of each step): the two
    columns a row shows are measured over the same ranks (where ranks do not synchronise, as without
    communication, a slower rank sets samples/s and must set the step time too)."""
    from mpi4py import MPI

    for _ in range(warmup):
        step()
    comm.Barrier()
    t0 = time.perf_counter()
    mine = np.empty(steps)
    for i in range(steps):
        s = time.perf_counter()
        step()
        mine[i] = time.perf_counter() - s
    total = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    return total, slowest.tolist()


def _weights_identical(comm: Any, model: Any) -> bool:
    """Trainable parameters bitwise equal on every rank (BatchNorm running statistics are local
    to each rank in both systems, so buffers are not compared)."""
    import torch

    h = hashlib.sha256()
    for t in model.parameters():
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    digests = comm.allgather(h.hexdigest())
    return len(set(digests)) == 1


def _torch_bench(p: dict) -> dict:
    import torch
    from mpi4py import MPI

    from ..workloads.torch_device import gpu_slot, ranks_share_a_gpu, torch_device
    from ..workloads.torch_models import build, synthetic_batch

    comm = MPI.COMM_WORLD
    torch.set_num_threads(_threads_per_rank(comm))
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = torch_device(p.get("device", "cpu"), gpu_slot(comm.rank, local.rank))
    local.Free()
    x, y = synthetic_batch(p["model"], p["batch_size"], p["image_size"], seed=1 + comm.rank)
    x, y = x.to(device), y.to(device)
    p = {**p, "ddp_backend": "gloo" if device.type == "cpu" or ranks_share_a_gpu(comm, device) else "nccl"}
    systems = list(p["systems"])
    notes = [f"ddp: torch DistributedDataParallel over {p['ddp_backend']}"] if "ddp" in systems else []
    if "tunelab-tuned" in systems and not _has_profile(comm, p, build, device):
        systems.remove("tunelab-tuned")
        notes.append("tunelab-tuned: skipped, no tuned profile stored for this hardware/model/world size "
                     "(run tunelab tune first)")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    knobs: dict[str, dict] = {}
    for r in range(p["rounds"]):
        for system in rotated(systems, r):
            torch.manual_seed(0)
            model = build(p["model"]).to(device)
            if system == "ddp":
                total, per_step, identical = _ddp_phase(comm, model, x, y, p)
            elif system == "no-comm":
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                total, per_step = _timed(comm, _train_step(model, opt, x, y), p["steps"], p["warmup"])
                identical = True  # nothing is shared: each rank trains on its own data
            else:
                total, per_step, identical = _tunelab_phase(comm, model, x, y, p, tuned=system == "tunelab-tuned",
                                                            seen=knobs.setdefault(system, {}))
            runs[system].append(_round_result(p, comm.size, total, per_step, identical))
    return {"rows": _rows(runs), "notes": notes + _knob_notes(knobs, p), "knobs": knobs,
            "hardware": _hardware(comm, gpus=device.type == "cuda"), "model": p["model"], "framework": "torch",
            "world_size": comm.size, "device": str(device.type),
            "batch_size": p["batch_size"], "image_size": p["image_size"], "steps": p["steps"],
            "threads_per_rank": torch.get_num_threads()}


def _knobs_ran(seen: dict | None) -> None:
    """Record the knobs the engine ran with (a tuned phase: after its profile was loaded)."""
    if seen is not None:
        seen.update(runtime.current().engine.knobs.as_dict())


def _said_once(seen: dict | None) -> Any:
    """Silence what a tunelab phase prints (the loaded profile's line on rank 0) once an earlier round of
    the same system has run and said it (``seen`` holds the knobs it ran)."""
    import contextlib
    import io

    return contextlib.redirect_stdout(io.StringIO()) if seen else contextlib.nullcontext()


def _knob_notes(knobs: dict[str, dict], p: dict) -> list[str]:
    """What a reader needs to read the table: the tuned knobs, or that they are the defaults' own; and
    that one round gives no spread."""
    notes = []
    tuned, plain = knobs.get("tunelab-tuned"), knobs.get("tunelab")
    if tuned:
        from ..knobs import Knobs
        from ..tuning.run import describe

        notes.append(f"tunelab-tuned ran {describe(Knobs(**tuned), exact=True)}"
                     + (": the same knobs as tunelab (no stored tuning changed them)" if tuned == plain else ""))
    if p["rounds"] == 1:
        notes.append("one round: min and max are that round's; give --rounds 3 or more to see the spread")
    return notes


def _hardware(comm: Any, gpus: bool = False) -> dict:
    """Where it ran, as bench allreduce records it: the host's facts (``gpus``: its GPUs' too, for a run
    that trained on them), the ranks and, on a lab's hosts, the lab (collective: every rank calls it)."""
    from ..hardware import host_info
    from .allreduce import lab_facts

    return {**host_info(gpus=gpus), "world_size": comm.size, **lab_facts(comm)}


def rotated(systems: list[str], round_index: int) -> list[str]:
    """The systems' order in round ``round_index``: a balanced Latin square (Williams'), so that whatever
    one system leaves behind (warm caches, a baseline's lingering threads) does not always land on the
    same next system, nor one system always run first.  Over n rounds of n systems (2n where n is odd:
    the square, then its mirror) each system runs in every position, and right after every other one,
    equally often; from the first round on, no pair follows in the same order twice before it must.
    (Rotating the order by one a round kept every system's predecessor: with 4 systems and the default
    2 rounds, one never ran first and each followed the same system both times.)"""
    n = len(systems)
    if n == 0:
        return []
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    r = round_index % (n if n % 2 == 0 else 2 * n)
    order = [systems[(b + r) % n] for b in base]
    return order[::-1] if r >= n else order


def _round_result(p: dict, world: int, total: float, per_step: list[float], identical: bool) -> dict:
    """One phase's measurement: samples/s over all ranks from the slowest rank's wall time."""
    return {"samples_per_s": p["steps"] * p["batch_size"] * world / total,
            "step_ms_median": float(np.median(per_step)) * 1e3, "weights_identical": identical}


def _rows(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per system: the median round (rounds alternate systems, so drift hits all alike)."""
    rows = []
    for system, rounds in runs.items():
        sps = [r["samples_per_s"] for r in rounds]
        rows.append({"system": system, "samples_per_s": float(np.median(sps)), "samples_per_s_min": min(sps),
                     "samples_per_s_max": max(sps), "step_ms": float(np.median([r["step_ms_median"] for r in rounds])),
                     "rounds": len(rounds), "weights_identical": all(r["weights_identical"] for r in rounds)})
    return rows


def _train_step(model: Any, opt: Any, x: Any, y: Any) -> Callable[[], None]:
    """One training step, finished on the device before it returns (so its wall time is its time)."""
    import torch

    from ..workloads.torch_device import finish

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        finish(x.device)

    return step


def _has_profile(comm: Any, p: dict, build: Any, device: Any) -> bool:
    """Whether the profile store holds a tuned config for this hardware, model and world size, asked
    with the signature of the model on ``device``, where the tuned phase trains it (a model's
    signature says whether its parameters live on a GPU)."""
    import tunelab.torch as tl

    tl.init(comm, retune=False, ranks_per_node=p.get("ranks_per_node"))
    with runtime.closing():
        model = build(p["model"]).to(device)
        return runtime.current().has_profile(tl.model_signature(model), "torch",
                                             legacy=tl.optimizer.ordered_model_signature(model))


def _tunelab_phase(comm: Any, model: Any, x: Any, y: Any, p: dict, tuned: bool,
                   seen: dict | None = None) -> tuple[float, list[float], bool]:
    import torch

    import tunelab.torch as tl

    tl.init(comm, retune=False, ranks_per_node=p.get("ranks_per_node"), **p.get("knobs", {}))
    with runtime.closing():
        tl.broadcast_parameters(model.state_dict(), root_rank=0)
        with _said_once(seen):  # (the profile's line, once per run rather than once per round)
            opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                          named_parameters=model.named_parameters(), load_profile=tuned,
                                          model_name=p["model"])
        total, per_step = _timed(comm, _train_step(model, opt, x, y), p["steps"], p["warmup"])
        _knobs_ran(seen)
        return total, per_step, _weights_identical(comm, model)


def _ddp_phase(comm: Any, model: Any, x: Any, y: Any, p: dict) -> tuple[float, list[float], bool]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from .baselines import GlooGroup

    group = GlooGroup(comm, p.get("ddp_backend", "gloo"))
    try:
        devices = [x.device] if x.device.type == "cuda" else None
        # default 25 MiB buckets; broadcasts rank 0's weights once; no buffer broadcast every step (torch's
        # default): BatchNorm statistics stay local to each rank, as tunelab's (and Horovod's) do
        import inspect

        # (torch 2.13 renamed it, with a warning on every run; the new name still syncs once at init,
        # which changes nothing here: every rank builds the same model)
        quiet = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
        ddp = DistributedDataParallel(model, device_ids=devices,
                                      **({"forward_sync_buffers": False} if quiet else {"broadcast_buffers": False}))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        total, per_step = _timed(comm, _train_step(ddp, opt, x, y), p["steps"], p["warmup"])
        return total, per_step, _weights_identical(comm, model)
    finally:
        group.close()


# ---- TensorFlow: tunelab vs MultiWorkerMirroredStrategy ---------------------------------------------
def _tf_bench(p: dict) -> dict:
    """TensorFlow rounds.  MultiWorkerMirroredStrategy configures TensorFlow's collectives at runtime
    startup, so it is created first, before any other TensorFlow op, and kept for every round; the
    tunelab phases run in the same process outside its scope (its gRPC server idles meanwhile)."""
    from mpi4py import MPI

    from ..workloads.keras_models import configure_runtime, import_tensorflow, synthetic_batch

    tf = import_tensorflow()  # without its C++ start-up lines, which would bury the table
    comm = MPI.COMM_WORLD
    configure_runtime(_threads_per_rank(comm))
    systems, notes = list(p["systems"]), []
    strategy = _mwms_strategy(comm, systems, notes) if "mwms" in systems else None
    x, y = synthetic_batch(p["model"], p["batch_size"], p["image_size"], seed=1 + comm.rank)
    x, y = tf.constant(x), tf.constant(y)
    if "tunelab-tuned" in systems and not _tf_has_profile(comm, p):
        systems.remove("tunelab-tuned")
        notes.append("tunelab-tuned: skipped, no tuned profile stored for this hardware/model/world size "
                     "(run tunelab tune --framework tensorflow first)")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    knobs: dict[str, dict] = {}
    for r in range(p["rounds"]):
        for system in rotated(systems, r):
            if system == "mwms":
                total, per_step, identical = _mwms_phase(comm, strategy, x, y, p)
            elif system == "no-comm":
                total, per_step = _tf_alone_phase(comm, x, y, p)
                identical = True  # nothing is shared: each rank trains on its own data
            else:
                total, per_step, identical = _tf_tunelab_phase(comm, x, y, p, tuned=system == "tunelab-tuned",
                                                               seen=knobs.setdefault(system, {}))
            runs[system].append(_round_result(p, comm.size, total, per_step, identical))
    return {"rows": _rows(runs), "notes": notes + _knob_notes(knobs, p), "knobs": knobs, "hardware": _hardware(comm),
            "model": p["model"], "framework": "tensorflow",
            "world_size": comm.size, "batch_size": p["batch_size"], "image_size": p["image_size"],
            "steps": p["steps"], "threads_per_rank": tf.config.threading.get_intra_op_parallelism_threads()}


def _mwms_strategy(comm: Any, systems: list[str], notes: list[str]) -> Any:
    """MultiWorkerMirroredStrategy with one worker per rank.  On one host the workers listen on
    127.0.0.1; across hosts (a lab, or real hosts) each listens on the address its hostname resolves
    to, so its traffic takes the same links as every other system's.  A hostname that does not
    resolve skips the system, with a note."""
    import json
    import socket

    import tensorflow as tf
    from mpi4py import MPI

    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = comm.allreduce(host.size, op=MPI.MIN) == comm.size
    host.Free()
    try:
        addr = "127.0.0.1" if one_host else socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = None
    if not comm.allreduce(addr is not None, op=MPI.LAND):
        systems.remove("mwms")
        notes.append("mwms: skipped, a rank's hostname does not resolve to an address its peers can reach")
        return None
    with socket.socket() as sock:  # this rank's port, picked on its own address
        sock.bind((addr, 0))
        port = sock.getsockname()[1]
    workers = comm.allgather(f"{addr}:{port}")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                          "task": {"type": "worker", "index": comm.rank}})
    return tf.distribute.MultiWorkerMirroredStrategy()


def _keras_model(p: dict) -> tuple[Any, Any]:
    """The benchmark model (same initial weights on every rank) and its SGD, built on its variables."""
    import keras

    from ..workloads.keras_models import build

    keras.utils.set_random_seed(0)
    model = build(p["model"], image_size=p["image_size"])
    opt = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    opt.build(model.trainable_variables)  # optimizer variables exist before the step is traced
    return model, opt


def _tf_weights_identical(comm: Any, model: Any) -> bool:
    h = hashlib.sha256()
    for v in model.trainable_variables:
        h.update(np.ascontiguousarray(v.numpy()).tobytes())
    return len(set(comm.allgather(h.hexdigest()))) == 1


def _tf_has_profile(comm: Any, p: dict) -> bool:
    """Whether the store holds a tuned TensorFlow config for this hardware, model and world size."""
    import tunelab.tensorflow as tl

    tl.init(comm, retune=False, ranks_per_node=p.get("ranks_per_node"))
    with runtime.closing():
        return runtime.current().has_profile(tl.model_signature(_keras_model(p)[0]), "tensorflow")


def _tf_tunelab_phase(comm: Any, x: Any, y: Any, p: dict, tuned: bool,
                      seen: dict | None = None) -> tuple[float, list[float], bool]:
    """tunelab's DistributedGradientTape in a ``tf.function``; a tuned run loads the profile while the
    step is traced (in warm-up)."""
    import keras
    import tensorflow as tf

    import tunelab.tensorflow as tl

    tl.init(comm, retune=False, ranks_per_node=p.get("ranks_per_node"), **p.get("knobs", {}))
    with runtime.closing():
        model, opt = _keras_model(p)
        tl.broadcast_variables(model.weights, root_rank=0)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function(jit_compile=False)
        def step() -> None:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = tl.DistributedGradientTape(tape, load_profile=tuned, model_name=p["model"])
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        with _said_once(seen):  # (the profile is looked up while the step is traced, in warm-up)
            total, per_step = _timed(comm, step, p["steps"], p["warmup"])
        _knobs_ran(seen)
        return total, per_step, _tf_weights_identical(comm, model)


def _tf_alone_phase(comm: Any, x: Any, y: Any, p: dict) -> tuple[float, list[float]]:
    """The bound: the same model, optimizer and step in a ``tf.function``, each rank on its own (no
    tape wrapper, no communication), all ranks at once."""
    import keras
    import tensorflow as tf

    model, opt = _keras_model(p)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return _timed(comm, step, p["steps"], p["warmup"])


def _mwms_phase(comm: Any, strategy: Any, x: Any, y: Any, p: dict) -> tuple[float, list[float], bool]:
    """The same model, optimizer and per-rank batch under MultiWorkerMirroredStrategy: per-example
    losses scaled by the global batch and summed over workers, i.e. the same averaged gradient."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model, opt = _keras_model(p)  # the strategy broadcasts worker 0's initial values
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    global_batch = p["batch_size"] * comm.size

    def replica_step(xb: Any, yb: Any) -> None:
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function(jit_compile=False)
    def step() -> None:
        strategy.run(replica_step, args=(x, y))

    total, per_step = _timed(comm, step, p["steps"], p["warmup"])
    return total, per_step, _tf_weights_identical(comm, model)
