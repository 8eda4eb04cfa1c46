"""The CUDA driver API through ctypes: the few calls tunelab needs whichever library (CuPy, numba-cuda,
a framework) owns the context, without importing any of them.  Calls act on the calling thread's
current context, which the runtime (CuPy, torch) has made the device's primary context."""

from __future__ import annotations

import ctypes

HANDLE_BYTES = 64


class _Handle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class CudaDriver:
    """``libcuda`` calls; a failing call raises ``error`` (an exception class) naming it."""

    def __init__(self, error: type[Exception] = RuntimeError) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._error = error

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise self._error(f"{what} failed (CUDA driver error {status})")

    def address_range(self, addr: int) -> tuple[int, int]:
        """(base, size) of the allocation that holds device address ``addr``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                    ctypes.c_uint64(addr)), "cuMemGetAddressRange")
        return base.value, size.value

    def buffer_id(self, addr: int) -> int:
        """The process-wide unique id of the allocation at ``addr`` (changes when memory is reallocated)."""
        value = ctypes.c_uint64()
        self.check(self.lib.cuPointerGetAttribute(ctypes.byref(value), 7,  # CU_POINTER_ATTRIBUTE_BUFFER_ID
                                                  ctypes.c_uint64(addr)), "cuPointerGetAttribute")
        return value.value

    def export(self, base: int) -> bytes:
        """An IPC handle for the allocation at ``base``."""
        handle = (ctypes.c_char * HANDLE_BYTES)()
        self.check(self.lib.cuIpcGetMemHandle(handle, ctypes.c_uint64(base)), "cuIpcGetMemHandle")
        return bytes(handle)

    def open(self, handle: bytes) -> int:
        """Map another process's allocation; returns its base address here."""
        if len(handle) != HANDLE_BYTES:
            raise self._error(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
        # The handle's bytes are copied whole: a ``c_char`` array filled from bytes (``Handle(handle)``)
        # stops at the first zero byte and leaves the rest zero, and real handles hold zero bytes.
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), _Handle.from_buffer_copy(handle), 1),
                   "cuIpcOpenMemHandle")  # (1: lazy peer access)
        return ptr.value

    def close(self, ptr: int) -> None:
        self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr))

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int = 0) -> None:
        """Device-to-device ``cuMemcpyDtoDAsync`` on ``stream`` (0: the legacy default stream)."""
        self.check(self.lib.cuMemcpyDtoDAsync_v2(ctypes.c_uint64(dst), ctypes.c_uint64(src),
                                                 ctypes.c_size_t(nbytes), ctypes.c_void_p(stream)),
                   "cuMemcpyDtoDAsync")
