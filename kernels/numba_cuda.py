"""GPU kernels written with ``numba.cuda``: batched copy, scale-copy, N-way reduce, scale, half casts.

Like the CPU back end, kernels work on raw addresses (device pointers): one launch packs a whole
fusion bucket from a table of ``(src, dst, nbytes)`` rows, a reduce reads straight from peers' buffers.
Memory is touched only through a few primitives (``_ld``, ``_st``, ``_cp1``..``_cp16``) whose
Python bodies work on host addresses: that is what the CUDA simulator runs, so indexing, alignment
and rounding are testable without a GPU; on a device each becomes an LLVM intrinsic.  Half types are
uint16 bits converted by the CPU back end's own functions (compiled for CUDA), so results agree bit
for bit.
``numba.cuda`` is imported on first construction only: it is slow to import and probes the driver.
"""

from __future__ import annotations

import ctypes
import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import config as numba_config
from numba.extending import register_jitable

from ._lowlevel import bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16
from .base import (
    DeviceArrayOps,
    DeviceTable,
    ReduceOp,
    as_sources,
    check_factor,
    check_pre,
    cuda_array_address,
    half_kind,
)

cuda: Any = None  # the numba.cuda module, bound by _kernels(); kernels refer to it as a global

_UNROLL = 4  # grid sizing: each thread handles about this many words per pass


# ---- memory primitives: Python bodies for the simulator, intrinsics on a device ----------------

def _ld(addr, idx, like):
    """Element ``idx`` of the array of ``type(like)`` that starts at address ``addr``."""
    dt = np.dtype(type(like))
    return np.frombuffer(ctypes.string_at(int(addr) + int(idx) * dt.itemsize, dt.itemsize), dt)[0]


def _st(addr, idx, value, like):
    """Store ``value`` (converted to ``type(like)``, wrapping integers) at element ``idx`` of ``addr``."""
    dt = np.dtype(type(like))
    with np.errstate(over="ignore"):
        raw = np.array(value).astype(dt).tobytes()
    ctypes.memmove(int(addr) + int(idx) * dt.itemsize, raw, dt.itemsize)


def _copier(width: int):
    def copy(src, dst, idx):
        ctypes.memmove(int(dst) + int(idx) * width, int(src) + int(idx) * width, width)

    copy.__name__ = copy.__qualname__ = f"_cp{width}"  # copies word ``idx`` of ``width`` bytes
    return copy


_cp1, _cp4, _cp8, _cp16 = (_copier(w) for w in (1, 4, 8, 16))


# ---- arithmetic shared by the simulator and the device (register_jitable: plain Python too) ----

@register_jitable
def _combine(a, b, op):
    if op == 0:
        return a + b
    if op == 1:
        return b if (b != b or b < a) else a  # noqa: PLR0124  (nan wins, as in numpy.minimum)
    return b if (b != b or b > a) else a  # noqa: PLR0124


@register_jitable
def _half_to_f32(h, kind):
    """fp16 (kind 1) or bf16 (kind 2) bits -> float32: the CPU back end's own conversion, compiled for CUDA."""
    return np.float32(f16_to_f32(h) if kind == 1 else bf16_to_f32(h))  # (float32 in Python too)


@register_jitable
def _f32_to_half(x, kind):
    """float32 -> fp16 (kind 1) or bf16 (kind 2) bits, round to nearest even, as on the CPU."""
    return f32_to_f16(x) if kind == 1 else f32_to_bf16(x)


@register_jitable
def _common_width(src, dst):
    """Widest word (16/8/4/1 bytes) in which ``src`` and ``dst`` can both be aligned together."""
    diff = src - dst
    if diff % 16 == 0:
        return 16
    if diff % 8 == 0:
        return 8
    if diff % 4 == 0:
        return 4
    return 1


# ---- kernels (jitted by _kernels) ----------------------------------------------------------------

def _copy_rows(rows):
    """One launch for a whole table: grid y strides over rows, grid x over the words of a row."""
    first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    for r in range(cuda.blockIdx.y, rows.shape[0], cuda.gridDim.y):
        src, dst, n = rows[r, 0], rows[r, 1], rows[r, 2]
        width = _common_width(src, dst)
        head = (width - src % width) % width  # bytes before both are word aligned
        if head > n:  # noqa: PLR1730  (builtin min fails to compile for CUDA on mixed int kinds)
            head = n
        words = (n - head) // width
        for i in range(first, head, step):
            _cp1(src, dst, i)
        s, d = src + head, dst + head
        if width == 16:
            for i in range(first, words, step):
                _cp16(s, d, i)
        elif width == 8:
            for i in range(first, words, step):
                _cp8(s, d, i)
        elif width == 4:
            for i in range(first, words, step):
                _cp4(s, d, i)
        else:
            for i in range(first, words, step):
                _cp1(s, d, i)
        for i in range(head + words * width + first, n, step):
            _cp1(src, dst, i)


def _scale_rows(rows, factor):
    first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    for r in range(cuda.blockIdx.y, rows.shape[0], cuda.gridDim.y):
        src, dst, n = rows[r, 0], rows[r, 1], rows[r, 2]
        for i in range(first, n, step):
            _st(dst, i, _ld(src, i, factor) * factor, factor)


def _scale_rows_half(rows, factor, kind):
    bits = np.uint16(0)
    first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    for r in range(cuda.blockIdx.y, rows.shape[0], cuda.gridDim.y):
        src, dst, n = rows[r, 0], rows[r, 1], rows[r, 2]
        for i in range(first, n, step):
            _st(dst, i, _f32_to_half(_half_to_f32(_ld(src, i, bits), kind) * factor, kind), bits)


def _reduce(out, srcs, n, like, op):
    # Each element is read from every source before the same thread writes it: ``out`` may alias any.
    k = srcs.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        acc = _ld(srcs[0], i, like)
        for j in range(1, k):
            acc = _combine(acc, _ld(srcs[j], i, like), op)
        _st(out, i, acc, like)


def _reduce_half(out, srcs, n, kind, op):
    bits = np.uint16(0)
    k = srcs.shape[0]
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        acc = _half_to_f32(_ld(srcs[0], i, bits), kind)
        for j in range(1, k):
            acc = _combine(acc, _half_to_f32(_ld(srcs[j], i, bits), kind), op)
        _st(out, i, _f32_to_half(acc, kind), bits)


def _widen(src, dst, n, kind):
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        _st(dst, i, _half_to_f32(_ld(src, i, np.uint16(0)), kind), np.float32(0))


def _narrow(src, dst, n, kind):
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        _st(dst, i, _f32_to_half(_ld(src, i, np.float32(0)), kind), np.uint16(0))


def _reduce_bcast(table, nsrc, ndst, like, op, factor, scaled):
    """Row r of ``table``: count, ``nsrc`` source addresses, ``ndst`` destination addresses.  Each
    element is combined from every source (in order), scaled when ``scaled``, and written to every
    destination: one pass that reads every rank's input and writes every rank's output."""
    first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    for r in range(cuda.blockIdx.y, table.shape[0], cuda.gridDim.y):
        n = table[r, 0]
        for i in range(first, n, step):
            acc = _ld(table[r, 1], i, like)
            for j in range(1, nsrc):
                acc = _combine(acc, _ld(table[r, 1 + j], i, like), op)
            if scaled:
                acc = acc * factor
            for j in range(ndst):
                _st(table[r, 1 + nsrc + j], i, acc, like)


def _reduce_bcast_half(table, nsrc, ndst, kind, op, pre, factor, scaled):
    bits = np.uint16(0)
    first = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    for r in range(cuda.blockIdx.y, table.shape[0], cuda.gridDim.y):
        n = table[r, 0]
        for i in range(first, n, step):
            # pre (a power of two, the part of an average taken before the sum, so that a float16 sum
            # past 65504 does not become inf) scales each source, rounded to the half type as the
            # staged path's packing rounds it; the sum rounds once, then scales as unpacking does
            acc = _half_to_f32(_ld(table[r, 1], i, bits), kind)
            if pre != 1.0:
                acc = _half_to_f32(_f32_to_half(acc * pre, kind), kind)
            for j in range(1, nsrc):
                v = _half_to_f32(_ld(table[r, 1 + j], i, bits), kind)
                if pre != 1.0:
                    v = _half_to_f32(_f32_to_half(v * pre, kind), kind)
                acc = _combine(acc, v, op)
            h = _f32_to_half(acc, kind)
            if scaled:
                h = _f32_to_half(_half_to_f32(h, kind) * factor, kind)
            for j in range(ndst):
                _st(table[r, 1 + nsrc + j], i, h, bits)


_KERNELS = (_copy_rows, _scale_rows, _scale_rows_half, _reduce, _reduce_half, _widen, _narrow,
            _reduce_bcast, _reduce_bcast_half)


# ---- device implementations of the memory primitives (typing + LLVM codegen for @intrinsic) ----

def _element_ptr(context, builder, addr, addr_ty, idx, idx_ty, pointee):
    """``&((pointee*)addr)[idx]`` in the generic address space."""
    from numba import types

    base = builder.inttoptr(context.cast(builder, addr, addr_ty, types.int64), pointee.as_pointer())
    return builder.gep(base, [context.cast(builder, idx, idx_ty, types.int64)])


def _ld_typer(typingctx, addr, idx, like):
    from numba import types

    like = types.unliteral(like)

    def codegen(context, builder, sig, args):
        pointee = context.get_value_type(like)
        return builder.load(_element_ptr(context, builder, args[0], sig.args[0], args[1], sig.args[1], pointee))

    return like(addr, idx, like), codegen


def _st_typer(typingctx, addr, idx, value, like):
    from numba import types

    like = types.unliteral(like)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, args[0], sig.args[0], args[1], sig.args[1],
                           context.get_value_type(like))
        builder.store(context.cast(builder, args[2], sig.args[2], like), ptr)
        return context.get_dummy_value()

    return types.void(addr, idx, value, like), codegen


def _copy_typer(width: int):
    """Typer of a ``width``-byte word copy; 16 bytes move as one <4 x i32> (a single 128-bit access)."""
    from llvmlite import ir
    from numba import types

    word = ir.VectorType(ir.IntType(32), 4) if width == 16 else ir.IntType(8 * width)

    def typer(typingctx, src, dst, idx):
        def codegen(context, builder, sig, args):
            s = _element_ptr(context, builder, args[0], sig.args[0], args[2], sig.args[2], word)
            d = _element_ptr(context, builder, args[1], sig.args[1], args[2], sig.args[2], word)
            builder.store(builder.load(s, align=width), d, align=width)
            return context.get_dummy_value()

        return types.void(src, dst, idx), codegen

    typer.__name__ = f"cp{width}"
    return typer


def _register_device_primitives() -> None:
    """Give every memory primitive its CUDA implementation (once per process)."""
    from numba.core.extending import overload
    from numba.cuda.extending import intrinsic

    # Overload typing and implementation signatures must match by name, hence one adapter per arity.
    adapters = {
        3: lambda i: lambda a, b, c: (lambda a, b, c: i(a, b, c)),
        4: lambda i: lambda a, b, c, d: (lambda a, b, c, d: i(a, b, c, d)),
    }
    impls = [(_ld, _ld_typer, 3), (_st, _st_typer, 4)]
    impls += [(fn, _copy_typer(w), 3) for fn, w in ((_cp1, 1), (_cp4, 4), (_cp8, 8), (_cp16, 16))]
    for python_fn, typer, arity in impls:
        overload(python_fn, target="cuda")(adapters[arity](intrinsic(typer)))


@functools.lru_cache(maxsize=1)
def _kernels() -> SimpleNamespace:
    """Import numba.cuda, check for a device and jit the kernels (compiled on first launch)."""
    global cuda
    from numba import cuda as numba_cuda

    if not numba_cuda.is_available():
        raise RuntimeError("the numba-cuda kernel back end needs a CUDA device and driver; none was found")
    cuda = numba_cuda
    if not numba_config.ENABLE_CUDASIM:
        _register_device_primitives()
    return SimpleNamespace(**{fn.__name__.lstrip("_"): cuda.jit(fn) for fn in _KERNELS})


# ---- host side ---------------------------------------------------------------------------------

def _device_address(array: Any) -> tuple[int, np.dtype, int]:
    """(address, element type, count) of a C-contiguous device array.

    Any ``__cuda_array_interface__`` exporter (CuPy, numba, PyTorch) works on a device.  Under the
    simulator device memory is host memory, so numpy arrays and simulated device arrays work too.
    """
    found = cuda_array_address(array, "numba-cuda")
    if found is not None:
        return found
    host = getattr(array, "_ary", array)  # a simulated device array wraps a numpy array
    if isinstance(host, np.ndarray) and numba_config.ENABLE_CUDASIM:
        if not host.flags.c_contiguous:
            raise ValueError("numba-cuda kernels need C-contiguous arrays")
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16) if host.dtype == np.uint16 else host.dtype
        return host.ctypes.data, dtype, host.size
    raise TypeError(f"expected a device array (__cuda_array_interface__), got {type(array).__name__}")


class NumbaCudaBackend(DeviceArrayOps):
    """:class:`kernels.base.KernelBackend` on a CUDA device, kernels written with ``numba.cuda``.

    Addresses are device pointers.  Launches go to ``stream`` (default: the default stream) and
    return without waiting.  Tables may be host arrays (uploaded for that launch) or
    :class:`DeviceTable` s uploaded once with :meth:`upload_table`.  ``block`` and ``max_blocks``
    shape every launch (tests under the simulator use tiny grids).
    """

    name = "numba-cuda"

    def _device_address(self, array: Any) -> tuple[int, np.dtype, int]:
        return _device_address(array)

    def __init__(self, block: int = 256, max_blocks: int = 4096) -> None:
        self._k = _kernels()
        self._block = int(block)
        self._max_blocks = max(1, int(max_blocks))

    def set_threads(self, n: int) -> None:
        """Host threads do not apply to device kernels; kept for the common interface."""

    def synchronize(self) -> None:
        """Wait for all work on the device (every stream's)."""
        cuda.synchronize()

    # ---- streams, events, tables ---------------------------------------------------------------
    def use_device(self, index: int) -> None:
        """Make device ``index`` current for the calling thread (each thread has its own)."""
        if numba_config.ENABLE_CUDASIM:
            return
        if cuda.get_current_device().id != index:
            cuda.select_device(index)

    def new_stream(self) -> Any:
        return cuda.stream()

    def stream_sync(self, stream: Any) -> None:
        stream.synchronize()

    def new_event(self) -> Any:
        return cuda.event() if numba_config.ENABLE_CUDASIM else cuda.event(timing=False)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream=stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        event.wait(stream=stream)

    def event_sync(self, event: Any) -> None:
        event.synchronize()

    def external_stream(self, handle: int) -> Any:
        """A stream another library created (its raw ``cudaStream_t``; 0: the legacy default)."""
        if numba_config.ENABLE_CUDASIM:
            return 0
        return cuda.default_stream() if handle == 0 else cuda.external_stream(handle)

    def device_id(self) -> str:
        """Which physical GPU this process uses (PCI location): ranks with equal ids share one."""
        if numba_config.ENABLE_CUDASIM:
            return "simulated"
        dev = cuda.get_current_device()
        return f"{dev.PCI_DOMAIN_ID:04x}:{dev.PCI_BUS_ID:02x}:{dev.PCI_DEVICE_ID:02x}"

    def upload_table(self, table: np.ndarray, stream: Any = None) -> DeviceTable:
        """Copy an int64 table to the device once (an allocation and a host-to-device transfer).  The
        copy is synchronous, so it is complete before any launch, on ``stream`` or any other."""
        table = np.ascontiguousarray(table, dtype=np.int64)
        array = cuda.to_device(table)
        max_count = int(table[:, 2].max()) if table.ndim == 2 and table.shape[0] else 0
        return DeviceTable(array, _device_address(array)[0], int(table.shape[0]), max_count)

    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        """A device allocation of ``nbytes`` bytes (the caller keeps it alive; numba allocates outside
        any stream's order, so ``stream`` changes nothing)."""
        return cuda.device_array(max(1, nbytes), dtype=np.uint8)

    def address(self, array: Any) -> int:
        return _device_address(array)[0]

    # ---- kernels -------------------------------------------------------------------------------
    def _flat_grid(self, count: int) -> int:
        return max(1, min(-(-count // (self._block * _UNROLL)), self._max_blocks))

    def copy_table(self, rows: Any, stream: Any = 0) -> None:
        table = self._table(rows)
        if table is not None:
            self._k.copy_rows[self._row_grid(table.rows, table.max_count, 16), self._block, stream](table.array)

    def scale_copy_table(self, rows: Any, dtype: np.dtype, factor: float, stream: Any = 0) -> None:
        check_factor(dtype, factor)
        table = self._table(rows)
        if table is None:
            return
        grid, kind = self._row_grid(table.rows, table.max_count, 1), half_kind(dtype)
        if kind:
            self._k.scale_rows_half[grid, self._block, stream](table.array, np.float32(factor), kind)
        else:
            self._k.scale_rows[grid, self._block, stream](table.array, np.dtype(dtype).type(factor))

    def reduce(self, out_addr: int, src_addrs: Any, count: int, dtype: np.dtype,
               op: ReduceOp, stream: Any = 0) -> None:
        if count <= 0:
            return
        srcs = src_addrs if isinstance(src_addrs, DeviceTable) else self.upload_table(as_sources(src_addrs))
        grid, kind = self._flat_grid(count), half_kind(dtype)
        if kind:
            self._k.reduce_half[grid, self._block, stream](int(out_addr), srcs.array, int(count), kind, int(op))
        else:
            like = np.dtype(dtype).type(0)
            self._k.reduce[grid, self._block, stream](int(out_addr), srcs.array, int(count), like, int(op))

    def reduce_bcast(self, table: DeviceTable, nsrc: int, ndst: int, max_count: int, dtype: np.dtype,
                     op: ReduceOp, factor: float | None, stream: Any = 0, pre: float = 1.0) -> None:
        """One launch over ``table`` (rows: count, ``nsrc`` sources, ``ndst`` destinations): every
        destination of a row receives ``op`` over its sources (times ``factor`` if given).  ``pre``
        (a power of two; half types only) scales each source, rounded to the dtype, before the sum."""
        if not table.rows or max_count <= 0:
            return
        grid = self._row_grid(table.rows, max_count, 1)
        kind, scaled = half_kind(dtype), factor is not None
        check_pre(pre, kind)
        if kind:
            self._k.reduce_bcast_half[grid, self._block, stream](table.array, nsrc, ndst, kind, int(op),
                                                                 np.float32(pre),
                                                                 np.float32(1.0 if factor is None else factor), scaled)
        else:
            like = np.dtype(dtype).type(0)
            self._k.reduce_bcast[grid, self._block, stream](table.array, nsrc, ndst, like, int(op),
                                                            np.dtype(dtype).type(1 if factor is None else factor), scaled)

    def cast_addr(self, src_addr: int, dst_addr: int, count: int, src_dtype: Any, dst_dtype: Any) -> None:
        """Pointer-level :meth:`cast` of ``count`` elements."""
        s_kind, d_kind = half_kind(src_dtype), half_kind(dst_dtype)
        args = (int(src_addr), int(dst_addr), int(count))
        if s_kind and np.dtype(dst_dtype) == np.float32:
            kernel, kind = self._k.widen, s_kind
        elif d_kind and np.dtype(src_dtype) == np.float32:
            kernel, kind = self._k.narrow, d_kind
        else:
            raise ValueError(f"cast supports float16/bfloat16 <-> float32, not {np.dtype(src_dtype)} -> "
                             f"{np.dtype(dst_dtype)}")
        if count > 0:
            kernel[self._flat_grid(count), self._block](*args, kind)
