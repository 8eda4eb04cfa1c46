"""``tunelab.torch``'s synchronous collectives: allgather, broadcast, alltoall, reducescatter, objects.

They run on the caller's thread over MPI (CUDA tensors are staged through host memory: they run once
per job or per evaluation, not per gradient), except reducescatter, which is an engine allreduce of
which each rank keeps its rows.  ``allgather``, ``broadcast`` and ``alltoall`` are autograd functions
with Horovod's gradients: an allgather's gradient is this rank's slice of the averaged incoming
gradient, a broadcast's is the averaged gradient on the root and zero elsewhere, an alltoall's is the
alltoall of the gradient sent back the way the data came.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import runtime as _rt
from ..reduce_ops import Average, resolve_op
from ._convert import Compression, from_numpy, host_copy, to_numpy
from .ops import allreduce, grouped_allreduce


# ---- allgather ----------------------------------------------------------------------------------
def _allgather_rows(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, list[int]]:
    t = tensor.detach()
    out, rows = _rt.current().allgatherv(host_copy(t), name)
    return from_numpy(out, t), rows


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
        out, rows = _allgather_rows(tensor, name)
        r = _rt.current().topology.rank
        ctx.offset, ctx.rows, ctx.name = sum(rows[:r]), rows[r], name
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad.contiguous(), name=f"{ctx.name}.grad", op=Average)
        return reduced.narrow(0, ctx.offset, ctx.rows), None


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dims may differ).  Differentiable."""
    name = name or _rt.current().auto_name("allgather")
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Allgather.apply(tensor, name)
    return _allgather_rows(tensor, name)[0]


def allgather_object(obj: object, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    return _rt.current().allgather_object(obj, name)


# ---- broadcast ----------------------------------------------------------------------------------
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place.  Ranks naming different roots, shapes or dtypes
    get a RankMismatchError on every rank."""
    work = tensor.detach() if tensor.is_contiguous() and tensor.device.type == "cpu" else \
        tensor.detach().contiguous().cpu()
    _rt.current().broadcast_(to_numpy(work), root_rank, name or "tensor")
    if work.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(work)
    else:  # (written through a view torch does not see: its version moves as an in-place op's would;
        torch.autograd.graph.increment_version(tensor)  # a Parameter's .data has a counter of its own)
    return tensor


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str) -> torch.Tensor:
        ctx.root, ctx.name = root_rank, name
        return broadcast_(tensor.detach().clone(), root_rank, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        reduced = allreduce(grad.contiguous(), name=f"{ctx.name}.grad", op=Average)
        if _rt.current().topology.rank != ctx.root:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s tensor, as a new tensor.  Differentiable."""
    name = name or _rt.current().auto_name("broadcast")
    if torch.is_grad_enabled() and tensor.requires_grad:
        return _Broadcast.apply(tensor, root_rank, name)
    return broadcast_(tensor.detach().clone(), root_rank, name)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Broadcast a ``state_dict()``, ``named_parameters()`` or a list of tensors (``model.parameters()``,
    named by their place in it) from ``root_rank``, in place."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = []
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor):
                p = (f"param.{i}", p)
            if not (isinstance(p, tuple) and len(p) == 2):
                raise ValueError("broadcast_parameters takes a state_dict(), named_parameters() or a list of "
                                 f"tensors; item {i} is a {type(p).__name__}")
            items.append(p)
    _rt.current().check_same([name for name, _ in items], "the parameter names to broadcast")
    for name, p in items:
        if isinstance(p, torch.Tensor):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, name)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make every rank's optimizer state (moments, step counts, hyper-parameters) equal to root's.
    ``model``: Horovod's, which it reads for sparse embeddings to make a state that does not exist yet;
    here root's state itself travels, whatever it holds, so it is accepted and not needed.

    Root's state travels in host memory, and each rank's ``load_state_dict`` puts it where that rank's
    parameters are: a CUDA tensor pickled as it is would be unpickled on the device it had on root
    (``cuda:0`` for every rank of a multi-GPU host), making a CUDA context and a copy of the state on
    another rank's GPU first."""
    rt = _rt.current()
    mine = _on_host(optimizer.state_dict()) if rt.topology.rank == root_rank else None
    optimizer.load_state_dict(rt.broadcast_object(mine, root_rank))


def _on_host(obj: Any) -> Any:
    """``obj`` (a state dict's nesting of dicts, lists and tuples) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None) -> object:
    return _rt.current().broadcast_object(obj, root_rank, name)


# ---- alltoall -----------------------------------------------------------------------------------
def _splits(splits: Any) -> list[int] | None:
    if splits is None:
        return None  # equal parts, checked on every rank at once
    return [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]


def _alltoall(tensor: torch.Tensor, splits: list[int] | None, name: str) -> tuple[torch.Tensor, list[int]]:
    t = tensor.detach()
    out, received = _rt.current().alltoall(host_copy(t), splits, name)
    return from_numpy(out, t), received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: list[int], name: str) -> tuple:
        out, received = _alltoall(tensor, splits, name)
        ctx.received, ctx.name = received, name
        counts = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(counts)
        return out, counts

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _counts: Any) -> tuple:
        back, _ = _alltoall(grad.contiguous(), ctx.received, f"{ctx.name}.grad")
        return back, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order; equal parts without ``splits``) to rank i.
    Returns the rows received, in rank order; with ``splits`` given, also a tensor of how many rows came
    from each rank (Horovod's return shape).  Differentiable."""
    rt = _rt.current()
    plan = _splits(splits)
    name = name or rt.auto_name("alltoall")
    if torch.is_grad_enabled() and tensor.requires_grad:
        out, counts = _Alltoall.apply(tensor, plan, name)
    else:
        out, received = _alltoall(tensor, plan, name)
        counts = torch.tensor(received, dtype=torch.int32)
    return out if splits is None else (out, counts)


# ---- reducescatter ------------------------------------------------------------------------------
def _my_rows(total: int, world: int, rank: int) -> tuple[int, int]:
    """Horovod's split of dim 0: ``total // world`` rows each, the first ``total % world`` ranks one more."""
    base, extra = divmod(total, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type = Compression.none, op: str | None = Average) -> list[torch.Tensor]:
    """Reduce each tensor over all ranks and keep this rank's rows of dim 0 (split as Horovod does).
    Runs as one grouped engine allreduce; each rank then keeps its rows.  Differentiable: a row's
    gradient comes from the rank that kept it (an allgather of the gradients, over the ranks for
    Average), as Horovod's."""
    how = resolve_op(op)
    if how not in ("sum", "average"):
        raise ValueError(f"reducescatter supports Sum and Average, got {how!r}")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors with at least one dimension")
    name = name or _rt.current().auto_name("reducescatter")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_Reducescatter.apply(how, name, compression, *tensors))
    return _reducescatter(list(tensors), name, compression, how)


def _reducescatter(tensors: list[torch.Tensor], name: str, compression: type, how: str) -> list[torch.Tensor]:
    rt = _rt.current()
    reduced = grouped_allreduce([t.detach() for t in tensors], name=name, op=how, compression=compression)
    out = []
    for r in reduced:
        start, count = _my_rows(r.shape[0], rt.topology.size, rt.topology.rank)
        out.append(r.narrow(0, start, count).clone())
    return out


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, how: str, name: str, compression: type, *tensors: torch.Tensor) -> tuple:
        ctx.how, ctx.name, ctx.like = how, name, [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(_reducescatter(list(tensors), name, compression, how))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        topo = _rt.current().topology
        world = topo.size
        out = []
        for i, (g, (shape, dtype, device)) in enumerate(zip(grads, ctx.like)):
            if g is None:  # (an output the loss did not use: its rows' gradient is zero)
                rows = _my_rows(shape[0], world, topo.rank)[1]
                g = torch.zeros((rows, *shape[1:]), dtype=dtype, device=device)
            full = _allgather_rows(g.contiguous(), f"{ctx.name}.grad.{i}")[0]
            out.append(full / world if ctx.how == "average" else full)
        return (None, None, None, *out)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type = Compression.none,
                  op: str | None = Average) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op)[0]


__all__ = ["allgather", "allgather_object", "alltoall", "broadcast", "broadcast_", "broadcast_object",
           "broadcast_optimizer_state", "broadcast_parameters", "grouped_reducescatter", "reducescatter"]
