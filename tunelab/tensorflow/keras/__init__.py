"""Keras with Horovod's names: ``import tunelab.tensorflow.keras as hvd`` (was
``import horovod.tensorflow.keras as hvd``).  The same functions as :mod:`tunelab.tensorflow`, the
Keras ``DistributedOptimizer``, and the ``callbacks`` namespace."""

from __future__ import annotations

from .. import (
    Average,
    Compression,
    DistributedOptimizer,
    Max,
    Min,
    Sum,
    SyncBatchNormalization,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    gloo_built,
    grouped_allreduce,
    init,
    is_initialized,
    join,
    load_model,
    local_rank,
    local_size,
    mpi_built,
    mpi_threads_supported,
    nccl_built,
    rank,
    set_knobs,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from . import callbacks

__all__ = ["Average", "Compression", "DistributedOptimizer", "Max", "Min", "Sum", "SyncBatchNormalization", "allgather", "allgather_object",
           "allreduce", "barrier", "broadcast", "broadcast_object", "broadcast_variables", "callbacks", "cross_rank",
           "cross_size", "gloo_built", "grouped_allreduce", "init", "is_initialized", "join", "load_model", "local_rank", "local_size",
           "mpi_built", "mpi_threads_supported", "nccl_built", "rank", "set_knobs", "shutdown", "size",
           "start_timeline", "stop_timeline"]
