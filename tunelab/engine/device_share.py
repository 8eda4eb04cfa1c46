"""Ranks that share one GPU: one rank does the device work of all of them.

Measured on an H100 with two processes on one GPU, a phase in which *both* launch a kernel and wait
for it costs ~229 µs (the GPU switches between the processes' contexts), one in which only one
launches ~18 µs, and waiting on another process's IPC event 0.7–2.7 ms.  So when every rank of a
node uses the same GPU, the node's first rank (the *leader*) maps every peer's tensors and, in
one kernel launch, reads every rank's input and writes every rank's output; the other ranks
launch nothing: they wait (on the host) for their own producer's event, publish where their tensors
are, and wait at a host barrier for the leader to finish.  The launch moves exactly the bytes of
the physical bound: N inputs read, N outputs written, no staging, no packing.

Where tensors are: :class:`Exporter` finds the allocation that holds an address and exports it
once (``cuMemGetAddressRange`` + ``cuIpcGetMemHandle``); the leader's :class:`Importer` opens each
allocation once (``cuIpcOpenMemHandle``) and keeps it mapped.  Steady training steps reuse the same
allocations, so a warm call exports and opens nothing and its kernel table is cached by content.
An allocation is checked by its CUDA buffer id on every call, so memory freed and allocated again
at the same address is exported anew rather than read through a stale mapping.  A freed allocation
is *retired*: the peer tells the leader, which closes its mapping (an open mapping would keep the
freed memory from going back to the GPU: a job whose allocator frees and allocates, e.g. after
``torch.cuda.empty_cache()``, would leak a segment per round).  Whenever a call exports something
new, the peer checks its other exported allocations too, so one freed and never touched again is
retired as well.  Memory that cannot be exported (e.g. from ``cudaMallocAsync`` pools) makes the
whole call take the staged algorithms instead; ranks decide that together.

Under Numba's CUDA simulator device memory is host memory: :func:`sim_device_array` makes
"device" arrays in named shared memory, which the simulated exporter and importer share between
processes the way CUDA IPC shares allocations, so the protocol runs without a GPU.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TunelabError
from .cuda_driver import HANDLE_BYTES, CudaDriver
from .device import simulated
from .paths import Call

if TYPE_CHECKING:
    from mpi4py import MPI

_HANDLE_BYTES = HANDLE_BYTES
_MAILBOX_BYTES = 1 << 20  # per rank: new handles and the call's tensor table
_ENTRY = struct.Struct("<qqqqq")  # in key, in offset, out key, out offset, count


class NotShareable(Exception):
    """The memory at an address cannot be exported to another process."""


# ---- the simulator's shareable "device" memory ------------------------------------------------------
_SIM_ALLOCS: list[tuple[int, int, str, Any]] = []  # (base, size, shared-memory name, keep-alive)


def sim_device_array(host: np.ndarray) -> Any:
    """Under the simulator: a device array whose memory other processes can map (named shared memory),
    holding a copy of ``host``."""
    from multiprocessing import shared_memory

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    shm = shared_memory.SharedMemory(create=True, size=max(1, host.nbytes))
    array = np.ndarray(host.shape, host.dtype, buffer=shm.buf)
    array[...] = host
    bisect.insort(_SIM_ALLOCS, (array.ctypes.data, max(1, host.nbytes), shm.name, shm))
    return FakeCUDAArray(array)


def _sim_range(addr: int) -> tuple[int, int, bytes, int]:
    i = bisect.bisect_right(_SIM_ALLOCS, (addr, float("inf"))) - 1
    if i >= 0:
        base, size, name, _ = _SIM_ALLOCS[i]
        if base <= addr < base + size:
            return base, size, name.encode().ljust(_HANDLE_BYTES, b"\0"), base
    raise NotShareable(f"address {addr:#x} is not in shareable simulated device memory")


class Exporter:
    """This rank's side: (allocation key, offset) for device addresses, exporting new allocations."""

    def __init__(self) -> None:
        self._driver = None if simulated() else CudaDriver(NotShareable)
        self._allocs: list[tuple[int, int, int, int]] = []  # (base, size, key, buffer id), by base
        self._next_key = 1
        self.new: list[tuple[int, bytes]] = []  # (key, handle) exported since the last publish
        self.retired: list[int] = []  # keys of exported allocations since freed, not yet told the leader

    def resolve_all(self, addrs: list[int]) -> list[tuple[int, int]]:
        """(key, offset) of every address; NotShareable if some memory cannot be exported.  Each
        allocation's buffer id is checked once per call; when the call exported something new (memory
        is moving), or a handle exported earlier has not reached the leader yet (its call took the
        staged path, or failed) and is not used here, every other exported allocation is checked as
        well and the freed ones retired: a freed allocation's handle is not sent (the leader could not
        open it, and every call would fail until something new was exported)."""
        checked: set[int] = set()
        first = self._next_key
        keys = [self._resolve(addr, checked) for addr in addrs]
        used = {key for key, _ in keys}
        pending = any(key not in used for key, _ in self.new)
        if (self._next_key > first or pending) and self._driver is not None:
            for entry in [a for a in self._allocs if a[2] not in used]:
                if not self._same_buffer(entry[0], entry[3]):
                    self._allocs.remove(entry)
                    self._retire(entry[2])
        return keys

    def _retire(self, key: int) -> None:
        """An exported allocation was freed: the leader is to close its mapping (it may have opened it
        in a call that failed, so it is told even when its handle was never confirmed), and its handle,
        if not yet delivered, is not sent: opening a freed allocation's handle would fail."""
        self.new = [(k, h) for k, h in self.new if k != key]
        self.retired.append(key)

    def _resolve(self, addr: int, checked: set[int]) -> tuple[int, int]:
        i = bisect.bisect_right(self._allocs, (addr, float("inf"))) - 1
        if i >= 0 and self._allocs[i][0] <= addr < self._allocs[i][0] + self._allocs[i][1]:
            base, _, key, buf = self._allocs[i]
            if i in checked or self._driver is None or self._same_buffer(base, buf):
                checked.add(i)
                return key, addr - base
            del self._allocs[i]  # freed (and maybe allocated again around this address): export anew
            self._retire(key)  # ... and the leader closes its mapping of the freed one
            checked.clear()
        if self._driver is None:
            base, size, handle, buf = _sim_range(addr)
        else:
            base, size = self._driver.address_range(addr)
            handle, buf = self._driver.export(base), self._driver.buffer_id(base)
        key = self._next_key
        self._next_key += 1
        bisect.insort(self._allocs, (base, size, key, buf))
        checked.clear()  # indices moved
        self.new.append((key, handle))
        return key, addr - base

    def _same_buffer(self, base: int, buf: int) -> bool:
        """Whether the allocation exported at ``base`` is still the one there.  A base no longer mapped
        (freed; the address now inside another allocation) is not: asking the driver about it fails."""
        try:
            return self._driver.buffer_id(base) == buf  # type: ignore[union-attr]
        except NotShareable:
            return False


class Importer:
    """The leader's side: every peer allocation opened once, by (rank, key)."""

    def __init__(self) -> None:
        self._driver = None if simulated() else CudaDriver(NotShareable)
        self._opened: dict[tuple[int, int], tuple[int, Any]] = {}

    def add(self, rank: int, key: int, handle: bytes) -> None:
        if (rank, key) in self._opened:  # published again after a call the leader failed
            return
        if self._driver is None:
            from multiprocessing import shared_memory

            shm = shared_memory.SharedMemory(name=handle.rstrip(b"\0").decode())
            view = np.ndarray((shm.size,), np.uint8, buffer=shm.buf)
            self._opened[(rank, key)] = (view.ctypes.data, (shm, view))
        else:
            self._opened[(rank, key)] = (self._driver.open(handle), None)

    def base(self, rank: int, key: int) -> int:
        return self._opened[(rank, key)][0]

    def retire(self, rank: int, key: int) -> bool:
        """Close the mapping of a peer allocation the peer has freed (no launch may still read it);
        False when it is not open (told again after a failed call, or never opened)."""
        found = self._opened.pop((rank, key), None)
        if found is None:
            return False
        if self._driver is not None:
            self._driver.close(found[0])
        return True  # (a simulated mapping goes with its last reference)

    def close(self) -> None:
        if self._driver is not None:
            for ptr, _ in self._opened.values():
                self._driver.close(ptr)
        self._opened.clear()  # simulated mappings go with their last reference


class Mailbox:
    """One host shared-memory region per rank of the node: what it exported, where its tensors are."""

    def __init__(self, local: MPI.Comm) -> None:
        from mpi4py import MPI

        self._win = MPI.Win.Allocate_shared(_MAILBOX_BYTES, 1, comm=local)
        self.boxes = [np.frombuffer(self._win.Shared_query(q)[0], dtype=np.uint8) for q in range(local.size)]
        self.mine = self.boxes[local.rank]

    def publish(self, new: list[tuple[int, bytes]], entries: list[tuple[int, int, int, int, int]],
                retired: Sequence[int] = ()) -> None:
        """Write the new handles, the retired keys and the call's entries into this rank's box (read
        after a barrier)."""
        need = 24 + len(new) * (8 + _HANDLE_BYTES) + 8 * len(retired) + len(entries) * _ENTRY.size
        if need > _MAILBOX_BYTES:
            raise NotShareable(f"one call names too many tensors to share ({len(entries)})")
        buf = memoryview(self.mine)
        struct.pack_into("<qqq", buf, 0, len(new), len(retired), len(entries))
        at = 24
        for key in retired:
            struct.pack_into("<q", buf, at, key)
            at += 8
        for key, handle in new:
            struct.pack_into("<q", buf, at, key)
            buf[at + 8:at + 8 + _HANDLE_BYTES] = handle
            at += 8 + _HANDLE_BYTES
        for entry in entries:
            _ENTRY.pack_into(buf, at, *entry)
            at += _ENTRY.size

    def read(self, rank: int) -> tuple[list[tuple[int, bytes]], list[int], bytes]:
        """(new handles, retired keys, raw entries) of ``rank``'s box."""
        buf = memoryview(self.boxes[rank])
        n_new, n_retired, n_entries = struct.unpack_from("<qqq", buf, 0)
        retired = list(struct.unpack_from(f"<{n_retired}q", buf, 24))
        at, new = 24 + 8 * n_retired, []
        for _ in range(n_new):
            new.append((struct.unpack_from("<q", buf, at)[0], bytes(buf[at + 8:at + 8 + _HANDLE_BYTES])))
            at += 8 + _HANDLE_BYTES
        return new, retired, bytes(buf[at:at + n_entries * _ENTRY.size])

    def free(self) -> None:
        self.boxes, self.mine = [], None
        self._win.Free()


class SharedGpu:
    """The leader protocol for the ranks of one node that share one GPU (see the module doc)."""

    def __init__(self, path: Any, local: MPI.Comm) -> None:
        self.path, self.local = path, local
        self.leader = local.rank == 0
        self.exporter = Exporter()
        self.importer = Importer() if self.leader else None
        self.mailbox = Mailbox(local)
        self._tables: dict[bytes, list[tuple[Any, int, np.dtype]]] = {}

    def allreduce(self, ins: list[Any], outs: list[Any], op: Any, factor: float, what: str) -> bool:
        """Reduce ``ins`` into ``outs`` on every rank; False on every rank alike when some rank's
        memory cannot be shared (the caller then takes the staged algorithms)."""
        path = self.path
        ok = 1
        if not self.leader:
            try:
                keys = self.exporter.resolve_all([b.addr for b in ins] + [b.addr for b in outs])
                n = len(ins)
                self.mailbox.publish(self.exporter.new, [(*keys[i], *keys[n + i], ins[i].size) for i in range(n)],
                                     self.exporter.retired)
            except NotShareable:
                ok = 0
            path.wait_producers()  # my producers wrote my inputs (no launch here)
        flags = path.barrier.wait(ok, what)
        if min(flags) == 0:  # type: ignore[type-var]
            return False
        failed: Exception | None = None
        if self.leader:
            try:
                for table, max_count, dtype in self._launch_tables(ins, outs):
                    # (an average's float16 sum is scaled in part before it rounds, as the staged path
                    # scales each input: a sum past 65504 would be inf although its average is not)
                    pre, post = Call(op, factor).scales(dtype)
                    path.kernels.reduce_bcast(table, self.local.size, self.local.size, max_count, dtype, op,
                                              None if factor == 1.0 else post, stream=path.stream, pre=pre)
                path.synchronize()  # every rank's outputs are written before anyone goes on
            except Exception as exc:  # noqa: BLE001 (re-raised below, once the peers know)
                failed = exc
                try:  # launches queued before the failure read and write the peers' memory: let them end
                    path.synchronize()  # before the peers go on (and reuse or free it)
                except Exception:  # noqa: BLE001, S110 - the device's own error; the first failure is raised
                    pass
        done = path.barrier.wait(0 if failed else 1, what)  # the peers learn the leader's verdict here
        if failed is not None:
            raise failed
        if done[0]:  # type: ignore[index]
            self.exporter.new.clear()  # the leader has them (else they are published again next call)
            self.exporter.retired.clear()
        else:
            raise TunelabError(f"{what}: local rank 0, which runs the device work of the ranks sharing this "
                               "GPU, failed (its own error says why); this rank's outputs were not written")
        return True

    def _launch_tables(self, ins: list[Any], outs: list[Any]) -> list[tuple[Any, int, np.dtype]]:
        """The leader's kernel tables for this call, one per dtype (cached by what every rank sent, and by
        the dtypes: a float32 and an int32 tensor of one element each at the same addresses, e.g. a loss
        and a count in turn from the caching allocator, need tables of their own)."""
        parts = [np.array([[b.addr for b in ins], [b.addr for b in outs]], dtype=np.int64).tobytes()
                 + ",".join(np.dtype(b.dtype).str for b in ins).encode()]
        for q in range(1, self.local.size):
            new, retired, raw = self.mailbox.read(q)
            # (every launch of the last call was waited for before its closing barrier: none reads these)
            closed = [self.importer.retire(q, key) for key in retired]  # type: ignore[union-attr]
            if any(closed):
                self._tables.clear()  # tables that named them go too (their keys never come back)
            for key, handle in new:
                self.importer.add(q, key, handle)  # type: ignore[union-attr]
            parts.append(raw)
        key = b"|".join(parts)
        found = self._tables.get(key)
        if found is None:
            if len(self._tables) >= 256:
                self.path.synchronize()  # no queued launch still reads a table being dropped
                self._tables.clear()
            found = self._tables[key] = self._build(ins, outs, parts[1:])
        return found

    def _build(self, ins: list[Any], outs: list[Any], raws: list[bytes]) -> list[tuple[Any, int, np.dtype]]:
        nloc, n = self.local.size, len(ins)
        srcs = np.empty((n, nloc), np.int64)
        dsts = np.empty((n, nloc), np.int64)
        srcs[:, 0] = [b.addr for b in ins]
        dsts[:, 0] = [b.addr for b in outs]
        for q, raw in enumerate(raws, start=1):
            for i, (ik, io, ok, oo, _count) in enumerate(_ENTRY.iter_unpack(raw)):
                srcs[i, q] = self.importer.base(q, ik) + io  # type: ignore[union-attr]
                dsts[i, q] = self.importer.base(q, ok) + oo  # type: ignore[union-attr]
        counts = np.array([b.size for b in ins], np.int64)
        tables = []
        for dtype in dict.fromkeys(b.dtype for b in ins):
            rows = [i for i in range(n) if ins[i].dtype == dtype and counts[i] > 0]
            if rows:
                table = np.concatenate([counts[rows, None], srcs[rows], dsts[rows]], axis=1)
                tables.append((self.path.kernels.upload_table(table, self.path.stream), int(counts[rows].max()),
                               dtype))
        return tables

    def free(self) -> None:
        self._tables.clear()  # (device tables: the path synchronized its stream first)
        if self.importer is not None:
            self.importer.close()
        self.mailbox.free()
