"""Allreduce algorithms, written once against :class:`tunelab.engine.paths.DataPath`.

* :func:`oneshot` (small buckets, one node): every rank copies its bucket into its own staging
  slot; after **one** ordering point every rank reads every peer's slot and reduces once, straight
  into its outputs.  Latency-bound messages pay one synchronisation instead of two per piece.
  Slots are double-buffered: a rank may refill one half while slower peers still read the other.
  On the host path the half is the parity of the node barrier's epoch: reaching the next ordering
  point proves a peer has finished reading the previous half (its reads are done when it moves on;
  epochs advance alike on every rank, even after an error).  On the device path a barrier proves
  only that a peer has *queued* its reads, and other barriers (a call's agreement) pass without any
  device wait, so the epoch's parity could hand two calls in a row the same half, refilled while a
  peer's queued reduce still reads it.  There the halves alternate per one-shot instead: a half is
  used again only after the one-shot in between has passed its ``order()``, which waits for every
  peer's earlier launches (its stream synchronised, or its event waited on), the reduce that read
  the half included.
* :func:`twoshot` (large buckets): a reduce-scatter and an allgather through the staging arena, in
  pipeline pieces of ``segment_bytes``.  Rank r reduces shard r of a piece from all peers'
  segments (in rank order, so results never depend on how the bucket was cut); with several
  nodes (hierarchical) the shard then goes round the cross-node ring; every rank then copies all
  shards out, applying the average's scale while it copies (float16: part of it while packing,
  :meth:`tunelab.engine.paths.Call.scales`).
* :func:`flat_ring` (several nodes, hierarchical off): pack into a fusion buffer, ring allreduce
  over the world, unpack.

Within a node every path reduces sources in rank order, so for one bucket layout the one-shot and
the two-shot give the same bits.  Between nodes the order differs: the flat ring adds chunk c
starting from rank c, recursive doubling adds in a tree, and the hierarchical path adds each node's
sum first; so results there depend on ``hierarchical`` and ``doubling_max_bytes``, and, hierarchical
on three nodes or more, on ``segment_bytes`` (each piece's shard goes round the nodes' ring on its
own, which starts its chunk c at node c).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .fusion import Layout
from .paths import Call, DataPath

if TYPE_CHECKING:
    from .mpi_ring import RingAllreduce


def as_bytes(rows: np.ndarray, itemsize: int) -> np.ndarray:
    """A copy table counting bytes instead of elements."""
    out = rows.copy()
    out[:, 2] *= itemsize
    return out


def unpack(path: DataPath, rows: np.ndarray, dtype: np.dtype, factor: float) -> None:
    """Copy every ``(src, dst, count)`` row, scaled by ``factor`` (packing uses it too)."""
    if factor == 1.0:
        path.copy(as_bytes(rows, dtype.itemsize))
    else:
        path.scale_copy(rows, dtype, factor)


pack = unpack


def alone(path: DataPath, layout: Layout) -> None:
    """One rank in all: the allreduce of a tensor is the tensor (an average divides by 1), so each
    output that is not its input gets one copy, and nobody waits for anybody."""
    rows = layout.copy_rows()
    if rows.shape[0]:
        path.copy(rows)


def oneshot(path: DataPath, layout: Layout, call: Call, me: int, what: str) -> None:
    """Allreduce ``layout`` within a node through one ordering point (see the module doc)."""
    isz, dtype, count = layout.itemsize, layout.dtype, layout.count
    if path.device:  # device: the halves alternate per one-shot (see the module doc)
        parity = path.slots.parity
        path.slots.parity ^= 1
    else:
        parity = path.barrier.next_parity()
    addrs = path.slots.half_addrs(parity)
    before, after = call.scales(dtype)
    pack(path, layout.pack_rows(0, count, int(addrs[me])), dtype, before)
    path.order(what)
    if layout.single and after == 1.0:  # straight into the output
        path.reduce(layout.dst(0), addrs, count, dtype, call.op)
    else:
        tmp = path.scratch(count * isz)
        path.reduce(tmp, addrs, count, dtype, call.op)
        unpack(path, layout.unpack_rows(0, count, tmp), dtype, after)


def twoshot(path: DataPath, layout: Layout, call: Call, me: int, nloc: int, segment_bytes: int,
            cross: RingAllreduce | None, what: str) -> None:
    """Reduce-scatter + allgather within a node, pipelined; ``cross``: the ring each reduced shard
    goes round between nodes (hierarchical), or None."""
    isz, dtype = layout.itemsize, layout.dtype
    arena = path.arena
    piece = max(1, min(segment_bytes // isz, layout.count))
    arena.ensure(piece * isz)
    before, after = call.scales(dtype)
    for p0 in range(0, layout.count, piece):
        m = min(layout.count, p0 + piece) - p0
        addrs = arena.half_addrs(arena.parity)
        pack(path, layout.pack_rows(p0, p0 + m, int(addrs[me])), dtype, before)
        path.order(what)
        lo, hi = m * me // nloc, m * (me + 1) // nloc
        if hi > lo:
            path.reduce(int(addrs[me]) + lo * isz, addrs + lo * isz, hi - lo, dtype, call.op)
            if cross is not None:
                path.cross_allreduce(int(addrs[me]) + lo * isz, hi - lo, dtype, call.op, cross, segment_bytes)
        path.order(what)
        parts = [layout.unpack_rows(p0 + m * q // nloc, p0 + m * (q + 1) // nloc,
                                    int(addrs[q]) + (m * q // nloc) * isz) for q in range(nloc)]
        unpack(path, np.concatenate(parts), dtype, after)
        arena.parity ^= 1


def flat_ring(path: DataPath, layout: Layout, call: Call, ring: RingAllreduce, segment_bytes: int) -> None:
    """Pack, ring allreduce over every rank, unpack."""
    isz, count, dtype = layout.itemsize, layout.count, layout.dtype
    buf = path.scratch(count * isz)
    before, after = call.scales(dtype)
    pack(path, layout.pack_rows(0, count, buf), dtype, before)
    path.cross_allreduce(buf, count, dtype, call.op, ring, segment_bytes)
    unpack(path, layout.unpack_rows(0, count, buf), dtype, after)
