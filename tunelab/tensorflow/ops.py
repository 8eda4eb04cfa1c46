"""``tunelab.tensorflow``'s collectives on ``tf.Tensor``s, eager or inside ``tf.function``.

They run as ``tf.py_function`` ops (compile Keras models with ``jit_compile=False``).  Allreduces go
through tunelab's engine and background coordinator (reducescatter too: one grouped allreduce of
which each rank keeps its rows); allgather, alltoall and broadcast through MPI on the caller's
thread.  ``allreduce``/``grouped_allreduce`` are differentiable with Horovod's gradient (the same
reduction of the incoming gradient).  A call the ranks disagree on raises on every rank (as a
``tf.errors`` error carrying tunelab's message) and later calls work.  Integer tensors are averaged as
Horovod does: the sum times ``1.0 / size()`` in double precision, truncated toward zero.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import runtime as _rt
from ..reduce_ops import (
    Average,
    Sum,
    check_process_set,
    integer_average,
    is_integer_average,
    resolve_op,
    scale_factors,
)


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


def _reduce_numpy(names: list[str], arrays: list[Any], op: str, group: str | None) -> list[Any]:
    rt = _rt.current()
    ints = [is_integer_average(op, np.dtype(a.dtype).name) for a in arrays]
    int_avg = all(ints)
    if any(ints) and not int_avg:
        raise TypeError("a grouped integer average cannot mix integer and floating tensors")
    shapes = [a.shape for a in arrays]
    flat = [a.reshape(1) if a.ndim == 0 else a for a in arrays]  # 0-d as [1]
    # host results land in buffers aligned as TensorFlow's own, which it can then take without a copy
    into = [_aligned_empty(f.shape, f.dtype) for f in flat] \
        if not int_avg and all(isinstance(a, np.ndarray) for a in arrays) else None
    handles = rt.coordinator.submit_group(names, flat, "sum" if int_avg else op, outs=into, group=group)
    outs = [h.wait() for h in handles]
    if int_avg:  # (on a GPU these are CuPy kernels on CuPy's current stream: queued before the wait below)
        outs = [integer_average(o, rt.topology.size) for o in outs]  # (flat: a 0-d one would be a numpy scalar)
    outs = [o.reshape(shape) for o, shape in zip(outs, shapes)]
    if any(not isinstance(o, np.ndarray) for o in outs):
        # GPU results: the call's kernels are queued on the engine's stream, and CuPy's current stream
        # waits for them, but TF's streams do not (TF creates them non-blocking).  Wait here, before TF
        # reads the results and frees the inputs (the engine's kernels read them until they finish).
        import cupy

        for device in sorted({o.device.id for o in outs if not isinstance(o, np.ndarray)}):
            with cupy.cuda.Device(device):  # the results' GPU's stream, not this thread's current GPU's
                cupy.cuda.get_current_stream().synchronize()
    return outs


# TensorFlow's kernels assume a tensor's data aligned to this many bytes (64 covers every build's
# Eigen); a tensor made on a less aligned buffer aborts the process in the first kernel that reads it
_TF_ALIGN = 64


class _HostExport:
    """A host tensor offered to numpy through DLPack: numpy reads TensorFlow's buffer in place."""

    def __init__(self, t: tf.Tensor) -> None:
        self.t = t

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return tf.experimental.dlpack.to_dlpack(self.t)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a ``_TF_ALIGN`` boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _TF_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _TF_ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _to_engine(t: tf.Tensor) -> Any:
    """A GPU tensor as a CuPy array on the same memory (DLPack, no copy), so the engine reduces it
    on the device; a host tensor as a read-only numpy view of its buffer (DLPack, no copy: the engine
    reads its inputs and writes its results elsewhere), or a copy where DLPack cannot carry it
    (bfloat16, an empty tensor)."""
    # backing_device: where the memory is (TF keeps int32 in host memory even for a GPU op's output)
    where = getattr(t, "backing_device", None) or t.device or ""
    if "GPU" in where.upper() and t.dtype != tf.bfloat16:
        import cupy

        _check_dlpack_device(where)
        return cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(t))
    if t.dtype != tf.bfloat16:  # (numpy's DLPack has no bfloat16)
        try:
            return np.from_dlpack(_HostExport(t))
        except (BufferError, RuntimeError, TypeError, ValueError, tf.errors.InvalidArgumentError):
            pass  # a dtype DLPack cannot carry: a copy, whose dtype the engine then accepts or refuses
    return np.asarray(t.numpy())  # 0-d tensors give numpy scalars: make them arrays


@functools.lru_cache(maxsize=1)
def _physical_gpus() -> tuple[int, ...]:
    """The CUDA device of each of TF's logical GPUs, in TF's order: the visible physical GPUs, each as
    many times as it has logical (virtual) devices.  Read once (TF fixes them when its runtime starts,
    before any GPU tensor exists)."""
    out: list[int] = []
    for device in tf.config.get_visible_devices("GPU"):
        virtual = tf.config.get_logical_device_configuration(device)
        out += [int(device.name.rsplit(":", 1)[1])] * max(1, len(virtual or []))
    return tuple(out)


def _check_dlpack_device(where: str) -> None:
    """TF's DLPack names a GPU by TF's *logical* index, and reads one back the same way, while CuPy and
    CUDA use the device's ordinal: they agree only when TF's logical GPU L is CUDA device L.  With
    ``tf.config.set_visible_devices(gpus[local_rank], "GPU")`` they do not (rank 1's tensors on CUDA
    device 1 would be labelled device 0): refuse that with what to do instead, rather than reduce
    another GPU's memory."""
    try:
        logical = int(where.rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return
    physical = _physical_gpus()
    if logical < len(physical) and physical[logical] != logical:
        from ..errors import TunelabError

        raise TunelabError(
            f"TensorFlow's GPU:{logical} is CUDA device {physical[logical]}: tunelab hands GPU tensors over "
            "by DLPack, which names TensorFlow's logical device, so it cannot reduce them when TensorFlow's "
            "visible GPUs are restricted (tf.config.set_visible_devices) or split into virtual devices; "
            "give each rank its GPU with CUDA_VISIBLE_DEVICES=<local rank> instead (TensorFlow then sees it "
            "as GPU:0)")


def _from_engine(a: Any) -> Any:
    """A result as TensorFlow takes it: a host array aligned as its tensors are, as a tensor on the same
    memory (DLPack, no copy); any other host array as it is (TensorFlow copies it); a CuPy array as a
    GPU tensor on the same memory."""
    if isinstance(a, np.ndarray):
        if a.size and a.dtype.kind in "biufc" and a.flags.c_contiguous and a.ctypes.data % _TF_ALIGN == 0:
            try:
                return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
            except (BufferError, RuntimeError, TypeError, ValueError, tf.errors.InvalidArgumentError):
                pass
        return a
    return tf.experimental.dlpack.from_dlpack(a.toDlpack())  # back to a TF GPU tensor, no copy


def py_function(fn: Any, inputs: list[Any], types: Any, what: str) -> Any:
    """``tf.py_function`` for a graph being traced, refused with one line where XLA compiles that graph
    (a ``tf.function(jit_compile=True)``, or a Keras model compiled with ``jit_compile=True`` or left at
    its default ``"auto"``, which Keras turns into XLA on a host with a GPU): XLA cannot compile a Python
    op, and fails at the first step with a page about the op it could not convert."""
    try:
        from tensorflow.python.framework import ops as tf_ops
        from tensorflow.python.ops import control_flow_util
        xla = control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph())
    except (ImportError, AttributeError):  # (a TensorFlow without these internals: XLA says it, later)
        xla = False
    if xla:
        from ..errors import UsageError

        raise UsageError(f"{what} cannot run in a function XLA compiles: tunelab's collectives are Python ops "
                         "(tf.py_function). Compile the Keras model with jit_compile=False (on a host with a "
                         "GPU, Keras's default jit_compile=\"auto\" turns XLA on), or leave jit_compile=True "
                         "off the tf.function that calls them")
    return tf.py_function(fn, inputs, types)


def _py_collective(fn: Any, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """Run ``fn(list of arrays) -> list of arrays`` as one op, eager or in a graph: numpy arrays for
    host tensors, CuPy arrays (zero-copy, reduced on the device) for GPU tensors.  Eagerly it runs
    right away, so errors reach the caller as tunelab raised them (in a graph TF wraps them)."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(_from_engine(a)) for a in fn([_to_engine(t) for t in tensors])]
    outs = py_function(lambda *ts: [_from_engine(a) for a in fn([_to_engine(t) for t in ts])], tensors,
                       [t.dtype for t in tensors], "an allreduce")
    for o, t in zip(outs, tensors):
        o.set_shape(t.shape)
    return list(outs)


def _grouped(tensors: list[tf.Tensor], base: str, how: str, compression: type, grouped: bool,
             positions: Sequence[int] | None = None) -> list[tf.Tensor]:
    packed = [compression.compress(t) for t in tensors]
    names = [f"{base}.{i}" for i in (range(len(tensors)) if positions is None else positions)]
    reduced = _py_collective(lambda arrays: _reduce_numpy(names, arrays, how, base if grouped else None),
                             [p for p, _ in packed])
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, packed)]


@tf.autograph.experimental.do_not_convert
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                      op: str | None = None, compression: type = Compression.none,
                      grouped: bool = True, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, *, positions: Sequence[int] | None = None,
                      device_dense: str = "", device_sparse: str = "", ignore_name_scope: bool = False) -> list[tf.Tensor]:
    """Allreduce several tensors in one request (as one group unless ``grouped=False``), each times
    ``prescale_factor`` before and its result times ``postscale_factor`` after.  Differentiable: the
    gradient of each output is the same reduction of its incoming gradient, with the same factors.
    ``positions``: each tensor's number in its name (``name.<position>``; default 0, 1, ...): a
    gradient list with gaps keeps every gradient's own name.  ``device_dense``, ``device_sparse``,
    ``ignore_name_scope``: Horovod's, accepted by keyword and unused."""
    if not tensors:
        return []
    base = name or auto_name("tf.allreduce")
    how = resolve_op(op, average)
    pre, post = scale_factors(prescale_factor, postscale_factor)
    dense = [_scale(tf.convert_to_tensor(t), pre) for t in tensors]  # IndexedSlices become dense here
    floating = [t.dtype.is_floating for t in dense]
    if post != 1.0 and how == "average" and not any(floating):
        # Horovod's integer average takes the postscale into its factor (postscale / size, one truncation)
        size = _rt.current().topology.size
        return [_scale(r, post / size) for r in grouped_allreduce(dense, None, base, "sum", compression, grouped,
                                                                  positions=positions)]
    if pre != 1.0 or post != 1.0:  # (the factors around the reduction: TF differentiates them itself)
        return [_scale(r, post) for r in grouped_allreduce(dense, None, base, how, compression, grouped,
                                                           positions=positions)]
    if not any(floating):
        return _grouped(dense, base, how, compression, grouped, positions)

    @tf.custom_gradient
    def reduce(*xs: tf.Tensor) -> Any:
        def grad(*dys: Any) -> list[Any]:
            # the floating tensors' gradients (integers have none: a group may hold both)
            dys = [tf.zeros_like(x) if d is None else tf.convert_to_tensor(d)
                   for d, x, f in zip(dys, xs, floating) if f]
            kept = None if positions is None else [p for p, f in zip(positions, floating) if f]
            reduced = iter(_grouped(dys, f"{base}.grad", how, Compression.none, grouped, kept))
            return [next(reduced) if f else None for f in floating]

        return _grouped(list(xs), base, how, compression, grouped, positions), grad

    return list(reduce(*dense))


def auto_name(kind: str) -> str:
    """A name for an unnamed collective.  Eagerly, the runtime's sequence (the same on every rank that
    makes the same calls).  While a ``tf.function`` is traced, the graph's own unique name for it (as
    Horovod names by op): a trace numbers its collectives alike on every rank, so a rank that traces
    the step again (a last, smaller batch) keeps the names the others' earlier trace runs with; the
    runtime's sequence would give it new ones, and every later unnamed call would stall."""
    if not tf.inside_function():
        return _rt.current().auto_name(kind)
    graph = tf.compat.v1.get_default_graph()
    return f"{kind}.graph.{graph.unique_name(kind.replace('.', '_'), mark_as_used=True)}"


def _scale(t: tf.Tensor, factor: float) -> tf.Tensor:
    """``t`` times ``factor``: integers through float64, truncated (as torch's, and Horovod's)."""
    if factor == 1.0:
        return t
    if t.dtype in (tf.float16, tf.bfloat16):  # (the factor itself in float32: 0.1 is not 0.09998)
        return tf.cast(tf.cast(t, tf.float32) * factor, t.dtype)
    if t.dtype.is_floating:
        return t * tf.cast(factor, t.dtype)
    return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)


@tf.autograph.experimental.do_not_convert
def allreduce(tensor: Any, average: bool | None = None, name: str | None = None, op: str | None = None,
              compression: type = Compression.none, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, *, device_dense: str = "", device_sparse: str = "",
              ignore_name_scope: bool = False) -> tf.Tensor:
    """Allreduce one tensor (see :func:`grouped_allreduce`); ``IndexedSlices`` are gathered, as Horovod
    does, into ``IndexedSlices`` of every rank's rows (averaged values divided by ``size()``).
    ``device_dense``, ``device_sparse``, ``ignore_name_scope``: Horovod's, accepted by keyword and unused
    (tunelab reduces tensors where they live, and names them by ``name`` alone)."""
    if isinstance(tensor, tf.IndexedSlices):
        how = resolve_op(op, average)
        if how not in (Average, Sum):
            raise ValueError(f"IndexedSlices are reduced by sum or average, not {how}")
        pre, post = scale_factors(prescale_factor, postscale_factor)
        rows = tf.IndexedSlices(_scale(tensor.values, pre), tensor.indices, dense_shape=tensor.dense_shape)
        out = allreduce_indexed_slices(rows, name or auto_name("tf.allreduce"), how)
        return tf.IndexedSlices(_scale(out.values, post), out.indices, dense_shape=out.dense_shape)
    return grouped_allreduce([tensor], average, name or auto_name("tf.allreduce"), op,
                             compression, grouped=False, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)[0]


def _allgather_rows(t: tf.Tensor, what: str) -> tuple[tf.Tensor, Any, Any]:
    """The gathered tensor, and where this rank's rows start in it and how many there are."""
    def gather(x: Any) -> list[Any]:
        rt = _rt.current()
        out, rows = rt.allgatherv(np.asarray(x.numpy()), what)
        r = rt.topology.rank
        return [out, np.int64(sum(rows[:r])), np.int64(rows[r])]

    if tf.executing_eagerly():
        out, start, count = gather(t)
        return tf.convert_to_tensor(out), int(start), int(count)
    out, start, count = py_function(gather, [t], [t.dtype, tf.int64, tf.int64], f"the allgather of {what}")
    out.set_shape([None, *t.shape[1:]])
    return out, start, count


@tf.autograph.experimental.do_not_convert
def allgather(tensor: Any, name: str | None = None) -> tf.Tensor:
    """Concatenate every rank's tensor along axis 0 (first dims may differ).  Differentiable (floating
    dtypes): the gradient is this rank's rows of the averaged incoming gradient, as in Horovod."""
    t = tf.convert_to_tensor(tensor)
    base = name or auto_name("tf.allgather")
    if not t.dtype.is_floating:
        return _allgather_rows(t, base)[0]

    @tf.custom_gradient
    def gather(x: tf.Tensor) -> Any:
        out, start, count = _allgather_rows(x, base)

        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = allreduce(tf.convert_to_tensor(dy), op=Average, name=f"{base}.grad")
            return tf.reshape(reduced[start:start + count], tf.shape(x))

        return out, grad

    return gather(t)


def _alltoall_rows(t: tf.Tensor, splits: tf.Tensor | None, what: str) -> tuple[tf.Tensor, tf.Tensor]:
    """The rows received (in rank order) and how many came from each rank (int32)."""
    def exchange(x: Any, *plan: Any) -> list[Any]:
        sizes = [int(s) for s in np.asarray(plan[0]).reshape(-1)] if plan else None
        out, received = _rt.current().alltoall(np.asarray(x.numpy()), sizes, what)
        return [out, np.asarray(received, dtype=np.int32)]

    args = [t] if splits is None else [t, splits]
    if tf.executing_eagerly():
        out, received = exchange(*args)
        return tf.convert_to_tensor(out), tf.convert_to_tensor(received)
    out, received = py_function(exchange, args, [t.dtype, tf.int32], f"the alltoall of {what}")
    out.set_shape([None, *t.shape[1:]])
    received.set_shape([_rt.current().topology.size])
    return out, received


@tf.autograph.experimental.do_not_convert
def alltoall(tensor: Any, splits: Any = None, name: str | None = None) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` (dim 0, in order; equal parts without ``splits``) to rank i.
    Returns the rows received, in rank order; with ``splits`` given, also an int32 tensor of how many
    rows came from each rank (as ``tunelab.torch.alltoall``).  A plan that is wrong on any rank raises
    on every rank.  Differentiable (floating dtypes): the gradient goes back the way the data came."""
    t = tf.convert_to_tensor(tensor)
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    plan = None if splits is None else tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int64)
    base = name or auto_name("tf.alltoall")
    if not t.dtype.is_floating:
        out, received = _alltoall_rows(t, plan, base)
    else:
        @tf.custom_gradient
        def exchange(x: tf.Tensor) -> Any:
            out, received = _alltoall_rows(x, plan, base)

            def grad(dy: Any, _dcounts: Any = None) -> tf.Tensor:  # (the counts take no gradient)
                dy = tf.zeros_like(out) if dy is None else tf.convert_to_tensor(dy)
                back, _ = _alltoall_rows(dy, tf.cast(received, tf.int64), f"{base}.grad")
                return tf.reshape(back, tf.shape(x))

            return (out, received), grad

        out, received = exchange(t)
    return out if splits is None else (out, received)


def _my_rows(total: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """This rank's (start, count) of ``total`` rows split as Horovod splits them: ``total // size()``
    each, the first ``total % size()`` ranks one more (as ``tunelab.torch.reducescatter``)."""
    topo = _rt.current().topology
    base, extra = total // topo.size, total % topo.size
    start = topo.rank * base + tf.minimum(tf.cast(topo.rank, total.dtype), extra)
    return start, base + tf.cast(topo.rank < extra, total.dtype)


@tf.autograph.experimental.do_not_convert
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "", compression: type = Compression.none,
                          op: str | None = Average, process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, *, name: str | None = None) -> list[tf.Tensor]:
    """Reduce each tensor over all ranks (Sum or Average) and keep this rank's rows of dim 0, split as
    Horovod does; one grouped request.  Differentiable (floating dtypes): the gradient of a rank's rows
    is every rank's incoming gradient gathered back in rank order (divided by ``size()`` for Average).
    Horovod's signature in its order (``device_dense``: accepted and unused; ``process_set``: the global
    one only; each tensor times ``prescale_factor`` before, its rows times ``postscale_factor`` after);
    ``name`` by keyword."""
    check_process_set(process_set)
    how = resolve_op(op)
    if how not in ("sum", "average"):
        raise ValueError(f"reducescatter supports Sum and Average, got {how!r}")
    pre, post = scale_factors(prescale_factor, postscale_factor)
    if pre != 1.0 or post != 1.0:  # (the factors around the reduction: TF differentiates them itself)
        return [_scale(r, post) for r in grouped_reducescatter([_scale(tf.convert_to_tensor(t), pre) for t in tensors],
                                                               compression=compression, op=how, name=name)]
    dense = [tf.convert_to_tensor(t) for t in tensors]
    if any(t.shape.rank == 0 for t in dense):
        raise ValueError("reducescatter needs tensors with at least one dimension")
    if not dense:
        return []
    base = name or auto_name("tf.reducescatter")

    def scatter(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = _grouped(xs, base, how, compression, grouped=True)
        out = []
        for r in reduced:
            start, count = _my_rows(tf.shape(r, out_type=tf.int64)[0])
            out.append(r[start:start + count])
        return out

    if not all(t.dtype.is_floating for t in dense):
        return scatter(dense)

    @tf.custom_gradient
    def differentiable(*xs: tf.Tensor) -> Any:
        def grad(*dys: Any) -> list[tf.Tensor]:
            back = []
            for i, (d, x) in enumerate(zip(dys, xs)):
                d = tf.zeros_like(outs[i]) if d is None else tf.convert_to_tensor(d)
                gathered = _allgather_rows(d, f"{base}.grad.{i}")[0]
                if how == "average":
                    gathered = gathered / tf.cast(_rt.current().topology.size, gathered.dtype)
                back.append(tf.reshape(gathered, tf.shape(x)))
            return back

        outs = scatter(list(xs))
        return outs, grad

    return list(differentiable(*dense))


@tf.autograph.experimental.do_not_convert
def reducescatter(tensor: Any, device_dense: str = "", compression: type = Compression.none, op: str | None = Average,
                  name: str | None = None, process_set: Any = None, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """:func:`grouped_reducescatter` of one tensor.  Horovod's signature in its order (``device_dense``,
    ``ignore_name_scope``: accepted and unused; a second positional argument is not the op;
    ``process_set``: the global one only)."""
    return grouped_reducescatter([tensor], compression=compression, op=op, process_set=process_set,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 name=name or auto_name("tf.reducescatter"))[0]


def _broadcast(t: tf.Tensor, root_rank: int, what: str) -> tf.Tensor:
    def bcast(arrays: list[Any]) -> list[np.ndarray]:
        first = arrays[0]
        a = np.array(first if isinstance(first, np.ndarray) else first.get(), order="C")  # a copy; 0-d kept
        _rt.current().broadcast_(a, root_rank, what)
        return [a]

    return _py_collective(bcast, [t])[0]


@tf.autograph.experimental.do_not_convert
def broadcast(tensor: Any, root_rank: int, name: str | None = None) -> tf.Tensor:
    """``root_rank``'s tensor on every rank.  Differentiable (floating dtypes): the gradient is the
    averaged incoming gradient on the root and zero elsewhere, as in Horovod."""
    t = tf.convert_to_tensor(tensor)
    base = name or auto_name("tf.broadcast")
    if not t.dtype.is_floating:
        return _broadcast(t, root_rank, base)

    @tf.custom_gradient
    def bcast(x: tf.Tensor) -> Any:
        def grad(dy: tf.Tensor) -> tf.Tensor:
            reduced = allreduce(tf.convert_to_tensor(dy), op=Average, name=f"{base}.grad")
            return reduced if _rt.current().topology.rank == root_rank else tf.zeros_like(reduced)

        return _broadcast(x, root_rank, base), grad

    return bcast(t)


@tf.autograph.experimental.do_not_convert
def broadcast_variables(variables: Sequence[Any], root_rank: int) -> None:
    """Assign root's values to ``variables`` on every rank, eagerly or inside a ``tf.function``
    (optimizer variables included, such as its int64 iteration counter)."""
    variables = list(variables)
    _rt.current().check_same([tuple(v.shape) for v in variables], "the shapes of the variables to broadcast")
    for i, v in enumerate(variables):
        # (by place: a variable's name is not the same on every rank under Keras, whose names count the
        # layers a process made, and ranks agree on a broadcast's name; the shapes were checked above)
        v.assign(broadcast(v, root_rank, name=f"variable.{i}"))


def allreduce_indexed_slices(grad: tf.IndexedSlices, name: str, op: str) -> tf.IndexedSlices:
    """Horovod's reduction of sparse gradients: every rank's (index, value) rows, gathered; averaged
    values are divided by ``size()``.  Rows with the same index add up when applied."""
    values = allgather(grad.values, name=f"{name}.values")
    indices = allgather(grad.indices, name=f"{name}.indices")
    if op == Average:
        values = values / tf.cast(_rt.current().topology.size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=grad.dense_shape)


def reduce_gradients(grads: list[Any], name: str, op: str, compression: type,
                     sparse_as_dense: bool, predivide: float = 1.0) -> list[Any]:
    """Allreduce a list of gradients (None kept): dense ones in one request, IndexedSlices by allgather
    unless ``sparse_as_dense``; with ``predivide`` f (Horovod's ``gradient_predivide_factor``), dense
    ones divided by f and summed, the sum times f / size.  One rank in all: each gradient is its own allreduce (a sum or an
    average over one rank), so it is returned as it is (dense where asked) without a request."""
    if _rt.current().topology.size == 1:
        return [tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
                for g in grads]
    out = list(grads)
    dense = [i for i, g in enumerate(grads) if g is not None and
             (sparse_as_dense or not isinstance(g, tf.IndexedSlices))]
    # each gradient named by its place in the whole list: a gradient that is None on some ranks only (a
    # branch taken on one rank) leaves a gap there, rather than shifting every later name onto another
    # gradient (which reduced one rank's c with another's b, silently)
    # (with a predivide factor f, as Horovod: a sum of g / f, times f / size after; an average of g / f
    # would divide float16 addends by size too, before the sum, and lose the small ones)
    how, post = (op, 1.0) if predivide == 1.0 else (Sum, predivide / _rt.current().topology.size)
    reduced = grouped_allreduce([grads[i] for i in dense], name=name, op=how, compression=compression,
                                grouped=False, prescale_factor=1.0 / predivide, postscale_factor=post,
                                positions=dense)
    for i, r in zip(dense, reduced):
        out[i] = r
    for i, g in enumerate(grads):
        if isinstance(g, tf.IndexedSlices) and not sparse_as_dense:
            out[i] = allreduce_indexed_slices(g, f"{name}.sparse{i}", op)
    return out


@tf.autograph.experimental.do_not_convert
def join() -> Any:
    """Declare that this rank has no more batches (uneven data, as in Horovod).  Until every rank has
    joined, this rank contributes zeros to the allreduces the others still run (their averages still
    divide by ``size()``), then it returns the rank that joined last: an ``int`` eagerly, an int32
    scalar tensor inside a ``tf.function``.  Only the allreduce family runs while ranks are joined
    (host tensors): call allgather, broadcast or barrier before joining or after ``join`` returns."""
    def wait() -> Any:
        return np.int32(_rt.current().coordinator.join())

    if tf.executing_eagerly():
        return int(wait())
    last = py_function(wait, [], tf.int32, "join()")
    last.set_shape([])
    return last
