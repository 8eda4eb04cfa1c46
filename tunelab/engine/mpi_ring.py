"""Ring allreduce over MPI point-to-point messages (the path between nodes).

Reduce-scatter then allgather, N-1 steps each.  Every chunk travels in pieces of
``segment_bytes`` so the reduction of one piece overlaps the receipt of the
next.  Chunk c is combined in ring order starting at rank c, so a given bucket
layout always gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..kernels import KernelBackend, ReduceOp

if TYPE_CHECKING:
    from mpi4py import MPI

    from .link import EmulatedLink

_TAG = 0x7E1
Reduce = Callable[[int, np.ndarray, int, np.dtype, ReduceOp], None]


def _pieces(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


class RingAllreduce:
    """In-place ring allreduce over one communicator, on raw memory: host arrays (``__call__``), or
    any addresses the MPI library can read, such as device memory with a CUDA-aware MPI (``run``).
    ``link``: the emulated link that everything received from the left neighbour passes through
    (None: not slowed)."""

    def __init__(self, comm: MPI.Comm, kernels: KernelBackend, link: EmulatedLink | None = None) -> None:
        self.comm = comm
        self.kernels = kernels
        self.link = link
        self._scratch = np.empty(0, dtype=np.uint8)

    def __call__(self, buf: np.ndarray, op: ReduceOp, segment_bytes: int) -> None:
        self.run(buf.ctypes.data, buf.size, buf.dtype, op, segment_bytes, self.kernels.reduce, self.host_scratch)

    def host_scratch(self, nbytes: int) -> int:
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch.ctypes.data

    def run(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp, segment_bytes: int,
            reduce: Reduce, scratch: Callable[[int], int], sync: Callable[[], None] | None = None) -> None:
        """Allreduce ``count`` elements at ``addr``, combining with ``reduce(out, srcs, count, dtype,
        op)``; ``scratch(nbytes)`` gives the address of a receive area in the same kind of memory.
        ``sync`` (device memory): waits for the reductions before MPI reads what they wrote, and
        before a receive reuses memory a reduction reads."""
        n, rank = self.comm.size, self.comm.rank
        if n == 1 or count == 0:
            return
        isz = dtype.itemsize
        step = max(1, segment_bytes // isz)
        slots = scratch(2 * step * isz)
        bounds = [count * j // n for j in range(n + 1)]
        right, left = (rank + 1) % n, (rank - 1) % n
        for s in range(n - 1):
            send_c, recv_c = (rank - s) % n, (rank - s - 1) % n
            self._reduce_step(addr, dtype, op, step, bounds[send_c:send_c + 2], bounds[recv_c:recv_c + 2],
                              right, left, reduce, (slots, slots + step * isz), sync)
        for s in range(n - 1):
            send_c, recv_c = (rank - s + 1) % n, (rank - s) % n
            lo, hi = bounds[recv_c], bounds[recv_c + 1]
            self.comm.Sendrecv(_mem(addr + bounds[send_c] * isz, (bounds[send_c + 1] - bounds[send_c]) * isz),
                               right, _TAG, _mem(addr + lo * isz, (hi - lo) * isz), left, _TAG)
            if self.link is not None:
                self.link.transfer((hi - lo) * isz)

    def _reduce_step(self, addr: int, dtype: np.dtype, op: ReduceOp, step: int, send: list[int],
                     recv: list[int], right: int, left: int, reduce: Reduce,
                     slots: tuple[int, int], sync: Callable[[], None] | None) -> None:
        isz = dtype.itemsize
        if sync is not None:
            sync()  # what the previous step reduced is what this one sends
        sends = [self.comm.Isend(_mem(addr + a * isz, (b - a) * isz), right, _TAG)
                 for a, b in _pieces(send[0], send[1], step)]
        pieces = _pieces(recv[0], recv[1], step)
        recvs = [self.comm.Irecv(_mem(slots[k], (b - a) * isz), left, _TAG)
                 for k, (a, b) in enumerate(pieces[:2])]
        for k, (a, b) in enumerate(pieces):
            recvs[k].Wait()
            if self.link is not None:
                self.link.transfer((b - a) * isz)
            here = addr + a * isz
            reduce(here, np.array([slots[k % 2], here], dtype=np.int64), b - a, dtype, op)
            if k + 2 < len(pieces):
                if sync is not None:
                    sync()  # the reduce has read slot k % 2 before it is refilled
                c, d = pieces[k + 2]
                recvs.append(self.comm.Irecv(_mem(slots[k % 2], (d - c) * isz), left, _TAG))
        for req in sends:
            req.Wait()


def _mem(addr: int, nbytes: int) -> list:
    """An MPI message over raw memory (host, or device memory for a CUDA-aware MPI)."""
    from mpi4py import MPI

    return [MPI.buffer.fromaddress(addr, nbytes), MPI.BYTE]
