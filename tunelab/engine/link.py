"""An emulated network link between emulated nodes.

Emulated nodes (``ranks_per_node``) on one host exchange their cross-node traffic through MPI
over the host's shared memory, which is several times faster than any real network: a lab run
would then say nothing about the choices that matter between real hosts (hierarchical or flat,
how big the cross-node messages are).  With ``link_gbps`` set, every byte an emulated node
receives from another emulated node goes through that node's *ingress link*: one clock in a
small file shared by the node's ranks serialises all their cross-node receipts at the link's
bandwidth, and each receipt becomes usable ``link_latency_us`` after its last byte is through.
The waiting rank sleeps, as a rank waiting on a NIC would, so the cores stay free for compute.

The model is deliberately simple and knob-blind: a full-duplex NIC per node, shared by the
node's ranks, with no congestion beyond serialisation.  Traffic between real hosts and
traffic within a node are never slowed.  The small negotiation messages of the coordinator are
not slowed either.
"""

from __future__ import annotations

import fcntl
import os
import struct
import tempfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI

_CLOCK = struct.Struct("d")


class EmulatedLink:
    """The ingress link of this rank's emulated node.  Collective over ``local`` to create."""

    def __init__(self, local: MPI.Comm, gbps: float, latency_us: float = 0.0) -> None:
        if not gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {gbps!r}")
        if not latency_us >= 0:
            raise ValueError(f"link_latency_us must be >= 0, got {latency_us!r}")
        self.gbps = float(gbps)
        self.latency_s = float(latency_us) * 1e-6
        self._seconds_per_byte = 8.0 / (self.gbps * 1e9)
        self.bytes_through = 0
        self.seconds_waited = 0.0
        path = ""
        if local.rank == 0:
            where = "/dev/shm" if os.path.isdir("/dev/shm") else None
            fd, path = tempfile.mkstemp(prefix="tunelab-link-", dir=where)
            os.pwrite(fd, _CLOCK.pack(0.0), 0)
            os.close(fd)
        path = local.bcast(path, root=0)
        self._fd = os.open(path, os.O_RDWR)
        local.Barrier()
        if local.rank == 0:
            os.unlink(path)  # every rank holds it open: nothing is left behind, even after a crash

    def transfer(self, nbytes: int, sent: float | None = None) -> None:
        """Account for ``nbytes`` just received from another emulated node: wait until the
        link would have delivered them.  ``sent``: when the sender put them on the wire, if earlier than
        now (pieces sent back to back are serialised one after another and are in flight together: each
        pays the latency after its own last byte, not one latency after the other)."""
        if nbytes <= 0:
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            start = max(now if sent is None else min(now, sent), _CLOCK.unpack(os.pread(self._fd, _CLOCK.size, 0))[0])
            done = start + nbytes * self._seconds_per_byte
            os.pwrite(self._fd, _CLOCK.pack(done), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        ready = done + self.latency_s
        self.bytes_through += nbytes
        wait = ready - now
        if wait > 0:
            self.seconds_waited += wait
            time.sleep(wait)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def describe(self) -> str:
        return describe_link(self.gbps, self.latency_s * 1e6)


def describe_link(gbps: float | None, latency_us: float = 0.0) -> str:
    if gbps is None:
        return "none"
    text = f"{gbps:g} Gb/s"
    return text + (f", {latency_us:g} us" if latency_us else "")


def add_link_flags(parser: Any) -> None:
    """``--link-gbps`` and ``--link-latency-us`` for commands that run emulated nodes."""
    import argparse
    import math

    from ..units import link_problem

    def number(low_ok: bool) -> Any:
        def parse(text: str) -> float:
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < 0 or (value == 0 and not low_ok):
                raise argparse.ArgumentTypeError(f"expected a number {'>=' if low_ok else '>'} 0, got {text!r}")
            why = link_problem(latency_us=value) if low_ok else link_problem(gbps=value)
            if why is not None:
                raise argparse.ArgumentTypeError(why)
            return value
        return parse

    parser.add_argument("--link-gbps", type=number(False), default=None, metavar="GBPS",
                        help="emulate a link of this bandwidth between emulated nodes (needs --ranks-per-node)")
    parser.add_argument("--link-latency-us", type=number(True), default=None, metavar="US",
                        help="latency of the emulated link (default 0)")
