"""Gradient-replay cases for mpi_cases.py (``case_replay_*``): no framework, the engine's coordinator only."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI
from mpi_cases import bit_mismatches, reference

from tunelab import runtime
from tunelab.workloads.replay import GradientReplay, make_gradients


def _wrong_tensors(replay: GradientReplay, everyone: list[list[np.ndarray]]) -> list[str]:
    """Names whose reduced result differs (bitwise) from numpy's average of every rank's input."""
    return [name for i, name in enumerate(replay.names)
            if bit_mismatches(replay.outputs[i], reference([grads[i] for grads in everyone], "average"))]


def _timed_steps(comm: MPI.Comm, replay: GradientReplay, steps: int) -> list[float]:
    coordinator = runtime.current().coordinator
    times = []
    for _ in range(steps):
        comm.Barrier()  # every rank starts together, as data-parallel steps do
        t0 = time.perf_counter()
        replay.step(coordinator)
        times.append((time.perf_counter() - t0) * 1000.0)
    return times


def case_replay_steps(comm: MPI.Comm, model: str = "resnet50", forward_ms: float = 100.0,
                      backward_ms: float = 250.0, steps: int = 4, seed: int = 11) -> dict:
    """A few replayed steps with proportional timing, then one with a measured-style profile (a
    shuffled submission order); every result is checked against numpy, every step timed."""
    runtime.init(comm)
    replay = GradientReplay(model, forward_ms, backward_ms, seed=seed + comm.rank)
    everyone = [make_gradients(model, seed=seed + r) for r in range(comm.size)]
    step_ms = _timed_steps(comm, replay, steps)
    wrong = _wrong_tensors(replay, everyone)

    n = len(replay.names)
    offsets = np.random.default_rng(seed).permutation(n).astype(float) * (backward_ms / n)  # same everywhere
    profiled = GradientReplay(model, forward_ms, backward_ms, seed=seed + comm.rank,
                              ready_offsets_ms=offsets.tolist())
    profiled_ms = _timed_steps(comm, profiled, 1)
    profiled_wrong = _wrong_tensors(profiled, everyone)
    runtime.shutdown()
    return {"step_ms": step_ms, "wrong": wrong[:10], "tensors": n, "nbytes": replay.nbytes,
            "profiled_ms": profiled_ms, "profiled_wrong": profiled_wrong[:10],
            "profiled_first": profiled.names[profiled.order[0]],
            "units_per_ms": replay.compute.units_per_ms}


def case_replay_build_fails(comm: MPI.Comm) -> dict:
    """``tune``'s rank side (run_with_workload) when the workload cannot be built on the last rank only
    (no GPU for it, out of memory): every rank must raise at once, that rank its own error and the
    others one naming it, instead of the others waiting in the run's first collective while the failed
    rank waits for them in the runtime's shutdown.  Then a run that builds everywhere works."""
    from tunelab.scenarios import load_scenario
    from tunelab.tuning import run
    from tunelab.workloads import replay

    p = load_scenario("replay-resnet50").as_params()
    real = replay.GradientReplay

    def failing(*args, **kwargs):
        if comm.rank == comm.size - 1:
            raise MemoryError("out of memory building the model (injected)")
        return real(*args, **kwargs)

    def body(p, rt, workload, pinned):
        return {"gathered": rt.sync_comm.allgather(comm.rank)}  # the run's first collective

    out = {}
    for name, cls in (("fails", failing), ("works", real)):
        replay.GradientReplay = cls
        t0 = time.monotonic()
        try:
            out[name] = run.run_with_workload(p, body)
        except Exception as exc:  # noqa: BLE001 (what each rank was told is the result)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out[name]["seconds"] = time.monotonic() - t0
    return out
