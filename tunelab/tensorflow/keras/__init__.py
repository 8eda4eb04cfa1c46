"""Keras with Horovod's names: ``import tunelab.tensorflow.keras as hvd`` (was
``import horovod.tensorflow.keras as hvd``).  The same functions as :mod:`tunelab.tensorflow`, the
Keras ``DistributedOptimizer``, and the ``callbacks`` namespace."""

from __future__ import annotations

from typing import Any

from .. import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    SyncBatchNormalization,
    allgather,
    allgather_object,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allreduce,
    init,
    is_initialized,
    join,
    load_model,
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
from .. import allreduce as _tf_allreduce
from .. import reducescatter as _tf_reducescatter
from ..training import keras_distributed_optimizer as DistributedOptimizer
from . import callbacks


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: str | None = None, compression: type = Compression.none) -> Any:
    """``horovod.tensorflow.keras.allreduce``, in its order (the name second): a value (a number, a list,
    an array or a tensor) reduced over all ranks (see ``tunelab.tensorflow.allreduce``)."""
    return _tf_allreduce(value, average=average, name=name, op=op, compression=compression,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def reducescatter(value: Any, name: str | None = None, op: str | None = Average) -> Any:
    """``horovod.tensorflow.keras.reducescatter``: ``value`` reduced over all ranks, this rank's rows kept."""
    return _tf_reducescatter(value, op=op, name=name)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "set_knobs",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
