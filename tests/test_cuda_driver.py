"""The CUDA driver calls through ctypes (tunelab/engine/cuda_driver.py), against a stand-in for libcuda
that records the bytes each call receives, and the shared-GPU exporter's use of them against a
stand-in for the driver's view of device memory: no GPU needed.  A CUDA IPC handle is 64 opaque bytes
with zero bytes among them; what ``export`` returns and ``open`` passes on must be those 64 bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tunelab.engine.cuda_driver import HANDLE_BYTES, CudaDriver

# a handle as the driver writes them: zeros after the first four bytes, then more data
HANDLE = bytes.fromhex("e08a0000") + bytes(range(1, HANDLE_BYTES - 4 + 1))


class FakeLibcuda:
    def __init__(self) -> None:
        self.opened: list[bytes] = []

    def cuIpcGetMemHandle(self, handle, base) -> int:
        ctypes.memmove(handle, HANDLE, HANDLE_BYTES)
        return 0

    def cuIpcOpenMemHandle_v2(self, ptr, handle, flags) -> int:
        self.opened.append(ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle)))
        ptr._obj.value = 0x7F0000001000
        return 0


def _driver() -> tuple[CudaDriver, FakeLibcuda]:
    driver = CudaDriver.__new__(CudaDriver)
    driver.lib, driver._error = FakeLibcuda(), ValueError
    return driver, driver.lib


def test_an_ipc_handle_with_zero_bytes_goes_through_whole() -> None:
    driver, lib = _driver()
    exported = driver.export(0x7000)
    assert exported == HANDLE
    assert driver.open(exported) == 0x7F0000001000
    assert lib.opened == [HANDLE]  # (filled as a c_char array, it came through as e08a0000 and 60 zeros)


def test_a_handle_of_the_wrong_length_is_refused() -> None:
    driver, lib = _driver()
    with pytest.raises(ValueError, match="64 bytes, got 63"):
        driver.open(HANDLE[:-1])
    assert lib.opened == []


class FakeAllocations:
    """The driver's view of a process's device memory: allocations by base, each with a buffer id;
    asking about a base no longer mapped fails, as ``cuPointerGetAttribute`` does."""

    def __init__(self) -> None:
        from tunelab.engine.device_share import NotShareable

        self.error = NotShareable
        self.allocs: dict[int, tuple[int, int]] = {}  # base -> (size, buffer id)
        self._next_id = 1

    def allocate(self, base: int, size: int) -> None:
        self.allocs[base] = (size, self._next_id)
        self._next_id += 1

    def address_range(self, addr: int) -> tuple[int, int]:
        for base, (size, _) in self.allocs.items():
            if base <= addr < base + size:
                return base, size
        raise self.error(f"{addr:#x} is not device memory")

    def buffer_id(self, addr: int) -> int:
        if addr not in self.allocs:
            raise self.error(f"{addr:#x}: no allocation there")
        return self.allocs[addr][1]

    def export(self, base: int) -> bytes:
        return base.to_bytes(8, "little").ljust(HANDLE_BYTES, b"\0")


def test_an_address_in_a_new_allocation_over_a_freed_one_is_exported_anew() -> None:
    """A tensor freed and its memory handed out again in a larger allocation at a lower base: the
    exporter's old entry covers the address, but its base is no longer mapped.  The address is exported
    again (new key, offset from the new base) rather than refused for good, which would send every
    later call of that rank down the staged path."""
    fake = FakeAllocations()
    exporter = _exporter(fake)
    fake.allocate(0x10000, 0x1000)
    assert exporter.resolve_all([0x10100]) == [(1, 0x100)]
    del fake.allocs[0x10000]
    fake.allocate(0x8000, 0x10000)  # covers the old range
    assert exporter.resolve_all([0x10100]) == [(2, 0x8100)]
    assert [key for key, _ in exporter.new] == [2]  # (1 was freed before it was delivered: retired)
    assert exporter.retired == [1]
    assert exporter.resolve_all([0x10100, 0x8000]) == [(2, 0x8100), (2, 0)]  # found, not exported again


def _exporter(fake: FakeAllocations):
    from tunelab.engine.device_share import Exporter

    exporter = Exporter.__new__(Exporter)
    exporter._driver, exporter._allocs, exporter._next_key, exporter.new, exporter.retired = fake, [], 1, [], []
    return exporter


class FakeClosingDriver:
    """The leader's driver: ``open`` maps a handle at a fresh address, ``close`` unmaps it."""

    def __init__(self) -> None:
        self.mapped: dict[int, bytes] = {}
        self._next = 0x7F0000000000

    def open(self, handle: bytes) -> int:
        self._next += 0x100000
        self.mapped[self._next] = handle
        return self._next

    def close(self, ptr: int) -> None:
        del self.mapped[ptr]


def test_freed_allocations_are_retired_and_the_leader_closes_their_mappings() -> None:
    """A peer's allocations freed while the leader holds them mapped: one reallocated at the same base
    (found when the call touches it), one never touched again (found because the call exported
    something new).  The peer tells the leader through its mailbox, and the leader's open mappings
    come back to the ones in use: an open mapping keeps freed GPU memory alive, one segment per round
    for a job whose allocator frees and allocates."""
    from mpi4py import MPI

    from tunelab.engine.device_share import _ENTRY, Importer, Mailbox

    fake = FakeAllocations()
    peer = _exporter(fake)
    leader = Importer.__new__(Importer)
    leader._driver, leader._opened = FakeClosingDriver(), {}
    box = Mailbox(MPI.COMM_SELF)

    def call(addrs: list[int]) -> list[tuple[int, int]]:
        keys = peer.resolve_all(addrs)
        box.publish(peer.new, [(*k, *k, 1) for k in keys], peer.retired)
        new, retired, raw = box.read(0)  # (the leader reads the peer's box after the barrier)
        assert [e[:2] for e in _ENTRY.iter_unpack(raw)] == keys  # the call's table comes through after them
        for key in retired:
            leader.retire(1, key)
        for key, handle in new:
            leader.add(1, key, handle)
        peer.new.clear()
        peer.retired.clear()
        return keys

    try:
        fake.allocate(0x10000, 0x1000)
        fake.allocate(0x20000, 0x1000)
        assert call([0x10010, 0x20020]) == [(1, 0x10), (2, 0x20)]
        assert len(leader._opened) == 2
        # the first is freed and allocated again at the same base; the second is freed for good
        del fake.allocs[0x10000], fake.allocs[0x20000]
        fake.allocate(0x10000, 0x1000)
        assert call([0x10010]) == [(3, 0x10)]
        assert sorted(k for _, k in leader._opened) == [3]
        assert list(leader._driver.mapped.values()) == [(0x10000).to_bytes(8, "little").ljust(HANDLE_BYTES, b"\0")]
        # told again (after a call the leader failed), a retired key closes nothing twice
        assert leader.retire(1, 1) is False
    finally:
        box.free()


def test_a_handle_freed_before_it_reached_the_leader_is_not_sent() -> None:
    """Exported in a call that failed (the handle not confirmed), then freed: the leader must not be
    asked to open it (opening a freed allocation's handle fails); it is retired instead."""
    fake = FakeAllocations()
    peer = _exporter(fake)
    fake.allocate(0x10000, 0x1000)
    peer.resolve_all([0x10000])
    del fake.allocs[0x10000]
    fake.allocate(0x10000, 0x1000)
    peer.resolve_all([0x10000])
    assert [k for k, _ in peer.new] == [2]
    assert peer.retired == [1]


def test_an_undelivered_handle_freed_while_nothing_new_is_exported_is_not_sent() -> None:
    """A handle exported in a call that took the staged path (another rank's memory was not shareable),
    so never delivered; its allocation freed (``torch.cuda.empty_cache()``); the next calls use only
    allocations the leader already has, so nothing new is exported.  The stale handle must not be sent
    (the leader's open would fail, and with it every call until something new was exported): it is
    retired."""
    fake = FakeAllocations()
    peer = _exporter(fake)
    fake.allocate(0x10000, 0x1000)
    fake.allocate(0x20000, 0x1000)
    peer.resolve_all([0x10000])
    peer.new.clear()  # delivered
    peer.resolve_all([0x20000])  # its call fell back: not delivered
    assert [k for k, _ in peer.new] == [2]
    del fake.allocs[0x20000]
    assert peer.resolve_all([0x10000]) == [(1, 0)]
    assert peer.new == [] and peer.retired == [2]


def test_the_leaders_kernel_tables_are_not_shared_between_dtypes() -> None:
    """The leader caches its kernel tables by what every rank sent (addresses, offsets, counts).  A
    float32 and an int32 tensor of one element at the same addresses (a loss, then a count, handed the
    same block by the caching allocator) must not share a table: reduced with the float32 table, the
    count would come back as garbage."""
    from types import SimpleNamespace

    from tunelab.engine.device import DeviceBuffer
    from tunelab.engine.device_share import SharedGpu

    shared = SharedGpu.__new__(SharedGpu)  # a leader alone on its GPU: no peers' mailboxes to read
    shared.local, shared._tables = SimpleNamespace(size=1), {}
    shared.path = SimpleNamespace(stream=None, synchronize=lambda: None,
                                  kernels=SimpleNamespace(upload_table=lambda table, stream: table.copy()))

    def launch(dtype: str):
        ins = [DeviceBuffer(0x10000, 1, np.dtype(dtype), (1,), None)]
        outs = [DeviceBuffer(0x20000, 1, np.dtype(dtype), (1,), None)]
        return [(dt, count) for _, count, dt in shared._launch_tables(ins, outs)]

    assert launch("float32") == [(np.dtype("float32"), 1)]
    assert launch("int32") == [(np.dtype("int32"), 1)]
    assert launch("float32") == [(np.dtype("float32"), 1)]  # and the first one's is still found
    assert len(shared._tables) == 2


def test_a_leader_whose_launch_fails_lets_its_earlier_launches_end_before_the_peers_go_on() -> None:
    """The leader queues one launch per dtype; when a later one fails, the earlier ones still read and
    write the peers' memory.  The leader waits for its stream before it tells the peers at the closing
    barrier (they would reuse or free that memory), then raises."""
    from types import SimpleNamespace

    from tunelab.engine.device import DeviceBuffer
    from tunelab.engine.device_share import SharedGpu

    log: list[str] = []

    def reduce_bcast(table, *args, **kwargs):
        if "launch" in log:  # the second launch
            raise RuntimeError("launch failed (injected)")
        log.append("launch")

    kernels = SimpleNamespace(upload_table=lambda table, stream: table, reduce_bcast=reduce_bcast)
    barrier = SimpleNamespace(wait=lambda flag, what: log.append(f"barrier {flag}") or [flag])
    shared = SharedGpu.__new__(SharedGpu)
    shared.leader, shared.local, shared._tables = True, SimpleNamespace(size=1), {}
    shared.path = SimpleNamespace(stream=None, barrier=barrier, kernels=kernels,
                                  synchronize=lambda: log.append("synchronize"))
    ins = [DeviceBuffer(0x1000 * (i + 1), 4, np.dtype(d), (4,), None) for i, d in enumerate(("float32", "int32"))]
    outs = [DeviceBuffer(0x9000 * (i + 1), 4, np.dtype(d), (4,), None) for i, d in enumerate(("float32", "int32"))]
    with pytest.raises(RuntimeError, match="injected"):
        shared.allreduce(ins, outs, "sum", 1.0, "test")
    assert log == ["barrier 1", "launch", "synchronize", "barrier 0"]
