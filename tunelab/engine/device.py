"""The device data path: CUDA tensors in, CUDA-IPC staging between the ranks of a node.

* **Entry, zero-copy.**  :func:`device_buffer` turns any CUDA tensor into a
  :class:`DeviceBuffer` (address, element count, dtype) without copying it: objects with
  ``__cuda_array_interface__`` (CuPy, Numba, PyTorch CUDA tensors) directly, DLPack exporters
  (``__dlpack__``, e.g. TensorFlow GPU tensors through ``tf.experimental.dlpack``) through
  ``cupy.from_dlpack``.  The engine then packs, reduces and unpacks through the device kernels.
* **Within a node: CUDA IPC.**  :class:`DeviceArena` gives every rank of a node a double-buffered
  staging segment in device memory and maps every peer's segment into its own address space
  with ``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``, so the reduce kernel reads the peers'
  memory directly, as the host path reads peers' shared-memory segments.  Several ranks on one
  GPU work the same way (each process maps the others' allocations).
* **Across nodes.**  Shards go round the cross-node ring through MPI: straight from device
  memory when the MPI library is CUDA-aware (:func:`cuda_aware_mpi`), otherwise staged
  through a pinned host buffer.

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) device memory *is* host memory, so the
arena is a shared-memory segment and "IPC" is the mapping the host path already has: the whole
device path, kernels included, runs on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..kernels.base import cuda_array_address

if TYPE_CHECKING:
    from mpi4py import MPI

_ALIGN = 256
ENV_CUDA_AWARE = "TUNELAB_CUDA_AWARE_MPI"


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for a device in this process."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@dataclass(frozen=True)
class DeviceBuffer:
    """A C-contiguous device tensor seen as raw memory; ``owner`` keeps the memory alive."""

    addr: int
    size: int  # elements
    dtype: np.dtype
    shape: tuple[int, ...]
    owner: Any

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def device_buffer(obj: Any) -> DeviceBuffer:
    """``obj`` as a :class:`DeviceBuffer`, without copying; TypeError for host memory.

    Under the simulator, numpy arrays and simulated device arrays count as device memory.
    """
    if isinstance(obj, DeviceBuffer):
        return obj
    found = _interface_buffer(obj)
    if found is None and hasattr(obj, "__dlpack__"):
        found = _dlpack_buffer(obj)
    if found is None and simulated():
        host = getattr(obj, "_ary", obj)  # a simulated device array wraps a numpy array
        if isinstance(host, np.ndarray):
            if not host.flags.c_contiguous:
                raise ValueError("device tensors must be C-contiguous")
            found = DeviceBuffer(host.ctypes.data, host.size, host.dtype, host.shape, obj)
    if found is None:
        raise TypeError(f"expected a CUDA tensor (__cuda_array_interface__ or DLPack), "
                        f"got {type(obj).__name__}")
    return found


def _interface_buffer(obj: Any) -> DeviceBuffer | None:
    found = cuda_array_address(obj, "tunelab")
    if found is None:
        return None
    addr, dtype, count = found
    shape = tuple(obj.__cuda_array_interface__["shape"])
    return DeviceBuffer(addr, count, dtype, shape, obj)


def _dlpack_buffer(obj: Any) -> DeviceBuffer | None:
    try:
        kind, _device = obj.__dlpack_device__()
    except (AttributeError, TypeError):
        return None
    if int(kind) not in (2, 3):  # kDLCUDA, kDLCUDAHost
        return None
    import cupy

    return _interface_buffer(cupy.from_dlpack(obj))


def device_backend_name(configured: str) -> str:
    """The GPU kernel back end for device tensors: the configured one ("cpu" refuses them), or for
    "auto" the best available (CuPy, else numba-cuda; "cpu" when there is none)."""
    if configured in ("cupy", "numba-cuda", "cpu"):
        return configured
    from ..kernels import get_backend

    return get_backend("auto").name


def cuda_aware_mpi(environ: dict[str, str] | None = None) -> bool:
    """Whether MPI may be handed device pointers: ``TUNELAB_CUDA_AWARE_MPI=0/1`` if set, else
    what the library says (Open MPI's ``MPIX_Query_cuda_support``, MPICH's
    ``MPIX_GPU_query_support``); False when it says nothing."""
    env = os.environ if environ is None else environ
    if env.get(ENV_CUDA_AWARE, "").strip():
        return env[ENV_CUDA_AWARE].strip().lower() in ("1", "true", "yes", "on")
    try:
        from mpi4py import MPI

        lib = ctypes.CDLL(MPI.__file__)
    except (ImportError, OSError):
        return False
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query())
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        supported = ctypes.c_int(0)
        if query(ctypes.c_int(0), ctypes.byref(supported)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
            return bool(supported.value)
    return False


class DeviceArena:
    """Double-buffered staging segments in device memory for the ranks of one node, each mapped
    into every peer (the device twin of :class:`tunelab.engine.shm.SharedArena`, same interface).
    ``ensure`` and ``free`` are collective over the node."""

    def __init__(self, local: MPI.Comm, backend: str) -> None:
        self.local = local
        self.backend = backend
        self.half_bytes = 0
        self.parity = 0
        self._ipc: _Ipc = _SimulatedIpc(local) if simulated() else (
            _CupyIpc() if backend == "cupy" else _NumbaIpc())
        self._addrs: list[int] = []

    def ensure(self, half_bytes: int) -> None:
        half_bytes = max(_ALIGN, -(-half_bytes // _ALIGN) * _ALIGN)
        if half_bytes <= self.half_bytes:
            return
        self.free()
        self._addrs = self._ipc.map(self.local, 2 * half_bytes)
        self.half_bytes = half_bytes
        self.parity = 0

    def half_addrs(self, parity: int) -> np.ndarray:
        """Device addresses of half ``parity`` of every rank's segment, in local-rank order."""
        return np.array([a + parity * self.half_bytes for a in self._addrs], dtype=np.intp)

    def free(self) -> None:
        if not self._addrs:
            return
        me = self.local.rank
        for peer, addr in enumerate(self._addrs):
            if peer != me:
                self._ipc.close(addr)
        self.local.Barrier()  # no peer maps this rank's segment any more
        self._ipc.release()
        self._addrs = []
        self.half_bytes = 0


class _Ipc:
    def map(self, local: MPI.Comm, nbytes: int) -> list[int]:
        """Allocate this rank's segment and map every peer's: addresses in local-rank order."""
        mine, handle = self.allocate(nbytes)
        handles = local.allgather(handle)
        return [mine if peer == local.rank else self.open(h) for peer, h in enumerate(handles)]

    def allocate(self, nbytes: int) -> tuple[int, Any]:
        """Allocate this rank's segment: (its address, a handle peers can open)."""
        raise NotImplementedError

    def open(self, handle: Any) -> int:
        raise NotImplementedError

    def close(self, addr: int) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


class _CupyIpc(_Ipc):
    """Raw ``cudaMalloc`` (not CuPy's pool: an IPC handle names a whole allocation)."""

    def __init__(self) -> None:
        import cupy

        self._rt = cupy.cuda.runtime
        self._mine = 0

    def allocate(self, nbytes: int) -> tuple[int, Any]:
        self._mine = self._rt.malloc(nbytes)
        return self._mine, bytes(self._rt.ipcGetMemHandle(self._mine))

    def open(self, handle: Any) -> int:
        return int(self._rt.ipcOpenMemHandle(handle))

    def close(self, addr: int) -> None:
        self._rt.ipcCloseMemHandle(addr)

    def release(self) -> None:
        if self._mine:
            self._rt.free(self._mine)
            self._mine = 0


class _NumbaIpc(_Ipc):
    def __init__(self) -> None:
        from numba import cuda

        self._cuda = cuda
        self._mine: Any = None
        self._opened: dict[int, Any] = {}

    def allocate(self, nbytes: int) -> tuple[int, Any]:
        self._mine = self._cuda.device_array(nbytes, dtype=np.uint8)
        return int(self._mine.device_ctypes_pointer.value), self._mine.get_ipc_handle()

    def open(self, handle: Any) -> int:
        array = handle.open_array(self._cuda.current_context(), shape=handle.size, dtype=np.uint8)
        addr = int(array.device_ctypes_pointer.value)
        self._opened[addr] = handle
        return addr

    def close(self, addr: int) -> None:
        self._opened.pop(addr).close()

    def release(self) -> None:
        self._mine = None


class _SimulatedIpc(_Ipc):
    """Under the simulator device memory is host memory: one shared-memory segment per rank."""

    def __init__(self, local: MPI.Comm) -> None:
        from .shm import SharedArena

        self._arena = SharedArena(local)

    def map(self, local: MPI.Comm, nbytes: int) -> list[int]:
        self._arena.ensure(-(-nbytes // 2))  # the arena's two halves make one segment here
        return [int(a) for a in self._arena.half_addrs(0)]

    def close(self, addr: int) -> None:
        pass

    def release(self) -> None:
        self._arena.free()


class PinnedStaging:
    """A host buffer for shards that cross nodes through a non-CUDA-aware MPI: page-locked where a
    device is present (so copies run at full bus speed), plain memory under the simulator."""

    def __init__(self) -> None:
        self._mem: Any = None
        self.array = np.empty(0, dtype=np.uint8)

    def view(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        if self.array.size < nbytes:
            if simulated():
                self.array = np.empty(nbytes, dtype=np.uint8)
            else:
                import cupy

                self._mem = cupy.cuda.alloc_pinned_memory(nbytes)
                self.array = np.frombuffer(self._mem, dtype=np.uint8, count=nbytes)
        return self.array[:nbytes].view(dtype)


def empty_like(buf: DeviceBuffer) -> Any:
    """A new device array shaped like ``buf``, of the owner's kind (torch, CuPy, Numba; numpy under
    the simulator)."""
    owner = buf.owner
    module = type(owner).__module__.split(".")[0]
    if module == "torch":
        import torch

        return torch.empty_like(owner, memory_format=torch.contiguous_format)
    if module == "cupy":
        import cupy

        return cupy.empty(buf.shape, dtype=owner.dtype)
    if module == "numba":  # real or simulated device array
        from numba import cuda

        return cuda.device_array(buf.shape, dtype=owner.dtype)
    if simulated():
        return np.empty(buf.shape, dtype=getattr(owner, "dtype", buf.dtype))
    import cupy

    return cupy.empty(buf.shape, dtype=buf.dtype if buf.dtype.kind != "V" else np.uint16)


class DeviceScratch:
    """A growing device allocation (the direct MPI path's receive slots and fusion buffer)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._array: Any = None
        self._nbytes = 0

    def addr(self, nbytes: int) -> int:
        """Address of at least ``nbytes`` bytes of device memory (contents undefined)."""
        if nbytes > self._nbytes:
            if simulated():
                self._array = np.empty(nbytes, dtype=np.uint8)
            elif self.backend == "cupy":
                import cupy

                self._array = cupy.empty(nbytes, dtype=cupy.uint8)
            else:
                from numba import cuda

                self._array = cuda.device_array(nbytes, dtype=np.uint8)
            self._nbytes = nbytes
        return device_buffer(self._array).addr if self._array is not None else 0
