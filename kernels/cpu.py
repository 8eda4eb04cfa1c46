"""CPU kernels (Numba ``njit``): batched copy, N-way reduce, scale and half casts.

All kernels are compiled lazily on first use and cached on disk.  Loops run over
blocks of ``_BLOCK`` elements so that an N-way reduce keeps its accumulator in
L1 while it streams each source once.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable

import numba
import numpy as np
from numba import njit, prange

from ._lowlevel import as_voidptr, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16
from .base import ReduceOp, as_rows, as_sources, check_factor, half_kind

_BLOCK = 4096


def _serial_and_parallel(fn):
    """Compile ``fn`` twice: serial (``prange`` runs as ``range``) and parallel.  Ranks that share a
    host usually get one thread each; they use the serial build and never start a threading layer
    (an OpenMP pool's spin-waiting would steal the cores that other ranks and the framework need).
    The serial copy gets its own qualified name so the two on-disk caches never collide."""
    serial = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                fn.__closure__)
    serial.__qualname__ = fn.__qualname__ + "_serial"
    return (njit(cache=True, nogil=True)(serial), njit(parallel=True, cache=True, nogil=True)(fn))


@njit(inline="always", cache=True)
def _combine(a, b, op):
    if op == 0:
        return a + b
    if op == 1:
        return b if (b != b or b < a) else a  # noqa: PLR0124 - b != b is the NaN test; NaN propagates
    return b if (b != b or b > a) else a  # noqa: PLR0124


def _copy_table(rows):
    for r in prange(rows.shape[0]):
        src, dst, nbytes = rows[r, 0], rows[r, 1], rows[r, 2]
        if src % 8 == 0 and dst % 8 == 0:  # widest aligned word, then the tail
            words = nbytes // 8
            s8 = numba.carray(as_voidptr(src), words, np.uint64)
            d8 = numba.carray(as_voidptr(dst), words, np.uint64)
            for i in range(words):
                d8[i] = s8[i]
            done = words * 8
        else:
            done = 0
        rest = nbytes - done
        s1 = numba.carray(as_voidptr(src + done), rest, np.uint8)
        d1 = numba.carray(as_voidptr(dst + done), rest, np.uint8)
        for i in range(rest):
            d1[i] = s1[i]


def _scale_copy_table(rows, proto, factor):
    for r in prange(rows.shape[0]):
        n = rows[r, 2]
        s = numba.carray(as_voidptr(rows[r, 0]), n, proto.dtype)
        d = numba.carray(as_voidptr(rows[r, 1]), n, proto.dtype)
        f = proto.dtype.type(factor)
        for i in range(n):
            d[i] = s[i] * f


def _scale_copy_table_half(rows, kind, factor):
    f = np.float32(factor)
    for r in prange(rows.shape[0]):
        n = rows[r, 2]
        s = numba.carray(as_voidptr(rows[r, 0]), n, np.uint16)
        d = numba.carray(as_voidptr(rows[r, 1]), n, np.uint16)
        if kind == 1:
            for i in range(n):
                d[i] = f32_to_f16(f16_to_f32(s[i]) * f)
        else:
            for i in range(n):
                d[i] = f32_to_bf16(bf16_to_f32(s[i]) * f)


def _reduce(out_addr, src_addrs, n, proto, op):
    # The accumulator is a block-sized scratch (L1-resident) written to ``out`` last, so ``out``
    # may alias any source: every source is read before any output element is written.
    size = proto.itemsize
    nblocks = (n + _BLOCK - 1) // _BLOCK
    k = src_addrs.size
    for b in prange(nblocks):
        lo = b * _BLOCK
        m = min(n, lo + _BLOCK) - lo
        acc = np.empty(m, proto.dtype)
        s0 = numba.carray(as_voidptr(src_addrs[0] + lo * size), m, proto.dtype)
        if k == 1:
            for i in range(m):
                acc[i] = s0[i]
        else:
            s1 = numba.carray(as_voidptr(src_addrs[1] + lo * size), m, proto.dtype)
            for i in range(m):
                acc[i] = _combine(s0[i], s1[i], op)
        for j in range(2, k):
            sj = numba.carray(as_voidptr(src_addrs[j] + lo * size), m, proto.dtype)
            for i in range(m):
                acc[i] = _combine(acc[i], sj[i], op)
        out = numba.carray(as_voidptr(out_addr + lo * size), m, proto.dtype)
        for i in range(m):  # explicit loop: parfors may drop a slice store to a raw-pointer carray
            out[i] = acc[i]


def _reduce_half(out_addr, src_addrs, n, kind, op):
    nblocks = (n + _BLOCK - 1) // _BLOCK
    k = src_addrs.size
    for b in prange(nblocks):
        lo = b * _BLOCK
        m = min(n, lo + _BLOCK) - lo
        acc = np.empty(m, np.float32)
        s0 = numba.carray(as_voidptr(src_addrs[0] + lo * 2), m, np.uint16)
        for i in range(m):
            acc[i] = f16_to_f32(s0[i]) if kind == 1 else bf16_to_f32(s0[i])
        for j in range(1, k):
            sj = numba.carray(as_voidptr(src_addrs[j] + lo * 2), m, np.uint16)
            if kind == 1:
                for i in range(m):
                    acc[i] = _combine(acc[i], f16_to_f32(sj[i]), op)
            else:
                for i in range(m):
                    acc[i] = _combine(acc[i], bf16_to_f32(sj[i]), op)
        out = numba.carray(as_voidptr(out_addr + lo * 2), m, np.uint16)
        if kind == 1:
            for i in range(m):
                out[i] = f32_to_f16(acc[i])
        else:
            for i in range(m):
                out[i] = f32_to_bf16(acc[i])


def _to_f32(src, dst, kind):
    for i in prange(src.size):
        dst[i] = f16_to_f32(src[i]) if kind == 1 else bf16_to_f32(src[i])


def _from_f32(src, dst, kind):
    for i in prange(src.size):
        dst[i] = f32_to_f16(src[i]) if kind == 1 else f32_to_bf16(src[i])


_KERNELS = {f.__name__: _serial_and_parallel(f) for f in (
    _copy_table, _scale_copy_table, _scale_copy_table_half, _reduce, _reduce_half, _to_f32, _from_f32)}


class CpuBackend:
    """The Numba CPU implementation of :class:`kernels.base.KernelBackend`."""

    name = "cpu"
    # A parallel kernel wakes the thread pool: with OMP_WAIT_POLICY=PASSIVE (what tunelab's ranks run
    # with) that costs 50-90 us a call on this 2-core host, against 1.4 us for a serial 1 KiB copy and
    # 5 us for a 1 KiB reduce.  Measured there (2 threads against 1): a 2-source reduce of 1 MiB
    # took 95 us against 65, of 4 MiB 218 against 415.  So a call goes parallel only when it moves at
    # least this many bytes (read plus written) per thread of its budget.
    parallel_min_bytes = 4 << 20

    def __init__(self) -> None:
        self._threads = threading.local()

    def set_threads(self, n: int) -> None:
        """Thread budget for kernels called from the calling thread (1 = serial kernels)."""
        n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
        self._threads.n = n
        if n > 1:
            numba.set_num_threads(n)

    def _k(self, name: str, work_bytes: int | Callable[[], int]):
        """The serial or the parallel build of kernel ``name`` for ``work_bytes`` read plus written (a
        callable is only called when the thread budget is above 1)."""
        n = getattr(self._threads, "n", 1)
        if n <= 1:
            return _KERNELS[name][0]
        work = work_bytes() if callable(work_bytes) else work_bytes
        return _KERNELS[name][work >= n * self.parallel_min_bytes]

    def copy_table(self, rows: np.ndarray) -> None:
        rows = as_rows(rows)
        if rows.shape[0]:
            self._k("_copy_table", lambda: 2 * int(rows[:, 2].sum()))(rows)

    def scale_copy_table(self, rows: np.ndarray, dtype: np.dtype, factor: float) -> None:
        rows = as_rows(rows)
        if not rows.shape[0]:
            return
        check_factor(dtype, factor)
        kind = half_kind(dtype)
        work = lambda: 2 * np.dtype(dtype).itemsize * int(rows[:, 2].sum())
        if kind:
            self._k("_scale_copy_table_half", work)(rows, kind, float(factor))
        else:
            self._k("_scale_copy_table", work)(rows, np.empty(0, dtype), float(factor))

    def reduce(self, out_addr: int, src_addrs: np.ndarray, count: int, dtype: np.dtype,
               op: ReduceOp) -> None:
        if count <= 0:
            return
        addrs = as_sources(src_addrs, np.intp)
        kind = half_kind(dtype)
        work = int(count) * np.dtype(dtype).itemsize * (len(addrs) + 1)
        if kind:
            self._k("_reduce_half", work)(int(out_addr), addrs, int(count), kind, int(op))
        else:
            self._k("_reduce", work)(int(out_addr), addrs, int(count), np.empty(0, dtype), int(op))

    def scale(self, array: np.ndarray, factor: float) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("scale needs a C-contiguous array")
        if not array.flags.writeable:  # (the kernel writes through its address: it would not be stopped)
            raise ValueError("scale needs a writeable array")
        n = array.size
        if n:
            row = np.array([[array.ctypes.data, array.ctypes.data, n]], np.int64)
            self.scale_copy_table(row, array.dtype, factor)

    def cast(self, src: np.ndarray, dst: np.ndarray) -> None:
        if src.shape != dst.shape:
            raise ValueError(f"cast shapes differ: {src.shape} vs {dst.shape}")
        if not (dst.flags.c_contiguous and dst.flags.writeable):  # (a reshaped copy would take the results)
            raise ValueError("cast needs a C-contiguous, writeable destination")
        s, d = src.reshape(-1), dst.reshape(-1)
        if d.dtype == np.float32 and half_kind(s.dtype):
            self._k("_to_f32", s.nbytes + d.nbytes)(s.view(np.uint16), d, half_kind(s.dtype))
        elif s.dtype == np.float32 and half_kind(d.dtype):
            self._k("_from_f32", s.nbytes + d.nbytes)(s, d.view(np.uint16), half_kind(d.dtype))
        else:
            raise ValueError(f"cast supports float16/bfloat16 <-> float32, not {s.dtype} -> {d.dtype}")
