"""Shared-memory segments for the ranks of one node.

Each rank owns one segment in an ``MPI.Win.Allocate_shared`` window and maps
every peer's segment, so kernels can reduce straight from peers' memory.  A
segment is split into two halves used alternately (double buffering): a rank
may refill one half while slower peers still read the other, which lets one
pipeline piece cost two barriers instead of three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

_ALIGN = 256


class SharedArena:
    def __init__(self, local: "MPI.Comm") -> None:
        self.local = local
        self.half_bytes = 0
        self.parity = 0
        self._win: "MPI.Win | None" = None
        self._segments: list[np.ndarray] = []

    def ensure(self, half_bytes: int) -> None:
        """Make every half at least ``half_bytes`` long.  Collective over the node: all its ranks
        must call it with the same value (they do: sizes are agreed before any data moves)."""
        half_bytes = max(_ALIGN, -(-half_bytes // _ALIGN) * _ALIGN)
        if half_bytes <= self.half_bytes:
            return
        from mpi4py import MPI

        self.free()
        self._win = MPI.Win.Allocate_shared(2 * half_bytes, 1, comm=self.local)
        self._segments = []
        for peer in range(self.local.size):
            buf, _ = self._win.Shared_query(peer)
            self._segments.append(np.frombuffer(buf, dtype=np.uint8))
        self.half_bytes = half_bytes
        self.parity = 0

    def half(self, peer: int, parity: int) -> np.ndarray:
        """Bytes of ``peer``'s half ``parity`` (a writable view on shared memory)."""
        start = parity * self.half_bytes
        return self._segments[peer][start:start + self.half_bytes]

    def half_addrs(self, parity: int) -> np.ndarray:
        """Addresses of half ``parity`` of every rank's segment, in local-rank order."""
        return np.array([seg.ctypes.data + parity * self.half_bytes for seg in self._segments],
                        dtype=np.intp)

    def free(self) -> None:
        self._segments = []
        if self._win is not None:
            self._win.Free()
            self._win = None
        self.half_bytes = 0
