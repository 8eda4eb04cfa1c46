"""Ring allreduce over MPI point-to-point messages (the path between nodes).

Reduce-scatter then allgather, N-1 steps each.  Every chunk travels in pieces of
``segment_bytes`` so the reduction of one piece overlaps the receipt of the
next.  Chunk c is combined in ring order starting at rank c, so a given bucket
layout always gives the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..kernels import KernelBackend, ReduceOp

if TYPE_CHECKING:
    from mpi4py import MPI

    from .link import EmulatedLink

_TAG = 0x7E1


def _pieces(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


class RingAllreduce:
    """In-place ring allreduce of flat arrays over one communicator.  ``link``: the emulated
    link that everything received from the left neighbour passes through (None: not slowed)."""

    def __init__(self, comm: MPI.Comm, kernels: KernelBackend, link: EmulatedLink | None = None) -> None:
        self.comm = comm
        self.kernels = kernels
        self.link = link
        self._scratch = np.empty(0, dtype=np.uint8)

    def __call__(self, buf: np.ndarray, op: ReduceOp, segment_bytes: int) -> None:
        n, rank = self.comm.size, self.comm.rank
        if n == 1 or buf.size == 0:
            return
        step = max(1, segment_bytes // buf.itemsize)
        if self._scratch.size < 2 * step * buf.itemsize:
            self._scratch = np.empty(2 * step * buf.itemsize, dtype=np.uint8)
        bounds = [buf.size * j // n for j in range(n + 1)]
        right, left = (rank + 1) % n, (rank - 1) % n
        for s in range(n - 1):
            send_c, recv_c = (rank - s) % n, (rank - s - 1) % n
            self._reduce_step(buf, op, step, bounds[send_c:send_c + 2], bounds[recv_c:recv_c + 2],
                              right, left)
        raw = buf.view(np.uint8)
        isz = buf.itemsize
        for s in range(n - 1):
            send_c, recv_c = (rank - s + 1) % n, (rank - s) % n
            self.comm.Sendrecv([raw[bounds[send_c] * isz:bounds[send_c + 1] * isz], _byte()],
                               right, _TAG,
                               [raw[bounds[recv_c] * isz:bounds[recv_c + 1] * isz], _byte()],
                               left, _TAG)
            if self.link is not None:
                self.link.transfer((bounds[recv_c + 1] - bounds[recv_c]) * isz)

    def _reduce_step(self, buf: np.ndarray, op: ReduceOp, step: int, send: list[int],
                     recv: list[int], right: int, left: int) -> None:
        isz = buf.itemsize
        raw = buf.view(np.uint8)
        sends = [self.comm.Isend([raw[a * isz:b * isz], _byte()], right, _TAG)
                 for a, b in _pieces(send[0], send[1], step)]
        pieces = _pieces(recv[0], recv[1], step)
        slots = [self._scratch[k * step * isz:(k + 1) * step * isz] for k in (0, 1)]
        recvs = [self._post_recv(slots[k], pieces[k], isz, left) for k in range(min(2, len(pieces)))]
        for k, (a, b) in enumerate(pieces):
            recvs[k].Wait()
            if self.link is not None:
                self.link.transfer((b - a) * isz)
            here = buf.ctypes.data + a * isz
            srcs = np.array([slots[k % 2].ctypes.data, here], dtype=np.intp)
            self.kernels.reduce(here, srcs, b - a, buf.dtype, op)
            if k + 2 < len(pieces):
                recvs.append(self._post_recv(slots[k % 2], pieces[k + 2], isz, left))
        for req in sends:
            req.Wait()

    def _post_recv(self, slot: np.ndarray, piece: tuple[int, int], isz: int, left: int) -> MPI.Request:
        nbytes = (piece[1] - piece[0]) * isz
        return self.comm.Irecv([slot[:nbytes], _byte()], left, _TAG)


def _byte() -> MPI.Datatype:
    from mpi4py import MPI

    return MPI.BYTE
