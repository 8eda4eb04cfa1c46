"""PyTorch adapter with Horovod's names: porting a Horovod script means changing one import,
``import horovod.torch as hvd`` -> ``import tunelab.torch as hvd``.

Collectives run on tunelab's engine through its background coordinator; the
``DistributedOptimizer`` starts each gradient's allreduce from an autograd hook as
soon as that gradient is ready, so communication overlaps the rest of backward.
CUDA tensors are reduced on the device: the engine reads them in place through
``__cuda_array_interface__`` (no host copy) and ranks of a node exchange device staging buffers
through CUDA IPC.  Allgather and broadcast, which run once per job rather than per step, stage
CUDA tensors through host memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tunelab.torch needs PyTorch: pip install 'tunelab[torch]'") from exc

from . import runtime as _rt
from .dtypes import bfloat16 as _np_bfloat16
from .errors import TunelabError
from .reduce_ops import Average, Max, Min, Sum, resolve_op

# ---- lifecycle and topology ------------------------------------------------------------------
from .runtime import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    set_knobs,
    shutdown,
    size,
)


def init(comm: Any = None, **settings: object) -> None:
    """Start tunelab on this rank (collective).  ``settings``: knobs such as
    ``fusion_threshold_bytes`` and engine settings such as ``ranks_per_node``."""
    _rt.init(comm, **settings)


# ---- tensors <-> numpy ----------------------------------------------------------------------
def _numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy)."""
    if t.device.type != "cpu":
        raise TunelabError(f"tensor on {t.device}: expected a CPU tensor here")
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_np_bfloat16())
    return t.numpy()


def _engine_view(t: torch.Tensor) -> Any:
    """What the engine reduces, without copying: a numpy view of a CPU tensor, a device buffer of
    a CUDA tensor (through ``__cuda_array_interface__``; bfloat16, which the interface cannot
    describe, through its int16 view)."""
    if t.device.type == "cpu":
        return _numpy(t)
    if t.device.type != "cuda":
        raise TunelabError(f"tensor on {t.device}: tunelab reduces CPU and CUDA tensors")
    from .engine.device import device_buffer

    t = t.detach()
    if t.dtype == torch.bfloat16:
        buf = device_buffer(t.view(torch.int16))
        return dataclasses.replace(buf, dtype=np.dtype(_np_bfloat16()), owner=t)
    return dataclasses.replace(device_buffer(t), owner=t)


class _NoneCompressor:
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _FP16Compressor:
    """Send floating tensors as float16; restore their dtype afterwards."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    none = _NoneCompressor
    fp16 = _FP16Compressor


class Handle:
    """An allreduce in flight; ``synchronize(handle)`` returns its result."""

    def __init__(self, inner: Sequence[Any], results: list[torch.Tensor],
                 finish: Callable[[list[torch.Tensor]], list[torch.Tensor]], single: bool) -> None:
        self._inner, self._results, self._finish, self._single = inner, results, finish, single

    def poll(self) -> bool:
        return all(h.done() for h in self._inner)

    def wait(self) -> torch.Tensor | list[torch.Tensor]:
        for h in self._inner:
            h.wait()
        out = self._finish(self._results)
        return out[0] if self._single else out


def _submit(tensors: Sequence[torch.Tensor], names: list[str], op: str, compression: type,
            inplace: bool, group: str | None) -> Handle:
    coord = _rt.current().coordinator
    packed = [compression.compress(t.detach()) for t in tensors]
    srcs = [c.contiguous() for c, _ in packed]
    direct = [inplace and c.data_ptr() == t.data_ptr() and t.is_contiguous() for (c, _), t in zip(packed, tensors)]
    results = [s if d else torch.empty_like(s) for s, d in zip(srcs, direct)]
    inner = coord.submit_group(names, [_engine_view(s) for s in srcs], op, [_engine_view(r) for r in results],
                               group=group)

    def finish(res: list[torch.Tensor]) -> list[torch.Tensor]:
        outs = [compression.decompress(r, ctx) for r, (_, ctx) in zip(res, packed)]
        if not inplace:
            return outs
        for t, o, d in zip(tensors, outs, direct):
            if not d:
                t.detach().copy_(o)
        return list(tensors)

    return Handle(inner, results, finish, single=group is None and len(tensors) == 1)


# ---- allreduce --------------------------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: str | None = None, compression: type = Compression.none) -> Handle:
    return _submit([tensor], [name or _rt.current().auto_name("allreduce")], resolve_op(op, average),
                   compression, inplace=False, group=None)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: str | None = None, compression: type = Compression.none) -> Handle:
    return _submit([tensor], [name or _rt.current().auto_name("allreduce")], resolve_op(op, average),
                   compression, inplace=True, group=None)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              op: str | None = None, compression: type = Compression.none) -> torch.Tensor:
    return synchronize(allreduce_async(tensor, average, name, op, compression))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: str | None = None, compression: type = Compression.none) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, compression))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: str | None = None,
                            compression: type = Compression.none, inplace: bool = False) -> Handle:
    base = name or _rt.current().auto_name("grouped_allreduce")
    names = [f"{base}.{i}" for i in range(len(tensors))]
    return _submit(list(tensors), names, resolve_op(op, average), compression, inplace, group=base)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      op: str | None = None, compression: type = Compression.none) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, compression))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: str | None = None, compression: type = Compression.none) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async(tensors, average, name, op, compression, inplace=True))


def synchronize(handle: Handle) -> Any:
    return handle.wait()


def poll(handle: Handle) -> bool:
    return handle.poll()


# ---- allgather / broadcast --------------------------------------------------------------------
def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ)."""
    t = tensor.detach().contiguous()
    out = _rt.current().allgather(_numpy(t.cpu()), name or "tensor")
    if t.dtype == torch.bfloat16:
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16).to(t.device)
    return torch.from_numpy(out).to(t.device)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    work = tensor.detach() if tensor.is_contiguous() and tensor.device.type == "cpu" else \
        tensor.detach().contiguous().cpu()
    _rt.current().broadcast_(_numpy(work), root_rank, name or "tensor")
    if work.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(work)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    return broadcast_(tensor.detach().clone(), root_rank, name)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Broadcast a ``state_dict()`` or ``named_parameters()`` from ``root_rank``, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    _rt.current().check_same([name for name, _ in items], "the parameter names to broadcast")
    for name, p in items:
        if isinstance(p, torch.Tensor):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, name)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state (moments, step counts, hyper-parameters) equal to root's."""
    state = _rt.current().broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state)


def broadcast_object(obj: object, root_rank: int = 0) -> object:
    return _rt.current().broadcast_object(obj, root_rank)


def parameters_signature(params: Sequence[torch.Tensor]) -> str:
    """Identity of a model for tuned profiles: the shapes and dtypes of its trainable parameters."""
    import hashlib

    h = hashlib.sha256()
    for p in params:
        h.update(f"{tuple(p.shape)}:{p.dtype};".encode())
    return f"{len(params)}p-{h.hexdigest()[:16]}"


def model_signature(model: torch.nn.Module) -> str:
    return parameters_signature([p for p in model.parameters() if p.requires_grad])


from .torch_optimizer import DistributedOptimizer

__all__ = [
    "Average", "Sum", "Min", "Max", "Compression", "DistributedOptimizer", "Handle",
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "set_knobs", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "synchronize", "poll",
    "allgather", "broadcast", "broadcast_", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "model_signature", "parameters_signature",
]

