"""TensorFlow 2 / Keras 3 adapter with Horovod's names: ``import tunelab.tensorflow as hvd``
(and ``import tunelab.tensorflow.keras as hvd`` for ``horovod.tensorflow.keras``).

Collectives work eagerly and inside ``tf.function`` (they run as ``tf.py_function`` ops, so compile
Keras models with ``jit_compile=False``).  Gradients are reduced on tunelab's engine through its
background coordinator, fused by the engine's knobs.

Training with ``model.fit``::

    import tunelab.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""

from __future__ import annotations

from typing import Any

try:
    import tensorflow as tf  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tunelab.tensorflow needs TensorFlow: pip install 'tunelab[tensorflow]'") from exc

from .. import runtime as _rt
from ..reduce_ops import Adasum, Average, Max, Min, ProcessSet, Product, Sum, global_process_set
from ..runtime import (
    allgather_object,
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
from .callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from .ops import (
    Compression,
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_variables,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from .sync_batch_norm import SyncBatchNormalization
from .training import (
    DistributedGradientTape,
    DistributedOptimizer,
    load_model,
    model_signature,
    variables_signature,
)


def init(comm: Any = None, **settings: object) -> None:
    """Start tunelab on this rank (collective); ``settings`` as for ``tunelab.torch.init``."""
    _rt.init(comm, **settings)


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None) -> object:
    return _rt.current().broadcast_object(obj, root_rank, name)


__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "Max",
    "MetricAverageCallback",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "model_signature",
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
    "variables_signature",
]
