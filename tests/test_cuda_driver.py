"""The CUDA driver calls through ctypes (tunelab/engine/cuda_driver.py), against a stand-in for libcuda
that records the bytes each call receives, and the shared-GPU exporter's use of them against a
stand-in for the driver's view of device memory: no GPU needed.  A CUDA IPC handle is 64 opaque bytes
with zero bytes among them; what ``export`` returns and ``open`` passes on must be those 64 bytes."""

from __future__ import annotations

import ctypes

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
    from tunelab.engine.device_share import Exporter

    fake = FakeAllocations()
    exporter = Exporter.__new__(Exporter)
    exporter._driver, exporter._allocs, exporter._next_key, exporter.new = fake, [], 1, []
    fake.allocate(0x10000, 0x1000)
    assert exporter.resolve_all([0x10100]) == [(1, 0x100)]
    del fake.allocs[0x10000]
    fake.allocate(0x8000, 0x10000)  # covers the old range
    assert exporter.resolve_all([0x10100]) == [(2, 0x8100)]
    assert [key for key, _ in exporter.new] == [1, 2]
    assert exporter.resolve_all([0x10100, 0x8000]) == [(2, 0x8100), (2, 0)]  # found, not exported again
