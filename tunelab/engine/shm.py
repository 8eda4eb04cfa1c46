"""Shared-memory segments for the ranks of one node.

Each rank owns one segment in an ``MPI.Win.Allocate_shared`` window and maps
every peer's segment, so kernels can reduce straight from peers' memory.  A
segment is split into two halves used alternately (double buffering): a rank
may refill one half while slower peers still read the other, which lets one
pipeline piece cost two barriers instead of three.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

_ALIGN = 256


class SharedArena:
    """``barrier``: the node's barrier, waited on (with its timeout) before a segment is allocated, so
    that a peer that left the call (an error on that rank alone) fails this rank in a timed wait, rather
    than leaving it in the window's allocation, which waits for every rank of the node for ever."""

    def __init__(self, local: MPI.Comm, barrier: NodeBarrier | None = None) -> None:
        self.local = local
        self._barrier = barrier
        self.half_bytes = 0
        self.parity = 0
        self._win: MPI.Win | None = None
        self._segments: list[np.ndarray] = []

    def ensure(self, half_bytes: int) -> None:
        """Make every half at least ``half_bytes`` long.  Collective over the node: all its ranks
        must call it with the same value (they do: sizes are agreed before any data moves)."""
        half_bytes = max(_ALIGN, -(-half_bytes // _ALIGN) * _ALIGN)
        if half_bytes <= self.half_bytes:
            return
        from mpi4py import MPI

        if self._barrier is not None:
            self._barrier.wait(what="growing the node's shared staging")
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


class NodeBarrier:
    """A barrier for the ranks of one node through flags in shared memory.

    Each rank publishes an increasing epoch in its own cache line (plus an optional
    int64 payload, double-buffered by epoch parity) and waits until every peer has
    reached that epoch.  Waiting polls ``spin`` times (the engine spins only when every
    rank of the host has a core), then yields the core with ``sched_yield`` — which keeps oversubscribed nodes (more ranks than cores) fast,
    where MPI's busy-polling barrier burns whole time slices — and fails with
    CollectiveTimeoutError after ``timeout_s`` instead of hanging.

    Ordering: on x86-64 its total store order makes data stores visible before the flag store
    that follows them, and a load after seeing a flag reads what was stored before it.  Other CPUs
    (aarch64: Grace) may reorder both, so there each wait puts a full memory barrier
    (``MPI_Win_sync`` on the barrier's window, in a passive epoch) before its flag store and after
    the peers' flags are seen: everything a rank wrote before a wait (shared-memory data, the
    shared-GPU mailbox) is visible to every peer after it.  ``fence`` forces either way.
    """

    _SLOT_INT64 = 16  # 128 bytes per rank: epoch, two payloads, padding against false sharing

    def __init__(self, local: MPI.Comm, timeout_s: float, spin: int = 64, fence: bool | None = None) -> None:
        import platform

        from mpi4py import MPI

        self.fenced = platform.machine().lower() not in ("x86_64", "amd64") if fence is None else bool(fence)
        self.local = local
        self.timeout_s = timeout_s
        self.spin = max(0, int(spin))  # polls before the first yield (0: yield at once)
        self.epoch = 0
        self._win = MPI.Win.Allocate_shared(self._SLOT_INT64 * 8, 8, comm=local)
        self._slots = []
        for peer in range(local.size):
            buf, _ = self._win.Shared_query(peer)
            self._slots.append(np.frombuffer(buf, dtype=np.int64)[:self._SLOT_INT64])
        self._slots[local.rank][:] = 0
        self._peers = [s for q, s in enumerate(self._slots) if q != local.rank]
        if self.fenced:
            self._win.Lock_all(MPI.MODE_NOCHECK)  # the passive epoch Win_sync needs, for good
        local.Barrier()  # every slot is zeroed before anyone waits on it

    def next_parity(self) -> int:
        """Parity of the next wait's epoch: the same on every rank of the node at the same call."""
        return (self.epoch + 1) & 1

    def wait(self, payload: int | None = None, what: str = "a node barrier") -> list[int] | None:
        """Wait for every rank of the node; returns all payloads (in local-rank order) if given."""
        self.epoch += 1
        epoch = self.epoch
        mine = self._slots[self.local.rank]
        if payload is not None:
            mine[1 + epoch % 2] = payload
        if self.fenced:
            self._win.Sync()  # this rank's stores before its flag
        mine[0] = epoch
        for slot in self._peers:
            if slot[0] < epoch:
                self._await(slot, epoch, what)
        if self.fenced:
            self._win.Sync()  # the peers' stores, seen after their flags
        if payload is None:
            return None
        return [int(slot[1 + epoch % 2]) for slot in self._slots]

    def wait_agreeing(self, payload: int, what: Callable[[], str]) -> bool:
        """Wait for every rank of the node, publishing ``payload``: whether all payloads are equal.
        ``what`` names the call for a timeout message (built only then)."""
        self.epoch += 1
        epoch = self.epoch
        k = 1 + epoch % 2
        mine = self._slots[self.local.rank]
        mine[k] = payload
        if self.fenced:
            self._win.Sync()
        mine[0] = epoch
        for slot in self._peers:
            if slot[0] < epoch:
                self._await(slot, epoch, what)
        if self.fenced:
            self._win.Sync()
        return all(slot[k] == payload for slot in self._peers)

    def _await(self, slot: np.ndarray, epoch: int, what: str | Callable[[], str]) -> None:
        """Poll ``slot`` until it reaches ``epoch``: spin, then yield the core, then sleep; fail after
        the timeout."""
        import os
        import time

        from ..errors import CollectiveTimeoutError
        from .consensus import say_still_waiting, warning_deadline

        for _ in range(self.spin):
            if slot[0] >= epoch:
                return
        deadline = warn_at = None
        spins = 0
        while slot[0] < epoch:
            spins += 1
            os.sched_yield()
            if spins % 1024 == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline, warn_at = now + self.timeout_s, warning_deadline(now, self.timeout_s)
                if now > deadline or now > warn_at:
                    name = what() if callable(what) else what
                    if now > deadline:
                        raise CollectiveTimeoutError(
                            f"rank {self.local.rank} of its node: peers did not reach {name} within "
                            f"{self.timeout_s:g} s (a rank died, stalled, or skipped the call)")
                    say_still_waiting(f"rank {self.local.rank} of its node: ", f"the node's other ranks to reach {name}",
                                      self.timeout_s)
                    warn_at = math.inf
                if spins > 200_000:
                    time.sleep(0.0001)  # long waits: stop burning the core

    def free(self) -> None:
        self._slots = []
        self._peers = []
        if self.fenced:
            self._win.Unlock_all()
        self._win.Free()
