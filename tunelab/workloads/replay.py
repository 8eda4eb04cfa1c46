"""Gradient replay: a model's real gradient tensors and backward timing, without a framework.

A replayed step submits the same tensors (names, shapes, order) that a data-parallel
training step of ``model`` would, spaced out the way a backward pass produces them,
through the engine's background coordinator.  It needs neither torch nor TensorFlow, so
knob settings can be compared on a step that costs only the compute it simulates.

The compute is real CPU work (numpy arithmetic on a small array), not sleeping: a real
backward pass keeps the cores busy while the coordinator reduces the first gradients, and
the contention between the two is part of what the knobs trade off.  The amount of work is
calibrated once, at construction, so that uncontended it takes the requested time; under
contention it takes longer, just as a framework's kernels would.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import dtype_from_name
from .shapes import MODELS, gradient_shapes

if TYPE_CHECKING:
    from ..engine.coordinator import Coordinator

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class BusyCompute:
    """Fixed amounts of CPU work in *units* of a few microseconds each.

    numpy's ufuncs release the GIL while they run, as framework kernels do, so the
    coordinator thread in the same process keeps its turns; the array fits in cache so a
    unit costs about the same wherever it runs.
    """

    ELEMENTS = 1 << 16

    def __init__(self, calibration_s: float = 0.06) -> None:
        self._x = np.random.default_rng(0).random(self.ELEMENTS, dtype=np.float32) + np.float32(0.5)
        self._a, self._b = np.float32(0.9999), np.float32(0.0001)
        self.units_per_ms = self._calibrate(calibration_s)

    def run(self, units: int) -> None:
        x, a, b = self._x, self._a, self._b
        for _ in range(units):
            np.multiply(x, a, out=x)
            np.add(x, b, out=x)  # x stays near 1: no overflow, no denormals
            np.sqrt(x, out=x)

    def units_for(self, ms: float) -> int:
        return round(ms * self.units_per_ms)

    def _calibrate(self, total_s: float) -> float:
        """Units per millisecond: the median of several short trials, so one preempted
        trial (another rank calibrating on the same core) does not skew the amount."""
        self.run(20)  # warm caches and ufunc dispatch
        t0 = time.perf_counter()
        self.run(50)
        guess = 50 / max((time.perf_counter() - t0) * 1000, 1e-6)
        trials, per_trial = 7, max(1, round(guess * total_s * 1000 / 7))
        rates = []
        for _ in range(trials):
            t0 = time.perf_counter()
            self.run(per_trial)
            rates.append(per_trial / max((time.perf_counter() - t0) * 1000, 1e-6))
        return statistics.median(rates)


def gradient_names(model: str) -> list[str]:
    """Tensor names in backward order: the parameter names a framework adapter would submit."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return [f"grad.{name}" for name, _ in reversed(MODELS[model]())]


def make_gradients(model: str, dtype: str = "float32", seed: int = 0) -> list[np.ndarray]:
    """One array per gradient of ``model`` (backward order) filled with small integers in
    [-8, 8]: any summation order then gives exactly the same sum, so results can be checked
    bit for bit.  Ranks pass different seeds to reduce different data."""
    if dtype not in _FLOATS:
        raise ValueError(f"replayed gradients are averaged: dtype must be one of {', '.join(_FLOATS)}, "
                         f"got {dtype!r}")
    dt = dtype_from_name(dtype)
    rng = np.random.default_rng(seed)
    return [rng.integers(-8, 9, size=shape, dtype=np.int8).astype(dt) for shape in gradient_shapes(model)]


class GradientReplay:
    """Replays one model's data-parallel step: forward compute, then each gradient submitted
    (op "average") after its share of the backward time, then a wait for all of them.

    Without ``ready_offsets_ms`` each gradient's share of ``backward_ms`` is proportional
    to its element count.  With them (one per gradient, backward order, as
    :func:`record_backward_profile` returns), gradients are submitted in the order and at
    the relative times measured, scaled so the last one is ready at ``backward_ms``
    (pass ``backward_ms=max(offsets)`` to replay them unscaled).
    """

    def __init__(self, model: str, forward_ms: float, backward_ms: float, dtype: str = "float32",
                 seed: int = 0, ready_offsets_ms: Sequence[float] | None = None) -> None:
        for label, value in (("forward_ms", forward_ms), ("backward_ms", backward_ms)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a non-negative number, got {value!r}")
        self.model = model
        self.forward_ms, self.backward_ms = float(forward_ms), float(backward_ms)
        self.names = gradient_names(model)
        self.gradients = make_gradients(model, dtype, seed)
        # Reused every step, like a framework's gradient buffers; touched now so that the first
        # step does not pay the page faults.
        self.outputs = [np.zeros_like(g) for g in self.gradients]
        for out in self.outputs:
            out.fill(0)
        self.order, gaps_ms = self._schedule(ready_offsets_ms)
        self.compute = BusyCompute()
        self._forward_units = self.compute.units_for(self.forward_ms)
        bounds = np.round(np.cumsum([0.0, *gaps_ms]) * self.compute.units_per_ms).astype(np.int64)
        self._gap_units = np.diff(bounds).tolist()  # rounding error does not accumulate

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gradients)

    def _schedule(self, offsets: Sequence[float] | None) -> tuple[list[int], list[float]]:
        """Submission order and the compute time (ms) before each submission."""
        n = len(self.gradients)
        if offsets is None:
            sizes = np.array([g.size for g in self.gradients], dtype=np.float64)
            return list(range(n)), (self.backward_ms * sizes / max(sizes.sum(), 1.0)).tolist()
        ready = np.asarray(offsets, dtype=np.float64)
        if ready.shape != (n,) or not np.all(np.isfinite(ready)) or np.any(ready < 0):
            raise ValueError(f"ready_offsets_ms must be {n} finite non-negative times for {self.model}, "
                             f"got {len(offsets)}")
        order = np.argsort(ready, kind="stable")
        scale = self.backward_ms / ready.max() if ready.max() > 0 else 0.0
        times = ready[order] * scale
        return order.tolist(), np.diff(times, prepend=0.0).tolist()

    def step(self, coordinator: Coordinator) -> None:
        """One simulated training step; returns when every gradient is reduced into ``outputs``."""
        self.compute.run(self._forward_units)
        handles = []
        for index, units in zip(self.order, self._gap_units):
            self.compute.run(units)
            handles.append(coordinator.submit(self.names[index], self.gradients[index], "average",
                                              out=self.outputs[index]))
        for handle in handles:
            handle.wait()


def record_backward_profile(torch_model: Any, inputs: Any, targets: Any) -> list[float]:
    """Milliseconds from the start of ``loss.backward()`` at which each parameter's gradient is
    ready, in backward order (reversed parameter order, the order of
    :func:`tunelab.workloads.shapes.gradient_shapes` for the built-in models).

    The loss is cross-entropy, as in the training workloads.  One unmeasured pass runs first
    so that allocator warm-up does not distort the profile.  On a GPU the times are the device's
    (a CUDA event recorded in each gradient's hook, on the stream that produced it): the host
    queues a backward's kernels long before they run, so host clocks in the hooks would record
    when the work was queued, not when each gradient was ready.
    """
    from .torch_models import _torch

    torch = _torch()
    params = [p for p in torch_model.parameters() if p.requires_grad]
    cuda = any(p.device.type == "cuda" for p in params)
    ready: list[Any] = [None] * len(params)
    start: list[Any] = [None]

    def now() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream: in a hook, the one that produced the gradient
            return event
        return time.perf_counter()

    def hook_for(index: int) -> Any:
        def hook(_param: Any) -> None:
            ready[index] = now()
        return hook

    hooks = [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]
    try:
        for _ in range(2):
            ready[:] = [None] * len(params)
            torch_model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(torch_model(inputs), targets)
            if cuda:
                torch.cuda.synchronize()  # the forward's kernels are done: the clock starts with backward
            start[0] = now()
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
    finally:
        for h in hooks:
            h.remove()
    missing = [i for i, t in enumerate(ready) if t is None]
    if missing:
        raise ValueError(f"{len(missing)} parameters received no gradient (first: index {missing[0]}); "
                         "a replay needs every parameter to take part in the loss")
    if cuda:
        ready = [float(start[0].elapsed_time(t)) for t in ready]
    else:
        ready = [(t - start[0]) * 1000.0 for t in ready]
    return ready[::-1]
