"""TensorFlow 2 / Keras 3 adapter with Horovod's names: ``import tunelab.tensorflow as hvd``.

Collectives work eagerly and inside ``tf.function`` (they run as ``tf.py_function``
ops, so compile Keras models with ``jit_compile=False``).  Gradients are reduced on
tunelab's engine through its background coordinator, fused by the engine's knobs.

Training with ``model.fit``::

    import tunelab.tensorflow as tl
    tl.init()
    model.compile(optimizer=tl.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=..., jit_compile=False)
    model.fit(x, y, callbacks=[tl.BroadcastGlobalVariablesCallback(0), tl.MetricAverageCallback()])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("tunelab.tensorflow needs TensorFlow: pip install 'tunelab[tensorflow]'") from exc

from . import runtime as _rt
from .reduce_ops import Average, Max, Min, Sum, resolve_op

__all__ = ["Average", "BroadcastGlobalVariablesCallback", "Compression", "DistributedGradientTape",
           "DistributedOptimizer", "Max", "MetricAverageCallback", "Min", "Sum", "allgather", "allreduce",
           "broadcast", "broadcast_variables", "cross_rank", "cross_size", "grouped_allreduce", "init", "is_initialized",
           "local_rank", "local_size", "model_signature", "rank", "set_knobs", "shutdown", "size",
           "variables_signature"]


# ---- lifecycle and topology ------------------------------------------------------------------
from .runtime import (  # noqa: E402  (re-exported: the same functions serve every adapter)
    cross_rank, cross_size, is_initialized, local_rank, local_size, rank, set_knobs, shutdown, size,
)


def init(comm: Any = None, **settings: object) -> None:
    """Start tunelab on this rank (collective); ``settings`` as for ``tunelab.torch.init``."""
    _rt.init(comm, **settings)


class _NoneCompressor:
    @staticmethod
    def compress(t: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return t, None

    @staticmethod
    def decompress(t: tf.Tensor, ctx: Any) -> tf.Tensor:
        return t


class _FP16Compressor:
    @staticmethod
    def compress(t: tf.Tensor) -> tuple[tf.Tensor, Any]:
        if t.dtype.is_floating and t.dtype != tf.float16:
            return tf.cast(t, tf.float16), t.dtype
        return t, None

    @staticmethod
    def decompress(t: tf.Tensor, ctx: Any) -> tf.Tensor:
        return t if ctx is None else tf.cast(t, ctx)


class Compression:
    none = _NoneCompressor
    fp16 = _FP16Compressor


# ---- collectives ------------------------------------------------------------------------------
def _dense(t: Any) -> tf.Tensor:
    return tf.convert_to_tensor(t)  # IndexedSlices (embedding gradients) become dense


def _reduce_numpy(names: list[str], arrays: list[np.ndarray], op: str, group: str | None) -> list[np.ndarray]:
    coord = _rt.current().coordinator
    handles = coord.submit_group(names, arrays, op, group=group)
    return [h.wait() for h in handles]


def _to_engine(t: tf.Tensor) -> Any:
    """A GPU tensor as a CuPy array on the same memory (DLPack, no copy), so the engine reduces it
    on the device; anything else (and bfloat16, which CuPy cannot hold) as a numpy array."""
    if "GPU" in (t.device or "").upper() and t.dtype != tf.bfloat16:
        import cupy

        return cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(t))
    return t.numpy()


def _from_engine(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return a
    return tf.experimental.dlpack.from_dlpack(a.toDlpack())  # back to a TF GPU tensor, no copy


def _py_collective(fn: Any, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """Run ``fn(list of arrays) -> list of arrays`` as one op, eager or in a graph: numpy arrays for
    host tensors, CuPy arrays (zero-copy, reduced on the device) for GPU tensors."""
    outs = tf.py_function(lambda *ts: [_from_engine(a) for a in fn([_to_engine(t) for t in ts])], tensors,
                          [t.dtype for t in tensors])
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return list(outs)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                      op: str | None = None, compression: type = Compression.none,
                      grouped: bool = True) -> list[tf.Tensor]:
    """Allreduce several tensors in one request (as one group unless ``grouped=False``)."""
    if not tensors:
        return []
    base = name or _rt.current().auto_name("tf.allreduce")
    packed = [compression.compress(_dense(t)) for t in tensors]
    names = [f"{base}.{i}" for i in range(len(tensors))]
    how = resolve_op(op, average)
    reduced = _py_collective(lambda arrays: _reduce_numpy(names, arrays, how, base if grouped else None),
                             [p for p, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None, op: str | None = None,
              compression: type = Compression.none) -> tf.Tensor:
    return grouped_allreduce([tensor], average, name or _rt.current().auto_name("tf.allreduce"), op,
                             compression, grouped=False)[0]


def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's tensor along axis 0 (first dims may differ)."""
    t = tf.convert_to_tensor(tensor)
    out = tf.py_function(lambda x: _rt.current().allgather(x.numpy(), name or "tensor"), [t], t.dtype)
    out.set_shape([None, *t.shape[1:]])
    return out


def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    def bcast(arrays: list[Any]) -> list[np.ndarray]:
        first = arrays[0]
        a = np.ascontiguousarray(first if isinstance(first, np.ndarray) else first.get()).copy()  # once per job
        _rt.current().broadcast_(a, root_rank, name or "tensor")
        return [a]

    return _py_collective(bcast, [tf.convert_to_tensor(tensor)])[0]


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int) -> None:
    """Assign root's values to ``variables`` on every rank (eager)."""
    _rt.current().check_same([tuple(v.shape) for v in variables], "the shapes of the variables to broadcast")
    for v in variables:
        v.assign(broadcast(v, root_rank, name=v.name))


# ---- training ---------------------------------------------------------------------------------
def variables_signature(variables: Sequence[Any]) -> str:
    """Identity of a model for tuned profiles: the shapes and dtypes of its trainable variables, in order.
    Keras lays weights out differently from torch (NHWC kernels, conv biases), so the two frameworks'
    signatures of "the same" model differ on purpose: a profile is tuned for one framework's tensors."""
    import hashlib

    h = hashlib.sha256()
    for v in variables:
        shape = tuple(None if d is None else int(d) for d in v.shape)
        h.update(f"{shape}:{tf.as_dtype(v.dtype).name};".encode())
    return f"{len(variables)}v-{h.hexdigest()[:16]}"


def model_signature(model: Any) -> str:
    """The profile key of a Keras model: :func:`variables_signature` of its trainable variables."""
    return variables_signature(model.trainable_variables)


@tf.autograph.experimental.do_not_convert
def _load_profile(variables: Sequence[Any], model_name: str) -> None:
    """Apply the stored tuned knobs (collective).  Runs eagerly even while a ``tf.function`` is being
    traced, so the lookup happens once, now, instead of being baked into (or skipped by) the graph;
    AutoGraph is kept out of it because it would try to convert the profile store's code."""
    with tf.init_scope():
        _rt.current().load_profile(variables_signature(variables), "tensorflow", model_name)


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over all ranks.

    With ``load_profile`` (collective: every rank must call ``gradient()``), the first ``gradient()``
    call applies the knobs ``tunelab tune`` stored for this hardware, model (the sources' shapes) and
    world size, logged in one line on rank 0; knobs set explicitly or through ``TUNELAB_*`` win.
    A model is looked up once per job: wrappers made anew every step (the usual Horovod pattern) or
    inside a ``tf.function`` trace reuse the first lookup."""

    def __init__(self, tape: tf.GradientTape, compression: type = Compression.none, op: str = Average,
                 load_profile: bool = True, model_name: str = "") -> None:
        self._tape, self._compression, self._op = tape, compression, op
        self._profile_pending, self._model_name = load_profile, model_name

    def __getattr__(self, item: str) -> Any:
        return getattr(self._tape, item)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None) -> Any:
        if self._profile_pending:
            self._profile_pending = False
            _load_profile(tf.nest.flatten(sources), self._model_name)
        grads = self._tape.gradient(target, sources, output_gradients)
        flat = tf.nest.flatten(grads)
        present = [i for i, g in enumerate(flat) if g is not None]
        reduced = grouped_allreduce([flat[i] for i in present], name="tape.gradients", op=self._op,
                                    compression=self._compression, grouped=False)
        for i, r in zip(present, reduced):
            flat[i] = r
        return tf.nest.pack_sequence_as(grads, flat)


def DistributedOptimizer(optimizer: Any, compression: type = Compression.none, op: str = Average,
                         load_profile: bool = True, model_name: str = "") -> Any:
    """A Keras 3 optimizer of the same class and config whose ``apply`` (and so ``apply_gradients``
    and ``model.fit``) first averages the gradients over all ranks.

    With ``load_profile`` the tuned knobs are applied when the optimizer is built on the model's
    variables: ``model.fit`` builds it eagerly before tracing its train step, and a build that
    happens inside a trace still looks the profile up eagerly (see :class:`DistributedGradientTape`)."""
    base = optimizer.__class__

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = grouped_allreduce([grads[i] for i in present], name="optimizer.gradients", op=op,
                                    compression=compression, grouped=False)
        for i, r in zip(present, reduced):
            grads[i] = r
        return base.apply(self, grads, trainable_variables)

    def build(self: Any, variables: Any) -> None:
        base.build(self, variables)
        if load_profile and not getattr(self, "_tunelab_profile_loaded", False):
            self._tunelab_profile_loaded = True
            _load_profile(list(variables), model_name)

    cls = type(base.__name__, (base,), {"apply": apply, "build": build, "_tunelab_distributed": True})
    return cls.from_config(optimizer.get_config())


def _keras() -> Any:
    import keras

    return keras


class BroadcastGlobalVariablesCallback(_keras().callbacks.Callback):
    """Broadcast the model's weights from ``root_rank`` when training starts."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank

    def on_train_begin(self, logs: Any = None) -> None:
        broadcast_variables(self.model.weights, self.root_rank)


class MetricAverageCallback(_keras().callbacks.Callback):
    """Average the epoch's metrics (loss, accuracy, ...) over all ranks before other callbacks see them."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.floating)))
        _rt.current().check_same(keys, "the metric names to average")
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        out = _rt.current().coordinator.submit(f"metrics.epoch{epoch}", values, op=Average).wait()
        for k, v in zip(keys, out):
            logs[k] = float(v)
