"""PyTorch adapter with Horovod's names: porting a Horovod script means changing one import,
``import horovod.torch as hvd`` -> ``import tunelab.torch as hvd``.

Modules: ``ops`` (the allreduce family, asynchronous handles), ``collectives`` (allgather, broadcast,
alltoall, reducescatter, objects), ``optimizer`` (``DistributedOptimizer``), ``sync_batch_norm``.
Collectives that ranks disagree on (shape, dtype, op, root) raise a ``RankMismatchError`` from that
call on every rank and leave the job usable.
"""

from __future__ import annotations

from typing import Any

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tunelab.torch needs PyTorch: pip install 'tunelab[torch]'") from exc

from .. import runtime as _rt
from ..reduce_ops import Adasum, Average, Max, Min, ProcessSet, Product, Sum, global_process_set
from ..runtime import (
    barrier,
    cross_rank,
    cross_size,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    set_knobs,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ._convert import Compression
from .collectives import (
    allgather,
    allgather_object,
    alltoall,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    grouped_reducescatter,
    reducescatter,
)
from .join import join
from .ops import (
    Handle,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    poll,
    synchronize,
)
from .optimizer import DistributedOptimizer, model_signature, parameters_signature
from .sync_batch_norm import SyncBatchNorm


def init(comm: Any = None, **settings: object) -> None:
    """Start tunelab on this rank (collective).  ``settings``: knobs such as
    ``fusion_threshold_bytes`` and engine settings such as ``ranks_per_node``."""
    _rt.init(comm, **settings)


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_reducescatter",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "model_signature",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "parameters_signature",
    "poll",
    "rank",
    "reducescatter",
    "set_knobs",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
