"""Pieces every benchmark shares: exact-sum inputs, synchronised timing, tables."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..engine.engine import Engine


CHUNK = 1 << 20  # elements made at a time: the int64 work stays a few MiB whatever the size


def exact_input(count: int, rank: int, world: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Small integers whose sum over ``world`` ranks is exact in every supported dtype and in any
    order (|sum| stays within bfloat16's 8-bit significand), so results can be compared bit for bit."""
    return _chunked(count, dtype, lambda i: _values(i, rank, world, salt))


def exact_sum(count: int, world: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """The reference sum of ``exact_input`` over all ranks, computed in int64 by numpy."""
    return _chunked(count, dtype, lambda i: sum(_values(i, r, world, salt) for r in range(world)))


def _values(i: np.ndarray, rank: int, world: int, salt: int) -> np.ndarray:
    span = max(2, min(16, 512 // max(1, world)))
    return (i * 7 + rank * 13 + salt * 5) % span - span // 2


def _chunked(count: int, dtype: np.dtype, values: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """An array of ``count`` elements of ``dtype``, ``values(indices)`` (int64) made a chunk at a time."""
    out = np.empty(count, dtype=dtype)
    for start in range(0, count, CHUNK):
        out[start:start + CHUNK] = values(np.arange(start, min(count, start + CHUNK), dtype=np.int64)).astype(dtype)
    return out


def count_wrong(result: np.ndarray, expected: np.ndarray) -> int:
    """Elements whose bits differ."""
    if result.shape != expected.shape:
        return int(max(result.size, expected.size))
    a = result.reshape(-1).view(np.uint8).reshape(result.size, -1)
    b = expected.reshape(-1).view(np.uint8).reshape(expected.size, -1)
    return int(np.any(a != b, axis=1).sum())


def timed_iterations(comm: MPI.Comm, op: Callable[[], None], iters: int, warmup: int,
                     reset: Callable[[], None] | None = None, before: Callable[[], None] | None = None,
                     after: Callable[[], None] | None = None) -> np.ndarray:
    """Seconds per iteration, each the slowest rank's time (ranks start together after a barrier).
    ``before`` and ``after`` run untimed around every measured iteration (not the warm-up ones), before
    ``reset``: to poison the output, and to check what that iteration wrote."""
    times = np.empty(iters, dtype=np.float64)
    for k in range(warmup + iters):
        measured = k >= warmup
        if measured and before is not None:
            before()
        if reset is not None:
            reset()
        comm.Barrier()
        t0 = time.perf_counter()
        op()
        dt = time.perf_counter() - t0
        if measured:
            times[k - warmup] = dt
            if after is not None:
                after()
    slowest = np.empty_like(times)
    from mpi4py import MPI

    comm.Allreduce(times, slowest, op=MPI.MAX)
    return slowest


INTERLEAVE_ROUNDS = 4  # turns each measured thing gets (bench allreduce, bench fusion)
REWARM_MAX_S = 0.01    # a turn starts with an untimed iteration only where one takes less than this


def interleaved_iterations(comm: MPI.Comm, ops: Sequence[tuple[Callable[[], None], Callable[[], None] | None]],
                           iters: int, warmup: int, rounds: int = INTERLEAVE_ROUNDS,
                           before: Callable[[int], None] | None = None,
                           after: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Seconds per iteration of each of ``ops`` (``(op, reset)`` as :func:`timed_iterations` takes them),
    each the slowest rank's, measured in turns: every op first runs its ``warmup`` iterations, then each of
    ``rounds`` rounds times a share of every op's ``iters`` iterations, in an order that rotates by one
    from round to round.  A slow or fast stretch of a shared, noisy host then falls on every op alike,
    not on whichever one ran at the time.  A turn after another op's starts with one more untimed
    iteration where an iteration is short (with ``warmup`` > 0, an op whose fastest warm-up iteration took
    under ``REWARM_MAX_S`` on every rank: the caches are the other op's; a longer one does not feel it, and its
    turns would cost half as much again).  ``before(i)`` and ``after(i)`` run untimed around each measured
    iteration of op ``i`` (to poison its output, and to check it): around the turn, a re-warm's results
    would stand for timed calls that wrote nothing, and one call's for the turn's others."""
    n = len(ops)
    rewarm = []
    for op, reset in ops:  # (by its fastest warm-up iteration: the first may pay a one-time cost, a
        warm = timed_iterations(comm, op, warmup, 0, reset)  # compilation, a connection, that later ones do not)
        rewarm.append(warmup > 0 and n > 1 and float(warm.min()) < REWARM_MAX_S)
    # (a re-warm is one more collective call: every rank must agree on it)
    mine = np.asarray(rewarm, dtype=np.int32)
    agreed = np.empty_like(mine)
    from mpi4py import MPI

    comm.Allreduce(mine, agreed, op=MPI.MIN)
    rounds = max(1, min(rounds, iters))
    shares = [iters // rounds + (1 if r < iters % rounds else 0) for r in range(rounds)]
    times: list[list[np.ndarray]] = [[] for _ in range(n)]
    for r, share in enumerate(shares):
        for i in [(r + j) % n for j in range(n)]:
            op, reset = ops[i]
            times[i].append(timed_iterations(comm, op, share, int(agreed[i]), reset,
                                             None if before is None else functools.partial(before, i),
                                             None if after is None else functools.partial(after, i)))
    return [np.concatenate(t) for t in times]


def bound_copy(src: np.ndarray, out: np.ndarray, engine: Engine | None) -> Callable[[], None]:
    """The bound row's host copy (``bench allreduce``, ``bench fusion``) of ``src`` into ``out``, with the cores the engine's kernels get (its
    thread budget: the host's cores over its ranks): a single-threaded copy is no bound for an engine
    whose reduce runs on several cores.  Cut into a few pieces a thread, copied by the CPU kernels'
    parallel copy; with one thread a rank (or no engine in the run), numpy's copy."""
    threads = engine.kernel_threads if engine is not None else 1
    if threads <= 1 or src.nbytes < (1 << 20):
        return lambda: np.copyto(out, src)
    piece = -(-src.nbytes // (4 * threads))
    piece += -piece % 64  # (whole cache lines)
    rows = np.array([[src.ctypes.data + o, out.ctypes.data + o, min(piece, src.nbytes - o)]
                     for o in range(0, src.nbytes, piece)], dtype=np.int64)

    def op() -> None:
        engine.use_kernel_threads()
        engine.kernels.copy_table(rows)
    return op


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Fixed-width table; ``columns`` are (key, header, format spec)."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append([_cell(row.get(key), fmt) for key, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object, fmt: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, (int, float)) and fmt:
        return format(value, fmt)
    return str(value)
