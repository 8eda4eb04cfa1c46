"""Rank agreement before any data moves.

Each collective call hashes what this rank submitted (op, dtypes, shapes,
groups).  A non-blocking allreduce of (hash, -hash) with MAX tells every rank at
once whether all hashes are equal; it is polled against a deadline, so a rank
that died or skipped the call produces an error instead of a hang.  On a
mismatch every rank gathers the descriptions and raises the same message.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..config import DEFAULT_STALL_WARNING_S
from ..dtypes import dtype_name_from_code
from ..errors import CollectiveTimeoutError, RankExitedError, RankMismatchError

if TYPE_CHECKING:
    from mpi4py import MPI

    from .shm import NodeBarrier

_yield = getattr(os, "sched_yield", lambda: None)  # give the core to a rank waited for, where ranks share it
_SPIN_TESTS = 20  # then sleep: waiting threads must leave the cores to the training


DEVICE_ROW = 1 << 8  # the engine's mark for a device tensor in a row's dtype code


def signature_hash(header: tuple[int, ...], rows: list[tuple[int, ...]]) -> int:
    """A non-negative int63 digest.  Python hashes tuples of ints the same way in every process
    (PYTHONHASHSEED only salts str and bytes), so ranks can compare digests."""
    return hash((header, tuple(rows))) & 0x3FFF_FFFF_FFFF_FFFF


# Requests abandoned by a timeout, still active: kept for the life of the process.  Dropped, mpi4py would
# free an active collective's request (erroneous in MPI) and let Python reclaim its buffers, which a
# peer arriving late would then write into.
_PARKED: list[tuple[MPI.Request, object]] = []


# How long a wait for other ranks runs before it says so: the engine made last sets it from its
# settings (``stall_warning_s``), process-wide, like the TUNELAB_* environment it comes from.
_warning_s = DEFAULT_STALL_WARNING_S


def set_stall_warning(seconds: float) -> None:
    global _warning_s
    _warning_s = seconds


def warning_deadline(start: float, timeout_s: float) -> float:
    """When a wait that began at ``start`` says it is still waiting (never, where it fails first)."""
    return start + _warning_s if _warning_s < timeout_s else math.inf


def say_still_waiting(who: str, what: str, timeout_s: float) -> None:
    """One line on standard error: ``who`` ("rank 3: ", or "") has waited ``stall_warning_s`` for
    ``what`` ("the other ranks to reach the barrier"; a rank evaluating or saving a checkpoint alone, a
    rank stuck, or one that skipped the call), and fails when ``timeout_s`` has passed."""
    with contextlib.suppress(Exception):  # (a closed standard error must not end the wait)
        print(f"tunelab: warning: {who}waited {_warning_s:g} s so far for {what}; it fails after {timeout_s:g} s "
              "(see TUNELAB_TIMEOUT_S)", file=sys.stderr, flush=True)


def park(req: MPI.Request, keep: object = None) -> None:
    """Keep an active request (and ``keep``) alive for the life of the process (see ``_PARKED``)."""
    _PARKED.append((req, keep))


# How long a wait goes on after the coordinator saw a rank leave: an exchange that rank made before it
# left completes here within it (its data came before the coordinator's word that it left)
LEFT_GRACE_S = 1.0


def wait_or_timeout(req: MPI.Request, timeout_s: float, what: str, rank: int, spin_s: float = 0.0,
                    keep: object = None, gone: Callable[[], tuple[int, ...]] | None = None) -> None:
    """Wait for ``req``; CollectiveTimeoutError after ``timeout_s``.  Polls briefly (for ``spin_s``
    seconds when given, yielding the core between polls: a round trip between hosts takes tens of
    microseconds, and a sleep at least 50 us more), then sleeps between polls.  On a timeout the request
    (which holds its buffers) and ``keep`` (what else it writes into, such as the communicator an
    ``Idup`` makes) are kept alive for good rather than freed while MPI may still use them.  ``gone``:
    the ranks known to have left the job (shut down): a wait that one of them has not completed
    within ``LEFT_GRACE_S`` of that raises RankExitedError naming them, rather than wait for the
    timeout."""
    if req.Test():
        return
    if spin_s > 0.0:
        until = time.perf_counter() + spin_s
        while time.perf_counter() < until:
            if req.Test():
                return
            _yield()
    start = time.monotonic()
    deadline, warn_at = start + timeout_s, warning_deadline(start, timeout_s)
    left: tuple[int, ...] = ()
    grace_end = math.inf
    tests = 0
    while not req.Test():
        tests += 1
        if tests > _SPIN_TESTS:
            now = time.monotonic()
            if gone is not None and not left:
                left = tuple(r for r in gone() if r != rank)
                if left:
                    grace_end = now + LEFT_GRACE_S
            if now > grace_end:
                park(req, keep)
                raise RankExitedError(
                    f"rank {rank}: {_ranks(list(left))} shut down (a script that ended or raised) while this rank "
                    f"waited for {'it' if len(left) == 1 else 'them'} in {what}")
            if now > deadline:
                park(req, keep)
                raise CollectiveTimeoutError(
                    f"rank {rank}: other ranks did not reach {what} within {timeout_s:g} s "
                    "(a rank died, stalled, or skipped the call)")
            if now > warn_at:
                say_still_waiting(f"rank {rank}: ", f"the other ranks to reach {what}", timeout_s)
                warn_at = math.inf
            time.sleep(0.00005)


def all_came(comm: MPI.Comm, timeout_s: float, what: str, rounds: int = 1) -> bool:
    """Whether every rank of ``comm`` reached this point: ``rounds`` barriers, each waited for up to
    ``timeout_s`` (False, not an error, where one was not complete by then).  A second round makes the
    verdict the same on every rank unless a rank stalls about ``timeout_s`` between the two: with one, a
    rank whose wait ran out just as the last rank came says False while that one says True."""
    try:
        for _ in range(rounds):
            wait_or_timeout(comm.Ibarrier(), timeout_s, what, comm.rank)
    except CollectiveTimeoutError:
        return False
    return True


# A size no pickle has: sent instead of an object that could not be pickled, so every rank raises
# at once (the others would otherwise wait in the exchange into its timeout, and pair their next
# exchange with this one's data)
_UNPICKLABLE = -1


def _pickled(obj: object) -> tuple[np.ndarray | None, BaseException | None]:
    """``obj`` pickled as bytes, or the error pickling it raised (a lambda, a lock, a local class)."""
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8), None
    except Exception as exc:  # noqa: BLE001 (raised by the caller once every rank knows)
        return None, exc


def _ranks(ranks: list[int]) -> str:
    listed = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank {listed}" if len(ranks) == 1 else f"ranks {listed}"


def allgather_object(comm: MPI.Comm, obj: object, timeout_s: float, what: str, rank: int,
                     gone: Callable[[], tuple[int, ...]] | None = None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, as ``comm.allgather`` gives it, but through
    non-blocking collectives waited for with a timeout: a peer that stopped (its thread failed
    between two exchanges) makes this raise CollectiveTimeoutError instead of blocking for ever."""
    from mpi4py import MPI

    data, error = _pickled(obj)
    sizes = np.empty(comm.size, dtype=np.int64)
    mine = np.array([_UNPICKLABLE if error else data.size], dtype=np.int64)
    wait_or_timeout(comm.Iallgather(mine, sizes), timeout_s, what, rank, gone=gone)
    if error is not None:
        raise error
    failed = [r for r, n in enumerate(sizes) if n == _UNPICKLABLE]
    if failed:  # every rank stops at once: the others' objects are not exchanged
        raise RankMismatchError(f"{what}: {_ranks(failed)} could not pickle its object")
    offsets = np.zeros(comm.size, dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    everyone = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait_or_timeout(comm.Iallgatherv(data, [everyone, sizes, offsets, MPI.BYTE]), timeout_s, what, rank, gone=gone)
    return [pickle.loads(everyone[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]


def bcast_object(comm: MPI.Comm, obj: object, root: int, timeout_s: float, what: str, rank: int,
                 gone: Callable[[], tuple[int, ...]] | None = None) -> object:
    """``obj`` of ``root`` on every rank, as ``comm.bcast`` gives it, with a timeout (as
    :func:`allgather_object`)."""
    data, error = _pickled(obj) if rank == root else (None, None)
    size = np.array([_UNPICKLABLE if error else (0 if data is None else data.size)], dtype=np.int64)
    wait_or_timeout(comm.Ibcast(size, root=root), timeout_s, what, rank, gone=gone)
    if error is not None:
        raise error
    if size[0] == _UNPICKLABLE:  # root's own error is the one it raises; the others say whose it was
        raise RankMismatchError(f"{what}: the root, rank {root}, could not pickle its object")
    buf = data if data is not None else np.empty(int(size[0]), dtype=np.uint8)
    wait_or_timeout(comm.Ibcast(buf, root=root), timeout_s, what, rank, gone=gone)
    return pickle.loads(buf.tobytes())


HeaderLabels = tuple[tuple[str, "tuple[str, ...] | None"], ...]


def agree(comm: MPI.Comm, header: tuple[int, ...], rows: list[tuple[int, ...]],
          timeout_s: float, what: str, labels: HeaderLabels = (),
          node_barrier: NodeBarrier | None = None, spin_s: float = 0.0) -> None:
    """Raise RankMismatchError on every rank unless all ranks passed the same header and rows.
    ``labels`` name the header fields (and optionally the names of their integer values).
    With ``node_barrier`` (all of ``comm`` on one node) digests travel through shared memory; else
    through MPI, waited for by spinning up to ``spin_s`` seconds before sleeping."""
    digest = signature_hash(header, rows)
    if node_barrier is not None:
        digests = node_barrier.wait(digest, what)
        if len(set(digests)) == 1:  # type: ignore[arg-type]
            return
    else:
        from mpi4py import MPI

        send = np.array([digest, -digest], dtype=np.int64)
        recv = np.empty(2, dtype=np.int64)
        wait_or_timeout(comm.Iallreduce(send, recv, op=MPI.MAX), timeout_s, what, comm.rank, spin_s)
        if recv[0] == -recv[1]:
            return
    # (timed too: a rank that timed out in this call, or refused it, is not there to gather)
    everyone = allgather_object(comm, (header, rows), timeout_s, what, comm.rank)
    raise RankMismatchError(f"ranks disagree on {what}: {describe_mismatch(everyone, labels)}")


def describe_mismatch(everyone: list[tuple[tuple[int, ...], list[tuple[int, ...]]]],
                      labels: HeaderLabels = ()) -> str:
    """One line naming the first differing item and what each rank submitted there."""
    headers = [h for h, _ in everyone]
    for i in range(len(headers[0])):
        values = [h[i] for h in headers]
        if len(set(values)) > 1:
            label, names = labels[i] if i < len(labels) else (f"header field {i}", None)
            return _by_rank(label, [names[v] if names and 0 <= v < len(names) else str(v) for v in values])
    counts = [len(rows) for _, rows in everyone]
    if len(set(counts)) > 1:
        return _by_rank("number of tensors", [str(c) for c in counts])
    for i in range(counts[0]):
        items = [rows[i] for _, rows in everyone]
        if len(set(items)) > 1:
            return _by_rank(f"tensor {i}", [_describe_row(r) for r in items])
    return "signatures differ"


def _describe_row(row: tuple[int, ...]) -> str:
    code, group, *shape = row
    grp = "" if group < 0 else f" group {group}"
    where = "cuda " if code & DEVICE_ROW else ""
    return f"{where}{dtype_name_from_code(code & (DEVICE_ROW - 1))}{list(shape)}{grp}"


def _by_rank(label: str, values: list[str]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    parts = [f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: {v}" for v, r in groups.items()]
    return f"{label} differs ({'; '.join(parts)})"
