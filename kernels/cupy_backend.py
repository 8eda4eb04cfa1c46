"""GPU kernels compiled by CuPy (NVRTC) from CUDA C: batched copy, scale-copy, reduce, scale, casts.

The same address-based interface as the CPU and numba-cuda back ends: a table of ``(src, dst, n)``
rows is copied or scaled in one launch, a reduce reads its sources through a device array of
pointers (so it can combine peers' buffers in place).  Half types are uint16 bit patterns converted
in software exactly as on the CPU, and the module is built with ``-fmad=false``, so results agree
bit for bit with the other back ends.  CuPy is imported when the back end is constructed, never at
package import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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

_INSTALL_HINT = "pip install 'tunelab[gpu]'"
_UNROLL = 4  # grid sizing: each thread handles about this many words per pass

_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// Integers wrap (computed unsigned, no undefined overflow); floats use plain IEEE ops.
template <typename T, typename U> __device__ __forceinline__ T wrap_add(T a, T b) { return (T)((U)a + (U)b); }
template <typename T, typename U> __device__ __forceinline__ T wrap_mul(T a, T b) { return (T)((U)a * (U)b); }

template <typename T, typename U> __device__ __forceinline__ T combine(T a, T b, int op) {
    if (op == 0) return wrap_add<T, U>(a, b);
    if (op == 1) return (b != b || b < a) ? b : a;  // nan wins, as in numpy.minimum
    return (b != b || b > a) ? b : a;
}

__device__ __forceinline__ float half_to_f32(u16 h, int kind) {  // kind 1: fp16, 2: bf16
    u32 v = h;
    if (kind == 2) return __uint_as_float(v << 16);
    u32 sign = (v & 0x8000u) << 16, exp = (v >> 10) & 0x1Fu, man = v & 0x3FFu;
    if (exp == 0) { float mag = (float)man * 5.9604644775390625e-08f; return sign ? -mag : mag; }
    if (exp == 0x1Fu) return __uint_as_float(sign | 0x7F800000u | (man << 13));
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ u16 f32_to_half(float x, int kind) {  // round to nearest even
    u32 f = __float_as_uint(x);
    if (kind == 2) {
        if ((f & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((f >> 16) | 0x40u);
        return (u16)((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
    }
    u32 sign = (f >> 16) & 0x8000u, a = f & 0x7FFFFFFFu, o;
    if (a >= 0x47800000u) o = a > 0x7F800000u ? 0x7E00u : 0x7C00u;
    else if (a < 0x38800000u) o = __float_as_uint(__uint_as_float(a) + 0.5f) - 0x3F000000u;
    else o = (a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    return (u16)(o | sign);
}

#define GRID_X  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x; \
                const i64 step = (i64)gridDim.x * blockDim.x;
#define FOR_ROWS for (int r = blockIdx.y; r < nrows; r += gridDim.y)

template <typename W>
__device__ __forceinline__ void copy_words(const char* s, char* d, i64 words, i64 first, i64 step) {
    const W* sw = (const W*)s;
    W* dw = (W*)d;
    for (i64 i = first; i < words; i += step) dw[i] = sw[i];
}

// One launch per table: grid y strides over rows, grid x over a row's words (widest common alignment).
extern "C" __global__ void copy_rows(const i64* rows, int nrows) {
    GRID_X
    FOR_ROWS {
        const i64 src = rows[3 * r], dst = rows[3 * r + 1], n = rows[3 * r + 2], diff = src - dst;
        const int width = diff % 16 == 0 ? 16 : diff % 8 == 0 ? 8 : diff % 4 == 0 ? 4 : 1;
        i64 head = (width - src % width) % width;
        if (head > n) head = n;
        const i64 words = (n - head) / width;
        const char* s = (const char*)src;
        char* d = (char*)dst;
        for (i64 i = first; i < head; i += step) d[i] = s[i];
        switch (width) {
            case 16: copy_words<uint4>(s + head, d + head, words, first, step); break;
            case 8: copy_words<u64>(s + head, d + head, words, first, step); break;
            case 4: copy_words<u32>(s + head, d + head, words, first, step); break;
            default: copy_words<char>(s + head, d + head, words, first, step);
        }
        for (i64 i = head + words * width + first; i < n; i += step) d[i] = s[i];
    }
}

extern "C" __global__ void scale_rows_half(const i64* rows, int nrows, float factor, int kind) {
    GRID_X
    FOR_ROWS {
        const u16* s = (const u16*)rows[3 * r];
        u16* d = (u16*)rows[3 * r + 1];
        const i64 n = rows[3 * r + 2];
        for (i64 i = first; i < n; i += step) d[i] = f32_to_half(half_to_f32(s[i], kind) * factor, kind);
    }
}

// Vector-width access: when every address of a row is 16-byte aligned, threads move whole 16-byte
// words (one load per source, one store), then finish the tail element by element.  Every element is
// read from every source before the same thread writes it, so the output may alias any source, and
// each element is combined in source order either way: the bits do not depend on the width.
__device__ __forceinline__ bool aligned16(i64 bits, const i64* addrs, int k) {
    for (int j = 0; j < k; ++j) bits |= addrs[j];
    return (bits & 15) == 0;
}

template <typename T, typename U>
__device__ __forceinline__ T combine_words(uint4* a, const i64* srcs, int k, i64 v, int op) {
    T* at = reinterpret_cast<T*>(a);
    for (int j = 1; j < k; ++j) {
        const uint4 b = ((const uint4*)srcs[j])[v];
        const T* bt = reinterpret_cast<const T*>(&b);
#pragma unroll
        for (int l = 0; l < (int)(16 / sizeof(T)); ++l) at[l] = combine<T, U>(at[l], bt[l], op);
    }
    return at[0];
}

__device__ __forceinline__ uint4 combine_half_words(const i64* srcs, int k, i64 v, int op, int kind) {
    float acc[8];
    const uint4 a = ((const uint4*)srcs[0])[v];
    const u16* ah = reinterpret_cast<const u16*>(&a);
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = half_to_f32(ah[l], kind);
    for (int j = 1; j < k; ++j) {
        const uint4 b = ((const uint4*)srcs[j])[v];
        const u16* bh = reinterpret_cast<const u16*>(&b);
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[l] = combine<float, float>(acc[l], half_to_f32(bh[l], kind), op);
    }
    uint4 o;
    u16* oh = reinterpret_cast<u16*>(&o);
#pragma unroll
    for (int l = 0; l < 8; ++l) oh[l] = f32_to_half(acc[l], kind);
    return o;
}

extern "C" __global__ void reduce_half(i64 out, const i64* srcs, int k, i64 n, int op, int kind) {
    GRID_X
    i64 done = 0;
    if (aligned16(out, srcs, k)) {
        const i64 words = n / 8;
        for (i64 v = first; v < words; v += step) ((uint4*)out)[v] = combine_half_words(srcs, k, v, op, kind);
        done = words * 8;
    }
    for (i64 i = done + first; i < n; i += step) {
        float acc = half_to_f32(((const u16*)srcs[0])[i], kind);
        for (int j = 1; j < k; ++j) acc = combine<float, float>(acc, half_to_f32(((const u16*)srcs[j])[i], kind), op);
        ((u16*)out)[i] = f32_to_half(acc, kind);
    }
}

extern "C" __global__ void widen(i64 src, i64 dst, i64 n, int kind) {
    GRID_X
    for (i64 i = first; i < n; i += step) ((float*)dst)[i] = half_to_f32(((const u16*)src)[i], kind);
}

extern "C" __global__ void narrow(i64 src, i64 dst, i64 n, int kind) {
    GRID_X
    for (i64 i = first; i < n; i += step) ((u16*)dst)[i] = f32_to_half(((const float*)src)[i], kind);
}

// Row r of the table: count, nsrc source addresses, ndst destination addresses.  Every element is
// combined from every source in order, scaled if asked, and written to every destination.
extern "C" __global__ void reduce_bcast_half(const i64* table, int nrows, int nsrc, int ndst, int kind,
                                             int op, float pre, float factor, int scaled) {
    GRID_X
    const int width = 1 + nsrc + ndst;
    FOR_ROWS {
        const i64* row = table + (i64)r * width;
        const i64 n = row[0];
        i64 done = 0;
        if (!scaled && pre == 1.0f && aligned16(0, row + 1, nsrc + ndst)) {
            const i64 words = n / 8;
            for (i64 v = first; v < words; v += step) {
                const uint4 o = combine_half_words(row + 1, nsrc, v, op, kind);
                for (int j = 0; j < ndst; ++j) ((uint4*)row[1 + nsrc + j])[v] = o;
            }
            done = words * 8;
        }
        // pre (a power of two) scales each source, rounded to the half type as the staged path's packing
        // rounds it, so that a float16 average's sum past 65504 is not inf; the sum rounds once, then
        // scales as unpacking does
        for (i64 i = done + first; i < n; i += step) {
            float acc = half_to_f32(((const u16*)row[1])[i], kind);
            if (pre != 1.0f) acc = half_to_f32(f32_to_half(acc * pre, kind), kind);
            for (int j = 1; j < nsrc; ++j) {
                float v = half_to_f32(((const u16*)row[1 + j])[i], kind);
                if (pre != 1.0f) v = half_to_f32(f32_to_half(v * pre, kind), kind);
                acc = combine<float, float>(acc, v, op);
            }
            u16 h = f32_to_half(acc, kind);
            if (scaled) h = f32_to_half(half_to_f32(h, kind) * factor, kind);
            for (int j = 0; j < ndst; ++j) ((u16*)row[1 + nsrc + j])[i] = h;
        }
    }
}

#define TYPED_KERNELS(NAME, T, U)                                                                   \
extern "C" __global__ void scale_rows_##NAME(const i64* rows, int nrows, T factor) {                \
    GRID_X                                                                                          \
    FOR_ROWS {                                                                                      \
        const T* s = (const T*)rows[3 * r];                                                         \
        T* d = (T*)rows[3 * r + 1];                                                                 \
        const i64 n = rows[3 * r + 2];                                                              \
        for (i64 i = first; i < n; i += step) d[i] = wrap_mul<T, U>(s[i], factor);                  \
    }                                                                                               \
}                                                                                                   \
extern "C" __global__ void reduce_##NAME(i64 out, const i64* srcs, int k, i64 n, int op) {         \
    GRID_X                                                                                          \
    i64 done = 0;                                                                                   \
    if (aligned16(out, srcs, k)) {                                                                  \
        const i64 words = n / (16 / sizeof(T));                                                     \
        for (i64 v = first; v < words; v += step) {                                                 \
            uint4 a = ((const uint4*)srcs[0])[v];                                                   \
            combine_words<T, U>(&a, srcs, k, v, op);                                                \
            ((uint4*)out)[v] = a;                                                                   \
        }                                                                                           \
        done = words * (16 / sizeof(T));                                                            \
    }                                                                                               \
    for (i64 i = done + first; i < n; i += step) {                                                  \
        T acc = ((const T*)srcs[0])[i];                                                             \
        for (int j = 1; j < k; ++j) acc = combine<T, U>(acc, ((const T*)srcs[j])[i], op);           \
        ((T*)out)[i] = acc;                                                                         \
    }                                                                                               \
}                                                                                                   \
extern "C" __global__ void reduce_bcast_##NAME(const i64* table, int nrows, int nsrc, int ndst,     \
                                               int op, T factor, int scaled) {                      \
    GRID_X                                                                                          \
    const int width = 1 + nsrc + ndst;                                                              \
    FOR_ROWS {                                                                                      \
        const i64* row = table + (i64)r * width;                                                    \
        const i64 n = row[0];                                                                       \
        i64 done = 0;                                                                               \
        if (!scaled && aligned16(0, row + 1, nsrc + ndst)) {                                        \
            const i64 words = n / (16 / sizeof(T));                                                 \
            for (i64 v = first; v < words; v += step) {                                             \
                uint4 a = ((const uint4*)row[1])[v];                                                \
                combine_words<T, U>(&a, row + 1, nsrc, v, op);                                      \
                for (int j = 0; j < ndst; ++j) ((uint4*)row[1 + nsrc + j])[v] = a;                  \
            }                                                                                       \
            done = words * (16 / sizeof(T));                                                        \
        }                                                                                           \
        for (i64 i = done + first; i < n; i += step) {                                              \
            T acc = ((const T*)row[1])[i];                                                          \
            for (int j = 1; j < nsrc; ++j) acc = combine<T, U>(acc, ((const T*)row[1 + j])[i], op); \
            if (scaled) acc = wrap_mul<T, U>(acc, factor);                                          \
            for (int j = 0; j < ndst; ++j) ((T*)row[1 + nsrc + j])[i] = acc;                        \
        }                                                                                           \
    }                                                                                               \
}

TYPED_KERNELS(float32, float, float)
TYPED_KERNELS(float64, double, double)
TYPED_KERNELS(int32, int, unsigned int)
TYPED_KERNELS(int64, long long, unsigned long long)
"""

_TYPED = ("float32", "float64", "int32", "int64")


def _one_line(exc: BaseException) -> str:
    """The root cause of ``exc`` on one line (CuPy wraps import failures in a multi-line banner)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _require_cupy() -> Any:
    """CuPy with at least one usable device, or an error that says how to get one."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install failing to load
        raise ImportError(f"the cupy kernel back end needs CuPy and a CUDA device: {_INSTALL_HINT} "
                          f"({_one_line(exc)})") from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise RuntimeError(f"the cupy kernel back end found no usable CUDA device ({_one_line(exc)}); "
                           f"it needs a GPU, a driver and {_INSTALL_HINT}") from exc
    if count < 1:
        raise RuntimeError(f"the cupy kernel back end found no CUDA device; it needs a GPU and {_INSTALL_HINT}")
    return cupy


def _device_address(array: Any) -> tuple[int, np.dtype, int]:
    """(address, element type, count) of a C-contiguous device array; uint16 means bfloat16 bits."""
    found = cuda_array_address(array, "cupy")
    if found is None:
        raise TypeError(f"expected a device array (__cuda_array_interface__), got {type(array).__name__}")
    return found


class CupyBackend(DeviceArrayOps):
    """:class:`kernels.base.KernelBackend` on a CUDA device, kernels compiled by CuPy.

    Addresses are device pointers.  Launches go to CuPy's current stream and return without waiting:
    call :meth:`synchronize` before host code or another library reads the results.
    """

    name = "cupy"

    def _device_address(self, array: Any) -> tuple[int, np.dtype, int]:
        return _device_address(array)

    def __init__(self, block: int = 256, max_blocks: int = 8192) -> None:
        self._cp = _require_cupy()
        self._module = self._cp.RawModule(code=_SOURCE, options=("-fmad=false",))
        self._fns: dict[str, Any] = {}
        self._block = int(block)
        self._max_blocks = max(1, int(max_blocks))

    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._module.get_function(name)
        return fn

    def set_threads(self, n: int) -> None:
        """Host threads do not apply to device kernels; kept for the common interface."""

    def synchronize(self) -> None:
        """Wait for all work on the device, every stream's (a framework's kernels included)."""
        self._cp.cuda.Device().synchronize()

    # ---- streams, events, tables ---------------------------------------------------------------
    def use_device(self, index: int) -> None:
        """Make device ``index`` current for the calling thread (each thread has its own)."""
        if self._cp.cuda.runtime.getDevice() != index:
            self._cp.cuda.runtime.setDevice(index)

    def new_stream(self) -> Any:
        return self._cp.cuda.Stream(non_blocking=True)

    def stream_sync(self, stream: Any) -> None:
        stream.synchronize()

    def new_event(self, interprocess: bool = False) -> Any:
        return self._cp.cuda.Event(block=False, disable_timing=True, interprocess=interprocess)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def event_sync(self, event: Any) -> None:
        event.synchronize()

    def external_stream(self, handle: int) -> Any:
        """A stream another library created (its raw ``cudaStream_t``; 0: the legacy default)."""
        return self._cp.cuda.ExternalStream(int(handle))

    def device_id(self) -> str:
        """Which physical GPU this process uses (PCI location): ranks with equal ids share one."""
        rt = self._cp.cuda.runtime
        props = rt.getDeviceProperties(rt.getDevice())
        return f"{props['pciDomainID']:04x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}"

    def upload_table(self, table: np.ndarray, stream: Any = None) -> DeviceTable:
        """Copy an int64 table to the device once (an allocation and a host-to-device transfer), queued
        on ``stream``, the stream whose launches read it (None: CuPy's current stream, where launches
        without a stream go).  CuPy copies asynchronously on the current stream: uploaded anywhere
        else, a launch on a non-blocking engine stream could read the table before it has arrived
        (behind the framework's queued work on the default stream)."""
        table = np.ascontiguousarray(table, dtype=np.int64)
        if stream is None or stream == 0:
            array = self._cp.asarray(table)
        else:
            with stream:
                array = self._cp.asarray(table)
        max_count = int(table[:, 2].max()) if table.ndim == 2 and table.shape[0] else 0
        return DeviceTable(array, int(array.data.ptr), int(table.shape[0]), max_count, host=table)

    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        """A device allocation of ``nbytes`` bytes (the caller keeps it alive), from the memory pool of
        ``stream``, the one its kernels run on: CuPy hands a block freed on a stream straight to the
        next allocation on that stream, which that stream's order alone keeps safe."""
        if stream is None:
            return self._cp.empty(max(1, nbytes), dtype=self._cp.uint8)
        with stream:
            return self._cp.empty(max(1, nbytes), dtype=self._cp.uint8)

    def address(self, array: Any) -> int:
        return _device_address(array)[0]

    # ---- kernels -------------------------------------------------------------------------------
    def _launch(self, name: str, grid: tuple, args: tuple, stream: Any) -> None:
        if stream is None or stream == 0:
            self._fn(name)(grid, (self._block,), args)
        else:
            with stream:
                self._fn(name)(grid, (self._block,), args)

    def _flat_grid(self, count: int) -> tuple[int]:
        return (max(1, min(-(-count // (self._block * _UNROLL)), self._max_blocks)),)

    def copy_table(self, rows: Any, stream: Any = None) -> None:
        table = self._table(rows, stream)
        if table is not None:
            self._launch("copy_rows", self._row_grid(table.rows, table.max_count, 16),
                         (table.array, np.int32(table.rows)), stream)

    def scale_copy_table(self, rows: Any, dtype: np.dtype, factor: float, stream: Any = None) -> None:
        check_factor(dtype, factor)
        table = self._table(rows, stream)
        if table is None:
            return
        name, kind = np.dtype(dtype).name, half_kind(dtype)
        if not kind and name not in _TYPED:
            raise TypeError(f"cupy kernels do not handle {name}")
        head = (table.array, np.int32(table.rows))
        args = (*head, np.float32(factor), np.int32(kind)) if kind else (*head, np.dtype(dtype).type(factor))
        self._launch("scale_rows_half" if kind else f"scale_rows_{name}",
                     self._row_grid(table.rows, table.max_count, 1), args, stream)

    def reduce(self, out_addr: int, src_addrs: Any, count: int, dtype: np.dtype,
               op: ReduceOp, stream: Any = None) -> None:
        if count <= 0:
            return
        srcs = (src_addrs if isinstance(src_addrs, DeviceTable)
                else self.upload_table(as_sources(src_addrs), stream))
        name, kind = np.dtype(dtype).name, half_kind(dtype)
        if not kind and name not in _TYPED:
            raise TypeError(f"cupy kernels do not handle {name}")
        args = (np.int64(out_addr), srcs.array, np.int32(srcs.rows), np.int64(count), np.int32(op))
        if kind:
            self._launch("reduce_half", self._flat_grid(count), (*args, np.int32(kind)), stream)
        else:
            self._launch(f"reduce_{name}", self._flat_grid(count), args, stream)

    def reduce_bcast(self, table: DeviceTable, nsrc: int, ndst: int, max_count: int, dtype: np.dtype,
                     op: ReduceOp, factor: float | None, stream: Any = None, pre: float = 1.0) -> None:
        """One launch over ``table`` (rows: count, ``nsrc`` sources, ``ndst`` destinations): every
        destination of a row receives ``op`` over its sources (times ``factor`` if given).  ``pre``
        (a power of two; half types only) scales each source, rounded to the dtype, before the sum."""
        if not table.rows or max_count <= 0:
            return
        name, kind = np.dtype(dtype).name, half_kind(dtype)
        if not kind and name not in _TYPED:
            raise TypeError(f"cupy kernels do not handle {name}")
        check_pre(pre, kind)
        head = (table.array, np.int32(table.rows), np.int32(nsrc), np.int32(ndst))
        scaled = np.int32(factor is not None)
        if kind:
            args = (*head, np.int32(kind), np.int32(op), np.float32(pre), np.float32(1.0 if factor is None else factor),
                    scaled)
            self._launch("reduce_bcast_half", self._row_grid(table.rows, max_count, 1), args, stream)
        else:
            args = (*head, np.int32(op), np.dtype(dtype).type(1 if factor is None else factor), scaled)
            self._launch(f"reduce_bcast_{name}", self._row_grid(table.rows, max_count, 1), args, stream)

    def cast_addr(self, src_addr: int, dst_addr: int, count: int, src_dtype: Any, dst_dtype: Any) -> None:
        """Pointer-level :meth:`cast` of ``count`` elements."""
        s_kind, d_kind = half_kind(src_dtype), half_kind(dst_dtype)
        if s_kind and np.dtype(dst_dtype) == np.float32:
            name, kind = "widen", s_kind
        elif d_kind and np.dtype(src_dtype) == np.float32:
            name, kind = "narrow", d_kind
        else:
            raise ValueError(f"cast supports float16/bfloat16 <-> float32, not {np.dtype(src_dtype)} -> "
                             f"{np.dtype(dst_dtype)}")
        if count > 0:
            self._fn(name)(self._flat_grid(count), (self._block,),
                           (np.int64(src_addr), np.int64(dst_addr), np.int64(count), np.int32(kind)))
