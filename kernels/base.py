"""The kernel interface every back end implements (cpu now; numba-cuda and cupy slot in beside it).

Kernels work on *addresses*: host pointers for the CPU back end, device pointers
for GPU back ends.  That is what lets one call pack or unpack a whole fusion
bucket ("a table of (src, dst, nbytes) rows") and reduce a chunk straight from
peers' mapped memory.
"""

from __future__ import annotations

import enum
from typing import Protocol

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
        """``dst = src * factor`` for every row ``(src_addr, dst_addr, count)`` of elements of ``dtype``."""

    def reduce(self, out_addr: int, src_addrs: np.ndarray, count: int, dtype: np.dtype,
               op: ReduceOp) -> None:
        """``out[i] = op(src_0[i], src_1[i], ...)`` combining sources in the order given.

        ``out`` may alias any source.  Half types accumulate in float32 and round once.
        """

    def scale(self, array: np.ndarray, factor: float) -> None:
        """In place ``array *= factor`` (half types computed in float32)."""

    def cast(self, src: np.ndarray, dst: np.ndarray) -> None:
        """float16/bfloat16 <-> float32 conversion, round to nearest even."""
