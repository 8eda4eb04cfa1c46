"""Allreduce over MPI point-to-point messages (the path between nodes): a ring, and recursive
doubling for small buffers.

* The ring: reduce-scatter then allgather, N-1 steps each.  Every chunk travels in pieces of
  ``segment_bytes`` so the reduction of one piece overlaps the receipt of the next.  Chunk c is
  combined in ring order starting at rank c, so a given bucket layout always gives the same bits.
* Recursive doubling (buffers up to ``doubling_max_bytes``): in step k every rank swaps its whole
  partial result with rank ``r xor 2^k`` and both combine the two, so ``log2 N`` messages replace the
  ring's ``2 (N-1)``: latency-bound buffers pay a fraction of the waits, for ``log2 N`` times the
  bytes of one buffer sent (the ring sends ``2 (N-1)/N`` of it).  With N not a power of two, the
  ranks past the largest power of two first hand their buffer to a partner and get the result back
  at the end (two more messages for them).  Both ranks of a pair combine the lower rank's partial
  first, so every rank ends with the same bits (``min(+0, -0)`` included).
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels import KernelBackend, ReduceOp
from .consensus import say_still_waiting, warning_deadline

if TYPE_CHECKING:
    from mpi4py import MPI

    from .link import EmulatedLink

_TAG = 0x7E1
Reduce = Callable[[int, np.ndarray, int, np.dtype, ReduceOp], None]


def _pieces(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


class RingAllreduce:
    """In-place allreduce over one communicator, on raw memory: host arrays (``__call__``), or any
    addresses the MPI library can read, such as device memory with a CUDA-aware MPI (``run``).
    ``link``: the emulated link that everything received from the left neighbour passes through
    (None: not slowed); ``node_link`` and ``remote``: the same for recursive doubling, whose partners
    change from step to step."""

    def __init__(self, comm: MPI.Comm, kernels: KernelBackend, link: EmulatedLink | None = None,
                 node_link: EmulatedLink | None = None, remote: frozenset[int] = frozenset(),
                 timeout_s: float = math.inf) -> None:
        self.comm = comm
        self.kernels = kernels
        # MPI's blocking transfers cannot be interrupted: each is given a deadline that the watchdog
        # (below) reads, and a peer that sends nothing within ``timeout_s`` ends the job with a line
        self.timeout_s = timeout_s
        self.deadline = math.inf  # of the transfer under way (inf: none)
        self.warn_at = math.inf   # when the watchdog says it is still waiting for that transfer
        self.what = ""
        if math.isfinite(timeout_s) and comm.size > 1:
            _watch(self)
        self.link = link
        self.node_link = node_link  # this rank's emulated node link, which whatever arrives from ...
        self.remote = remote        # ... these ranks of ``comm`` (on other emulated nodes) passes through
        self.doubling_max_bytes = 0  # set from the knobs, alike on every rank (Engine.set_knobs)
        self._scratch = np.empty(0, dtype=np.uint8)

    def __call__(self, buf: np.ndarray, op: ReduceOp, segment_bytes: int) -> None:
        self.run(buf.ctypes.data, buf.size, buf.dtype, op, segment_bytes, self.kernels.reduce, self.host_scratch)

    def host_scratch(self, nbytes: int) -> int:
        return self.host_area(nbytes).ctypes.data

    def host_area(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of this ring's host receive area (grown when needed, shared by its calls)."""
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]

    def run(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp, segment_bytes: int,
            reduce: Reduce, scratch: Callable[[int], int], sync: Callable[[], None] | None = None) -> None:
        """Allreduce ``count`` elements at ``addr``, combining with ``reduce(out, srcs, count, dtype,
        op)``; ``scratch(nbytes)`` gives the address of a receive area in the same kind of memory.
        ``sync`` (device memory): waits for the reductions before MPI reads what they wrote, and
        before a receive reuses memory a reduction reads."""
        if self.comm.size == 1 or count == 0:
            return
        try:
            self._run(addr, count, dtype, op, segment_bytes, reduce, scratch, sync)
        finally:
            self.deadline = self.warn_at = math.inf

    def _arm(self, what: str) -> None:
        """A blocking transfer starts: it must end within the timeout."""
        now = time.monotonic()
        self.deadline, self.warn_at, self.what = now + self.timeout_s, warning_deadline(now, self.timeout_s), what

    def _run(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp, segment_bytes: int,
             reduce: Reduce, scratch: Callable[[int], int], sync: Callable[[], None] | None) -> None:
        n, rank = self.comm.size, self.comm.rank
        isz = dtype.itemsize
        if count * isz <= self.doubling_max_bytes:
            self._doubling(addr, count, dtype, op, reduce, scratch(count * isz), sync)
            return
        step = max(1, segment_bytes // isz)
        slots = scratch(2 * step * isz)
        bounds = [count * j // n for j in range(n + 1)]
        right, left = (rank + 1) % n, (rank - 1) % n
        for s in range(n - 1):
            send_c, recv_c = (rank - s) % n, (rank - s - 1) % n
            self._reduce_step(addr, dtype, op, step, bounds[send_c:send_c + 2], bounds[recv_c:recv_c + 2],
                              right, left, reduce, (slots, slots + step * isz), sync)
        if sync is not None:
            sync()  # the allgather's first send is the chunk the last step reduced
        for s in range(n - 1):
            send_c, recv_c = (rank - s + 1) % n, (rank - s) % n
            lo, hi = bounds[recv_c], bounds[recv_c + 1]
            self._arm(f"step {s + 1} of the ring's allgather")
            self.comm.Sendrecv(_mem(addr + bounds[send_c] * isz, (bounds[send_c + 1] - bounds[send_c]) * isz),
                               right, _TAG, _mem(addr + lo * isz, (hi - lo) * isz), left, _TAG)
            self.deadline = math.inf  # (only the wait is timed: not the emulated link's delay, nor a reduce)
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
        sent = None  # the step's pieces leave the left neighbour back to back: on the wire from its first
        for k, (a, b) in enumerate(pieces):
            self._arm("a step of the ring's reduce-scatter")
            recvs[k].Wait()
            self.deadline = math.inf
            if self.link is not None:
                sent = time.monotonic() if sent is None else sent
                self.link.transfer((b - a) * isz, sent)
            here = addr + a * isz
            reduce(here, np.array([slots[k % 2], here], dtype=np.int64), b - a, dtype, op)
            if k + 2 < len(pieces):
                if sync is not None:
                    sync()  # the reduce has read slot k % 2 before it is refilled
                c, d = pieces[k + 2]
                recvs.append(self.comm.Irecv(_mem(slots[k % 2], (d - c) * isz), left, _TAG))
        self._arm("a step of the ring's reduce-scatter")
        for req in sends:
            req.Wait()
        self.deadline = math.inf


    def _doubling(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp, reduce: Reduce, tmp: int,
                  sync: Callable[[], None] | None) -> None:
        """Recursive doubling of ``count`` elements at ``addr``, receiving into ``tmp`` (see the module
        doc)."""
        nbytes = count * dtype.itemsize

        def combine(first: int, second: int) -> None:
            reduce(addr, np.array([first, second], dtype=np.int64), count, dtype, op)

        self.butterfly(addr, tmp, nbytes, lambda at: _mem(at, nbytes), combine, sync)

    def doubling(self, buf: np.ndarray, tmp: np.ndarray, combine: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Recursive doubling of a host array in place (``tmp``: a receive area like it): MPI reads and
        writes the arrays themselves, and ``combine(first, second)`` reduces the two into ``buf``
        (the lower rank's partial first)."""
        self.butterfly(buf, tmp, buf.nbytes, lambda arr: arr.reshape(-1).view(np.uint8), combine, None)

    def butterfly(self, buf: Any, tmp: Any, nbytes: int, message: Callable[[Any], Any],
                  combine: Callable[[Any, Any], None], sync: Callable[[], None] | None) -> None:
        """The steps of recursive doubling over this communicator on ``buf`` (memory of any kind:
        ``message(x)`` makes ``buf`` or ``tmp`` an MPI message of ``nbytes``), combining the partner's
        partial in ``tmp`` with ``combine(first, second)`` into ``buf``."""
        self._arm("recursive doubling")  # (every message of it is short: one deadline for all)
        try:
            self._butterfly(buf, tmp, nbytes, message, combine, sync)
        finally:
            self.deadline = math.inf

    def _butterfly(self, buf: Any, tmp: Any, nbytes: int, message: Callable[[Any], Any],
                   combine: Callable[[Any, Any], None], sync: Callable[[], None] | None) -> None:
        n, rank = self.comm.size, self.comm.rank
        high = 1 << (n.bit_length() - 1)  # the largest power of two <= n
        if rank >= high:  # an extra rank: hand the buffer over, get the result back
            if sync is not None:
                sync()
            self.comm.Send(message(buf), rank - high, _TAG)
            self.comm.Recv(message(buf), rank - high, _TAG)
            self._arrived(rank - high, nbytes)
            return
        if rank + high < n:
            self.comm.Recv(message(tmp), rank + high, _TAG)
            self._arrived(rank + high, nbytes)
            combine(buf, tmp)
        mask = 1
        while mask < high:
            peer = rank ^ mask
            if sync is not None:
                sync()  # what was reduced is what goes out; the reduce has read tmp before it is refilled
            self.comm.Sendrecv(message(buf), peer, _TAG, message(tmp), peer, _TAG)
            self._arrived(peer, nbytes)
            combine(*((buf, tmp) if rank < peer else (tmp, buf)))  # the lower rank's partial first
            mask <<= 1
        if rank + high < n:
            if sync is not None:
                sync()
            self.comm.Send(message(buf), rank + high, _TAG)

    def _arrived(self, peer: int, nbytes: int) -> None:
        """``nbytes`` came from ``peer``: through the emulated link when it is on another emulated node."""
        if self.node_link is not None and peer in self.remote:
            self.node_link.transfer(nbytes)


_WATCHED: weakref.WeakSet[RingAllreduce] = weakref.WeakSet()
_watch_lock = threading.Lock()
_watchdog_thread: threading.Thread | None = None
_FATAL_HOOKS: list[Callable[[str], None]] = []


def on_fatal(hook: Callable[[str], None]) -> None:
    """Have ``hook(line)`` called with the watchdog's line before it ends the job: ``MPI_Abort`` may tear
    the job down before the rank's stderr is forwarded (tunelab's rank entry leaves the line beside its
    result, where the launcher reads it)."""
    _FATAL_HOOKS.append(hook)


def _watch(ring: RingAllreduce) -> None:
    """Have the process's watchdog thread look at ``ring``'s deadlines (started with the first)."""
    global _watchdog_thread
    with _watch_lock:
        _WATCHED.add(ring)
        if _watchdog_thread is None:
            _watchdog_thread = threading.Thread(target=_watchdog, name="tunelab-ring-watchdog", daemon=True)
            _watchdog_thread.start()


def _watchdog() -> None:
    """Every quarter of a second: a blocking transfer past its deadline means a peer died, stalled
    or skipped the call, and MPI gives no way to stop waiting for it; say so in one line and end the
    job (MPI_Abort), rather than wait for ever."""
    from mpi4py import MPI  # (imported already: a ring exists)

    while True:
        time.sleep(0.25)
        now = time.monotonic()
        with _watch_lock:
            late = [r for r in _WATCHED if r.deadline < now]
            slow = [r for r in _WATCHED if r.warn_at < now]
        for ring in slow:
            ring.warn_at = math.inf
            say_still_waiting(f"rank {MPI.COMM_WORLD.rank}: ", f"its neighbour to send in {ring.what} between nodes", ring.timeout_s)
        if late:
            ring = late[0]
            line = (f"tunelab: error: rank {MPI.COMM_WORLD.rank}: nothing came within {ring.timeout_s:g} s in "
                    f"{ring.what} between nodes (a rank died, stalled, or skipped the call); ending the job")
            for hook in _FATAL_HOOKS:
                try:
                    hook(line)
                except Exception:  # noqa: BLE001, S110 - the job ends anyway; stderr still carries the line
                    pass
            print(line, file=sys.stderr, flush=True)
            time.sleep(0.5)  # (MPI's launcher forwards stderr on its own time: a moment before the abort)
            MPI.COMM_WORLD.Abort(1)


def _mem(addr: int, nbytes: int) -> list:
    """An MPI message over raw memory (host, or device memory for a CUDA-aware MPI)."""
    from mpi4py import MPI

    return [MPI.buffer.fromaddress(addr, nbytes), MPI.BYTE]
