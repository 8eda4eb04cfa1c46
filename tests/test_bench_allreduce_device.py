"""What ``bench allreduce --device cuda`` times (tunelab/bench/allreduce.py::_operation), with stand-ins for
the device tools and the engine: no GPU needed.  The engine's device calls return once their kernels
are queued, so a timed call must end with a wait for them, as the bound row's copy does."""

from __future__ import annotations

import numpy as np

from tunelab.bench.allreduce import _operation


def _tools(log: list[str]) -> tuple:
    return (lambda a: a.copy(), lambda a: np.asarray(a), lambda d, h: None,
            lambda dst, src: log.append("copy and wait"), lambda: log.append("wait"))


def test_an_engine_call_on_the_device_is_timed_until_its_result_is_there() -> None:
    log: list[str] = []

    class Engine:
        def allreduce(self, src, out=None):
            log.append("queued")

    op, reset, _ = _operation("ring", None, np.ones(4, np.float32), {"ring": Engine()}, None, _tools(log))
    op()
    assert log == ["queued", "wait"] and reset is None


def test_the_bound_row_is_one_copy_that_waits_for_itself() -> None:
    log: list[str] = []
    op, _, _ = _operation("bound", None, np.ones(4, np.float32), {}, None, _tools(log))
    op()
    assert log == ["copy and wait"]
