"""What ``bench allreduce --device cuda`` times (tunelab/bench/allreduce.py::_operation), with stand-ins for
the device tools and the engine: no GPU needed.  The engine's device calls return once their kernels
are queued, so a timed call must end with a wait for them, as the bound row's copy does."""

from __future__ import annotations

import numpy as np

from tunelab.bench.allreduce import _operation


def _buffers(tools: tuple, count: int = 4) -> tuple:
    """(src, out, device): the input, the host output the size's algorithms share, and their device copies."""
    src, out = np.ones(count, np.float32), np.empty(count, np.float32)
    return src, out, (tools[0](src), tools[0](out))


def _tools(log: list[str]) -> tuple:
    return (lambda a: a.copy(), lambda a: np.asarray(a), lambda d, h: None,
            lambda dst, src: log.append("copy and wait"), lambda: log.append("wait"))


def test_an_engine_call_on_the_device_is_timed_until_its_result_is_there() -> None:
    log: list[str] = []

    class Engine:
        def allreduce(self, src, out=None):
            log.append("queued")

    op, reset, _ = _operation("ring", None, *_buffers(_tools(log)), {"ring": Engine()}, None, _tools(log))
    op()
    assert log == ["queued", "wait"] and reset is None


def test_the_bound_row_is_one_copy_that_waits_for_itself() -> None:
    log: list[str] = []
    op, _, _ = _operation("bound", None, *_buffers(_tools(log)), {}, None, _tools(log))
    op()
    assert log == ["copy and wait"]


def test_on_a_shared_gpu_the_bound_is_one_launch_copying_every_ranks_bytes() -> None:
    """Ranks sharing one GPU share its memory system: the bound is the node's first rank copying all
    of their bytes in one launch (N processes copying at once would add the GPU's switching between
    them, which the engine's shared-GPU path does not pay); the others time nothing."""
    log: list[str] = []
    copies: list[int] = []
    tools = (lambda a: a.copy(), lambda a: np.asarray(a), lambda d, h: None,
             lambda dst, src: copies.append(src.size), lambda: log.append("wait"))
    op, _, _ = _operation("bound", None, *_buffers(tools), {}, None, tools, sharing=3, leader=True)
    op()
    assert copies == [12]
    op, _, _ = _operation("bound", None, *_buffers(tools), {}, None, tools, sharing=3, leader=False)
    op()
    assert copies == [12] and log == []


def test_the_mpi_row_on_the_device_ends_when_its_result_is_back_in_device_memory() -> None:
    log: list[str] = []
    tools = (lambda a: a.copy(), lambda a: np.asarray(a), lambda d, h: log.append("upload queued"),
             lambda dst, src: None, lambda: log.append("wait"))

    class Comm:
        def Allreduce(self, src, out, op=None):
            log.append("allreduce")

    op, _, _ = _operation("mpi", Comm(), *_buffers(tools), {}, None, tools)
    op()
    assert log == ["allreduce", "upload queued", "wait"]


def test_each_rank_puts_its_buffers_on_its_own_gpu(monkeypatch) -> None:
    """On a machine of several GPUs each rank takes its place among the machine's ranks modulo their
    count (every rank used the current device, GPU 0, before): local rank 3 of 2 GPUs takes GPU 1."""
    from numba import cuda

    from tunelab.bench import allreduce

    class Local:
        rank = 3

        def Free(self) -> None:
            pass

    class Comm:
        rank = 7

        def Split_type(self, kind):
            return Local()

    chosen: list[int] = []
    monkeypatch.setattr(allreduce, "load_engine_config", lambda: type("C", (), {"backend": "numba-cuda"})())
    monkeypatch.setattr(cuda, "gpus", [0, 1], raising=False)
    monkeypatch.setattr(cuda, "select_device", chosen.append, raising=False)
    allreduce._device_tools(Comm())
    assert chosen == [1]
