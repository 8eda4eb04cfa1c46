"""The CUDA driver calls through ctypes (tunelab/engine/cuda_driver.py), against a stand-in for libcuda
that records the bytes each call receives: no GPU needed.  A CUDA IPC handle is 64 opaque bytes with
zero bytes among them; what ``export`` returns and ``open`` passes on must be those 64 bytes."""

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
