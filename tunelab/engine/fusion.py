"""Fusion planning and bucket layouts.

``plan_buckets`` is pure: the same entries and knobs give the same buckets on
every rank.  Tensors are packed in submission order into one open buffer per
dtype (dtype look-ahead: an interleaved fp16/fp32 sequence still fills one fp16
and one fp32 buffer); a buffer closes when the next tensor would push it past
the threshold.  Without group fusion, a bucket never mixes tensors of different
groups (nor grouped with ungrouped ones), and a group is one indivisible bucket
per dtype whatever the threshold: grouped results then depend neither on what
else was in flight nor on the fusion threshold, so they are bitwise
reproducible while the fusion knobs change (across nodes the algorithm that adds
the nodes' sums sets their order: see :mod:`.algorithms`).

``Layout`` maps element ranges of a bucket onto its tensors' memory and emits
the (src, dst, count) tables the kernels consume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Entry:
    nbytes: int
    dtype: str  # any label that is equal for equal element types
    group: int | None = None


@dataclass(frozen=True)
class Bucket:
    dtype: str
    indices: tuple[int, ...]
    nbytes: int


def plan_buckets(entries: Sequence[Entry], threshold_bytes: int, group_fusion: bool) -> list[Bucket]:
    """Split ``entries`` into fusion buckets (ordered by their first entry)."""
    domains: dict[object, list[int]] = {}
    for i, e in enumerate(entries):
        key = "all" if group_fusion else ("group", e.group)
        domains.setdefault(key, []).append(i)
    buckets: list[Bucket] = []
    for key, members in domains.items():
        whole_group = key != "all" and key[1] is not None  # type: ignore[index]
        buckets.extend(_fill(entries, members, 1 << 62 if whole_group else threshold_bytes))
    buckets.sort(key=lambda b: b.indices[0])
    return buckets


def _fill(entries: Sequence[Entry], members: list[int], threshold: int) -> list[Bucket]:
    done: list[Bucket] = []
    open_: dict[str, tuple[list[int], int]] = {}
    for i in members:
        e = entries[i]
        idx, size = open_.get(e.dtype, ([], 0))
        if idx and size + e.nbytes > threshold:
            done.append(Bucket(e.dtype, tuple(idx), size))
            idx, size = [], 0
        idx.append(i)
        open_[e.dtype] = (idx, size + e.nbytes)
    done.extend(Bucket(dt, tuple(idx), size) for dt, (idx, size) in open_.items() if idx)
    return done


def address(a: Any) -> int:
    """Where ``a``'s data starts: a numpy array's, or a device buffer's (``.addr``)."""
    return int(a.addr) if hasattr(a, "addr") else int(a.ctypes.data)


class Layout:
    """A bucket: tensors ``srcs`` (read) and ``dsts`` (written), C-contiguous, one dtype, any shape.
    Sizes and addresses stay Python lists until a row table needs them as arrays (a fused call of a
    few gradients would spend more in numpy's small-array calls than in its arithmetic)."""

    def __init__(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray]) -> None:
        self.dtype = srcs[0].dtype
        self.itemsize = self.dtype.itemsize
        self._sizes = [int(a.size) for a in srcs]
        self.count = sum(self._sizes)
        self._src = [address(a) for a in srcs]
        self._dst = [address(a) for a in dsts]
        self.single = len(srcs) == 1
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(starts, ends, source addresses, destination addresses) as int64 arrays, made once."""
        if self._arrays is None:
            counts = np.array(self._sizes, dtype=np.int64)
            ends = np.cumsum(counts)
            self._arrays = (ends - counts, ends, np.array(self._src, dtype=np.int64),
                            np.array(self._dst, dtype=np.int64))
        return self._arrays

    def dst(self, i: int) -> int:
        """Where tensor ``i``'s result goes."""
        return self._dst[i]

    def _rows(self, lo: int, hi: int, buf_addr: int, to_buffer: bool) -> np.ndarray:
        if self.single:  # the common case of one tensor: no searching
            tensor = (self._src[0] if to_buffer else self._dst[0]) + lo * self.itemsize
            row = (tensor, buf_addr, hi - lo) if to_buffer else (buf_addr, tensor, hi - lo)
            return np.array([row] if hi > lo else [], dtype=np.int64).reshape(-1, 3)
        all_starts, all_ends, srcs, dsts = self._tables()
        tensor_addrs = srcs if to_buffer else dsts
        first = int(np.searchsorted(all_ends, lo, side="right"))
        last = int(np.searchsorted(all_starts, hi, side="left"))
        starts, ends = all_starts[first:last], all_ends[first:last]
        s = np.maximum(starts, lo)
        n = np.minimum(ends, hi) - s
        tensor = tensor_addrs[first:last] + (s - starts) * self.itemsize
        buf = buf_addr + (s - lo) * self.itemsize
        rows = np.stack([tensor, buf, n] if to_buffer else [buf, tensor, n], axis=1)
        return rows[n > 0]

    def copy_rows(self) -> np.ndarray:
        """Byte rows copying every source straight to its destination (skipping in-place tensors)."""
        isz = self.itemsize
        rows = [(s, d, n * isz) for s, d, n in zip(self._src, self._dst, self._sizes) if s != d and n > 0]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def pack_rows(self, lo: int, hi: int, buf_addr: int) -> np.ndarray:
        """Rows copying bucket elements [lo, hi) from the sources into a buffer at ``buf_addr``."""
        return self._rows(lo, hi, buf_addr, to_buffer=True)

    def unpack_rows(self, lo: int, hi: int, buf_addr: int) -> np.ndarray:
        """Rows copying bucket elements [lo, hi) from a buffer at ``buf_addr`` to the destinations."""
        return self._rows(lo, hi, buf_addr, to_buffer=False)
