"""Data paths: how one kind of memory moves a bucket between the ranks of a node.

The algorithms (:mod:`tunelab.engine.algorithms`: one-shot, two-shot, the flat ring) are written
once against :class:`DataPath`; a path supplies the memory they stage through, the kernels that
touch it, and the *ordering point* that makes one rank's writes visible to its peers:

* :class:`HostPath`: host memory.  Staging segments in an MPI shared-memory window, Numba CPU
  kernels, and a barrier of flags in shared memory (x86-64 stores are seen in order, so a flag
  written after the data publishes the data).
* :class:`tunelab.engine.device.DevicePath`: device memory, ordered on the engine's own CUDA
  stream (see that module).

One collective is described by a :class:`Call` (one struct per collective, as nccl-tests keeps):
the op, the average's factor, and the per-call digest ranks agree on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..kernels import ReduceOp
from .shm import NodeBarrier, SharedArena

if TYPE_CHECKING:
    from mpi4py import MPI

    from .mpi_ring import RingAllreduce


@dataclass(frozen=True)
class Call:
    """What every bucket of one collective shares."""

    op: ReduceOp
    factor: float  # 1/N for average, else 1.0

    def scales(self, dtype: np.dtype) -> tuple[float, float]:
        """The factors applied while packing and while unpacking a bucket of ``dtype``: their product
        is :attr:`factor`.  Averages scale after the sum, except in float16, whose sums overflow at
        65504 although their average may not: there each input is first scaled by ``1/P``, ``P``
        the smallest power of two at least the rank count (exact for every normal value), and the
        sum by ``P/N``, so no partial sum exceeds the largest input.  For inputs whose sums are
        exact, the bits are those of the sum scaled once; what is lost are the low bits of values
        that ``1/P`` takes below float16's smallest normal, 6.1e-5 (NCCL scales every float
        average before its sum, and torch DDP divides gradients before it sums them, alike)."""
        if self.factor == 1.0 or dtype != _FLOAT16:
            return 1.0, self.factor
        n = round(1.0 / self.factor)
        p = 1 << (n - 1).bit_length()
        return 1.0 / p, p / n


_FLOAT16 = np.dtype(np.float16)


class DataPath(Protocol):
    """What the algorithms need from a kind of memory."""

    device: bool
    kernels: Any
    arena: Any  # two-shot staging: ensure(half_bytes), half_addrs(parity), parity
    slots: Any  # one-shot staging: the same interface, sized for ``oneshot_max_bytes``
    barrier: NodeBarrier  # the node's barrier (its epoch parity picks the one-shot half)

    def copy(self, rows: np.ndarray) -> None:
        """Copy every ``(src, dst, nbytes)`` row."""

    def scale_copy(self, rows: np.ndarray, dtype: np.dtype, factor: float) -> None:
        """``dst = src * factor`` for every ``(src, dst, count)`` row."""

    def reduce(self, out: int, srcs: np.ndarray, count: int, dtype: np.dtype, op: ReduceOp) -> None:
        """``out = op(srcs...)`` in the order given (out may alias a source)."""

    def order(self, what: str) -> None:
        """The node's ordering point: this rank's staging writes become visible to its peers, and
        theirs to it, before anyone goes on."""

    def scratch(self, nbytes: int) -> int:
        """Address of a private buffer of at least ``nbytes`` (contents undefined)."""

    def cross_allreduce(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp,
                        ring: RingAllreduce, segment_bytes: int) -> None:
        """Allreduce ``count`` elements at ``addr`` (this path's memory) over ``ring``, in place."""


class HostPath:
    """Host memory: shared-memory staging, Numba CPU kernels, a flag barrier."""

    device = False

    def __init__(self, local: MPI.Comm, kernels: Any, barrier: NodeBarrier) -> None:
        self.kernels = kernels
        self.arena = SharedArena(local, barrier)
        self.slots = SharedArena(local, barrier)
        self.barrier = barrier
        self._scratch = np.empty(0, dtype=np.uint8)

    def copy(self, rows: np.ndarray) -> None:
        self.kernels.copy_table(rows)

    def scale_copy(self, rows: np.ndarray, dtype: np.dtype, factor: float) -> None:
        self.kernels.scale_copy_table(rows, dtype, factor)

    def reduce(self, out: int, srcs: np.ndarray, count: int, dtype: np.dtype, op: ReduceOp) -> None:
        self.kernels.reduce(out, srcs, count, dtype, op)

    def order(self, what: str) -> None:
        self.barrier.wait(what=what)

    def scratch(self, nbytes: int) -> int:
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return int(self._scratch.ctypes.data)

    def cross_allreduce(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp,
                        ring: RingAllreduce, segment_bytes: int) -> None:
        ring.run(addr, count, dtype, op, segment_bytes, self.kernels.reduce, ring.host_scratch)

    def ensure_slots(self, oneshot_max_bytes: int) -> None:
        """Size the one-shot staging (collective over the node, like every arena change)."""
        self.slots.ensure(max(oneshot_max_bytes, 1))

    def free(self) -> None:
        self.slots.free()
        self.arena.free()
