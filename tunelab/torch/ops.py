"""The allreduce family of ``tunelab.torch``: asynchronous handles, in-place and grouped variants, and
autograd functions with Horovod's gradient semantics (the gradient of an allreduce is the same
allreduce of the incoming gradient).

Collectives run on tunelab's engine through its background coordinator.  CUDA tensors are reduced on
the device: the engine reads them in place through ``__cuda_array_interface__`` (no host copy).
Integer tensors are averaged as Horovod does: the sum times ``1.0 / size()`` in double precision,
truncated toward zero.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import runtime as _rt
from ..reduce_ops import Average, is_integer_average, resolve_op, scale_factors
from ._convert import Compression, engine_view


class Handle:
    """A collective in flight; ``synchronize(handle)`` returns its result (the same result however
    often it is asked: the finishing steps, an integer average's division or an in-place copy back,
    run once)."""

    def __init__(self, inner: Sequence[Any], results: list[torch.Tensor],
                 finish: Callable[[list[torch.Tensor]], list[torch.Tensor]], single: bool) -> None:
        self._inner, self._results, self._finish, self._single = inner, results, finish, single
        self._out: list[torch.Tensor] | None = None
        self._finishing = threading.Lock()  # two threads synchronizing one handle finish it once

    def poll(self) -> bool:
        return all(h.done() for h in self._inner)

    def wait(self) -> torch.Tensor | list[torch.Tensor]:
        if self._out is None:
            for h in self._inner:
                h.wait()
            with self._finishing:
                if self._out is None:
                    self._out = self._finish(self._results)
        return self._out[0] if self._single else self._out


def _written(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, which the engine wrote in place through views torch does not see: their version
    counters move as an in-place torch op's would, so a backward pass that saved one of them before
    raises torch's own error, instead of computing with the reduced values."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)
    return tensors


def _integer_average(t: torch.Tensor, world: int, postscale: float = 1.0) -> torch.Tensor:
    """Horovod's average of integers, with its postscale in the same factor (``postscale / world`` in
    double precision, one truncation; scaling the truncated average again truncated twice)."""
    return torch.trunc(t.to(torch.float64) * (postscale / world)).to(t.dtype)


def _scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t`` times ``factor`` (Horovod's prescale and postscale): integers through float64, truncated."""
    if factor == 1.0:
        return t
    if t.is_floating_point():
        return t * factor
    return torch.trunc(t.to(torch.float64) * factor).to(t.dtype)


def _submit(tensors: Sequence[torch.Tensor], names: list[str], op: str, compression: type,
            inplace: bool, group: str | None, prescale: float = 1.0, postscale: float = 1.0) -> Handle:
    rt = _rt.current()
    prescale, postscale = scale_factors(prescale, postscale)
    if len(tensors) == 1 and inplace and compression is Compression.none and prescale == postscale == 1.0:
        # What a gradient hook submits, for every gradient of every step: one contiguous tensor reduced
        # where it lies, nothing to undo afterwards (the general path below, without its lists)
        t = tensors[0]
        if t.dim() and t.is_contiguous() and not (op == Average and _integer_dtype(t.dtype)):
            view = engine_view(t)
            if group is None:  # (the coordinator's single-tensor submit, as the optimizer's hooks use)
                inner = [rt.coordinator.submit_one(names[0], view, op)]
            else:
                inner = rt.coordinator.submit_group(names, [view], op, [view], group=group)
            return Handle(inner, [t], _written, group is None)
    packed = [compression.compress(_scale(t.detach() if t.requires_grad else t, prescale))  # (gradients need none)
              for t in tensors]
    srcs = [c.contiguous().reshape(1) if c.dim() == 0 else c.contiguous() for c, _ in packed]  # 0-d as [1]
    # The engine averages floating dtypes only; integer averages are sums scaled afterwards.
    int_avg = [op == Average and _integer_dtype(s.dtype) for s in srcs]
    if any(int_avg) and not all(int_avg):
        raise TypeError("a grouped integer average cannot mix integer and floating tensors")
    engine_op = "sum" if any(int_avg) else op
    direct = [inplace and c.data_ptr() == t.data_ptr() and t.is_contiguous() for (c, _), t in zip(packed, tensors)]
    results = [s if d else torch.empty_like(s) for s, d in zip(srcs, direct)]
    views = [engine_view(s) for s in srcs]
    inner = rt.coordinator.submit_group(names, views, engine_op,
                                        [v if d else engine_view(r) for v, r, d in zip(views, results, direct)],
                                        group=group)
    single = group is None and len(tensors) == 1
    if all(direct) and compression is Compression.none and not any(int_avg) and postscale == 1.0:
        # reduced in place, nothing to undo: what a gradient hook submits (no work when it is waited on)
        return Handle(inner, results, lambda res: _written(list(tensors)), single)

    def finish(res: list[torch.Tensor]) -> list[torch.Tensor]:
        if any(int_avg):  # (all of them: checked above) the postscale goes into the average's factor
            for r in res:
                r.copy_(_integer_average(r, rt.topology.size, postscale))
        post = 1.0 if any(int_avg) else postscale
        outs = [_scale(compression.decompress(r, ctx), post).reshape(t.shape)
                for r, (_, ctx), t in zip(res, packed, tensors)]
        if not inplace:
            return outs
        for t, o, d in zip(tensors, outs, direct):
            if not d or postscale != 1.0:  # (reduced in place, then scaled into a new tensor)
                t.detach().copy_(o)
            else:
                _written([t])
        return list(tensors)

    return Handle(inner, results, finish, single)


_INTEGER_DTYPES: dict[torch.dtype, bool] = {}


def _integer_dtype(dtype: torch.dtype) -> bool:
    """Whether an average over ``dtype`` is Horovod's integer average (read once per dtype)."""
    found = _INTEGER_DTYPES.get(dtype)
    if found is None:
        found = _INTEGER_DTYPES[dtype] = is_integer_average(Average, str(dtype).removeprefix("torch."))
    return found


def _name(name: str | None, kind: str) -> str:
    return name or _rt.current().auto_name(kind)


# ---- allreduce --------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                    compression: type = Compression.none) -> Handle:
    return _submit([tensor], [_name(name, "allreduce")], resolve_op(op, average), compression,
                   inplace=False, group=None, prescale=prescale_factor, postscale=postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                     compression: type = Compression.none) -> Handle:
    return _submit([tensor], [_name(name, "allreduce")], resolve_op(op, average), compression,
                   inplace=True, group=None, prescale=prescale_factor, postscale=postscale_factor)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str, name: str, compression: type) -> torch.Tensor:
        ctx.op, ctx.name = op, name
        return synchronize(allreduce_async(tensor, name=name, op=op, compression=compression))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return allreduce(grad, name=f"{ctx.name}.grad", op=ctx.op), None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type = Compression.none, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (Average by default), times ``prescale_factor`` before and
    ``postscale_factor`` after.  Differentiable: the gradient is the same reduction of the incoming
    gradient, with the same factors."""
    how, name = resolve_op(op, average), _name(name, "allreduce")
    pre, post = scale_factors(prescale_factor, postscale_factor)
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _scale(_Allreduce.apply(_scale(tensor, pre), how, name, compression), post)
    return synchronize(allreduce_async(tensor, name=name, op=how, compression=compression,
                                       prescale_factor=pre, postscale_factor=post))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
               compression: type = Compression.none) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        compression=compression))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: str | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                            compression: type = Compression.none, inplace: bool = False) -> Handle:
    base = _name(name, "grouped_allreduce")
    names = [f"{base}.{i}" for i in range(len(tensors))]
    return _submit(list(tensors), names, resolve_op(op, average), compression, inplace, group=base,
                   prescale=prescale_factor, postscale=postscale_factor)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: str, name: str, compression: type, *tensors: torch.Tensor) -> tuple:
        ctx.op, ctx.name = op, name
        return tuple(synchronize(grouped_allreduce_async(tensors, name=name, op=op, compression=compression)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        reduced = grouped_allreduce([g.contiguous() for g in grads], name=f"{ctx.name}.grad", op=ctx.op)
        return (None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type = Compression.none, op: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce several tensors as one group.  Differentiable, like :func:`allreduce`."""
    how, base = resolve_op(op, average), _name(name, "grouped_allreduce")
    pre, post = scale_factors(prescale_factor, postscale_factor)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        scaled = [_scale(t, pre) for t in tensors]
        return [_scale(r, post) for r in _GroupedAllreduce.apply(how, base, compression, *scaled)]
    return synchronize(grouped_allreduce_async(tensors, name=base, op=how, compression=compression,
                                               prescale_factor=pre, postscale_factor=post))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                       compression: type = Compression.none) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor,
                                               compression=compression, inplace=True))


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s collective and return its result (raises the collective's error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    return handle.poll()


__all__ = ["Average", "Handle", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
           "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "poll", "synchronize"]
