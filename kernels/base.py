"""The kernel interface every back end implements (cpu now; numba-cuda and cupy slot in beside it).

Kernels work on *addresses*: host pointers for the CPU back end, device pointers
for GPU back ends.  That is what lets one call pack or unpack a whole fusion
bucket ("a table of (src, dst, nbytes) rows") and reduce a chunk straight from
peers' mapped memory.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class ReduceOp(enum.IntEnum):
    """Element-wise reductions the kernels implement (average = sum, then scale)."""

    SUM = 0
    MIN = 1
    MAX = 2


# Element kinds the kernels distinguish.  Half types travel as uint16 bit patterns.
HALF_KINDS = {"float16": 1, "bfloat16": 2}


class KernelBackend(Protocol):
    name: str

    def set_threads(self, n: int) -> None:
        """Cap the threads one kernel call may use (ranks sharing a host share its cores)."""

    def copy_table(self, rows: np.ndarray) -> None:
        """Copy bytes for every row ``(src_addr, dst_addr, nbytes)`` of an int64 [R, 3] table."""

    def scale_copy_table(self, rows: np.ndarray, dtype: np.dtype, factor: float) -> None:
        """``dst = src * factor`` for every row ``(src_addr, dst_addr, count)`` of elements of ``dtype``
        (integer types: whole factors only, ValueError otherwise)."""

    def reduce(self, out_addr: int, src_addrs: np.ndarray, count: int, dtype: np.dtype,
               op: ReduceOp) -> None:
        """``out[i] = op(src_0[i], src_1[i], ...)`` combining sources in the order given.

        ``out`` may alias any source.  Half types accumulate in float32 and round once.
        """

    def scale(self, array: np.ndarray, factor: float) -> None:
        """In place ``array *= factor`` (half types computed in float32)."""

    def cast(self, src: np.ndarray, dst: np.ndarray) -> None:
        """float16/bfloat16 <-> float32 conversion, round to nearest even."""


_HALF_KIND_BY_DTYPE: dict[Any, int] = {}


def check_factor(dtype: Any, factor: float) -> None:
    """ValueError for a factor an integer type cannot apply as given: the kernels multiply in the
    element type, so ``int32 * 0.5`` would be ``int32 * 0`` (zeros, silently).  The engine scales
    floating types only (an integer average is refused where it is submitted)."""
    if np.dtype(dtype).kind in "iu" and not float(factor).is_integer():
        raise ValueError(f"cannot scale {np.dtype(dtype).name} by {factor!r}: integer types take whole factors only")


def check_pre(pre: float, kind: int) -> None:
    """ValueError unless ``pre`` (the factor each source is scaled by, and rounded to its dtype, before
    a sum) is 1, or a power of two for a half type (it only moves the exponent: exact above the type's
    smallest normal, rounded below it as the staged path's packing rounds)."""
    if pre != 1.0 and not (kind and pre > 0 and math.frexp(pre)[0] == 0.5):
        raise ValueError(f"a sum's pre-scale must be 1, or a power of two for a half type, not {pre!r}")


def half_kind(dtype: Any) -> int:
    """1 for float16, 2 for bfloat16, 0 for every other element type."""
    kind = _HALF_KIND_BY_DTYPE.get(dtype)
    if kind is None:
        kind = HALF_KINDS.get(np.dtype(dtype).name, 0)
        if isinstance(dtype, np.dtype):  # cached per dtype object: this runs on every small call
            _HALF_KIND_BY_DTYPE[dtype] = kind
    return kind


def as_rows(rows: np.ndarray) -> np.ndarray:
    """A copy table as a C-contiguous int64 [rows, 3] array; ValueError for any other shape."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(f"copy table must have shape [rows, 3], got {rows.shape}")
    return rows


def as_sources(src_addrs: Any, dtype: Any = np.int64) -> np.ndarray:
    """Source addresses of a reduce as a flat C-contiguous array; ValueError when there are none."""
    addrs = np.ascontiguousarray(src_addrs, dtype=dtype).reshape(-1)
    if addrs.size == 0:
        raise ValueError("reduce needs at least one source")
    return addrs


def cuda_array_address(array: Any, backend: str) -> tuple[int, np.dtype, int] | None:
    """(address, element type, count) of a C-contiguous ``__cuda_array_interface__`` exporter (CuPy,
    numba, PyTorch), or None for other objects.  uint16 arrays hold bfloat16 bits (CuPy has no bfloat16)."""
    found = cuda_array_layout(array, backend)
    return None if found is None else found[:3]


def cuda_array_layout(array: Any, backend: str) -> tuple[int, np.dtype, int, tuple[int, ...]] | None:
    """:func:`cuda_array_address` and the shape, from one read of the interface (libraries build it
    in Python on every read)."""
    iface = getattr(array, "__cuda_array_interface__", None)
    if iface is None:
        return None
    shape, dtype = tuple(iface["shape"]), np.dtype(iface["typestr"])
    count = math.prod(shape)
    strides = iface.get("strides")
    if strides is not None and count > 1 and tuple(strides) != _c_strides(shape, dtype.itemsize):
        raise ValueError(f"{backend} kernels need C-contiguous arrays")
    if dtype == np.uint16:
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    return int(iface["data"][0]), dtype, count, shape


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape`` (as numpy gives them)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class DeviceTable:
    """A kernel table already in device memory: uploaded once, named by every launch that uses it,
    so a warmed-up collective moves no table from the host.  ``array`` is the back end's device
    array (it keeps the memory alive); ``max_count`` sizes copy grids (0 for address lists);
    ``host`` is the host copy it came from, kept while an asynchronous upload may still read it."""

    array: Any
    addr: int
    rows: int
    max_count: int
    host: Any = None


class DeviceArrayOps:
    """What the GPU back ends share: grid sizing, table handling, and array-level ``scale`` and
    ``cast`` that resolve arrays to addresses (``_device_address``) and call the pointer-level
    kernels.  Back ends set ``_block`` and ``_max_blocks`` and implement ``upload_table``."""

    _block: int
    _max_blocks: int
    _unroll = 4  # grid sizing: each thread handles about this many words per pass

    def _row_grid(self, rows: int, longest: int, unit: int) -> tuple[int, int]:
        """(x, y) grid for a table: y strides over rows, x splits the longest row ``unit`` at a time."""
        gy = min(rows, 65535)
        gx = -(-longest // (self._block * self._unroll * unit))
        return max(1, min(gx, self._max_blocks // gy)), gy

    def _table(self, rows: Any, stream: Any = None) -> DeviceTable | None:
        """A copy table on the device (uploaded now, ordered before launches on ``stream``, if given as
        a host array), or None when there is nothing to copy."""
        if not isinstance(rows, DeviceTable):
            rows = as_rows(rows)
            if not rows.shape[0] or rows[:, 2].max() <= 0:
                return None
            return self.upload_table(rows, stream)  # type: ignore[attr-defined]
        return rows if rows.rows and rows.max_count > 0 else None

    def _device_address(self, array: Any) -> tuple[int, np.dtype, int]:
        raise NotImplementedError

    def scale(self, array: Any, factor: float) -> None:
        """In place ``array *= factor`` on a device array (uint16 arrays are bfloat16 bits)."""
        addr, dtype, n = self._device_address(array)
        if n:
            self.scale_copy_table(np.array([[addr, addr, n]], np.int64), dtype, factor)  # type: ignore[attr-defined]

    def cast(self, src: Any, dst: Any) -> None:
        """float16/bfloat16 <-> float32 between device arrays (uint16 arrays are bfloat16 bits)."""
        s_addr, s_dtype, n = self._device_address(src)
        d_addr, d_dtype, m = self._device_address(dst)
        if n != m:
            raise ValueError(f"cast sizes differ: {n} vs {m}")
        self.cast_addr(s_addr, d_addr, n, s_dtype, d_dtype)  # type: ignore[attr-defined]
