"""Device memory shared between the ranks of a node: CUDA IPC staging segments and pinned host
staging for shards that cross nodes through a non-CUDA-aware MPI.

:class:`DeviceArena` gives every rank of a node a double-buffered staging segment in device memory
and maps every peer's segment into its own address space (``cudaIpcGetMemHandle`` /
``cudaIpcOpenMemHandle``), so kernels read peers' memory directly, as the host path reads peers'
shared-memory segments.  Under Numba's CUDA simulator device memory *is* host memory, so the
arena is a shared-memory segment and "IPC" is the mapping the host path already has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TunelabError
from .device import simulated

if TYPE_CHECKING:
    from mpi4py import MPI

_ALIGN = 256


class ExportRefused(Exception):
    """A segment was allocated, but the driver refused to export it (and it was given back)."""


class IpcUnavailable(TunelabError):
    """Every rank of the node allocated its staging, but some could not map a peer's (MIG instances,
    GPUs without peer access, a driver that refuses CUDA IPC): the device path stages through host
    memory instead."""


class DeviceArena:
    """Double-buffered staging segments in device memory for the ranks of one node, each mapped
    into every peer (the device twin of :class:`tunelab.engine.shm.SharedArena`, same interface).
    ``ensure`` and ``free`` are collective over the node.  ``drain`` waits until this rank's queued
    launches have run: a segment is only unmapped and freed once no rank's stream still reads or
    writes it (the last launches of a call read peers' segments, and nothing waits for them on the
    host before the next call)."""

    def __init__(self, local: MPI.Comm, backend: str, drain: Callable[[], None] | None, timeout_s: float,
                 rank: int) -> None:
        """``timeout_s``: how long its exchanges wait for the node's other ranks before a
        CollectiveTimeoutError (naming ``rank``, this rank's in the world)."""
        self.local = local
        self.backend = backend
        self._drain = drain
        self._timeout_s, self._rank = timeout_s, rank
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
        self._addrs = self._ipc.map(self.local, 2 * half_bytes, self._gather)
        self.half_bytes = half_bytes
        self.parity = 0

    def half_addrs(self, parity: int) -> np.ndarray:
        """Device addresses of half ``parity`` of every rank's segment, in local-rank order."""
        return np.array([a + parity * self.half_bytes for a in self._addrs], dtype=np.intp)

    def free(self) -> None:
        if not self._addrs:
            return
        if self._drain is not None:
            self._drain()
        me = self.local.rank
        for peer, addr in enumerate(self._addrs):
            if peer != me:
                self._ipc.close(addr)
        from .consensus import wait_or_timeout

        # no peer maps this rank's segment any more, nor has a launch queued on it
        wait_or_timeout(self.local.Ibarrier(), self._timeout_s, "freeing the device staging", self._rank)
        self._ipc.release()
        self._addrs = []
        self.half_bytes = 0

    def _gather(self, value: Any) -> list[Any]:
        """``value`` of every rank of the node, waited for within the timeout."""
        from .consensus import allgather_object

        return allgather_object(self.local, value, self._timeout_s, "the device staging's setup", self._rank)


class _Ipc:
    def map(self, local: MPI.Comm, nbytes: int, gather: Callable[[Any], list[Any]] | None = None) -> list[int]:
        """Allocate this rank's segment and map every peer's: addresses in local-rank order (``gather``:
        the node's exchange, ``local.allgather`` when not given).  Collective, failures included: when
        the allocation (e.g. out of device memory: the framework's caching allocator may hold most of
        the GPU) or a mapping fails on any rank, every rank frees what it got and raises, naming the
        ranks (a rank that raised alone would leave its peers waiting here for good), and a later,
        smaller ``map`` starts afresh.  A segment allocated everywhere that some rank could not export
        or map is :class:`IpcUnavailable`."""
        gather = gather or local.allgather
        mine, handle, failed, refused = 0, None, None, False
        try:
            mine, handle = self.allocate(nbytes)
        except ExportRefused as exc:  # allocated (and given back), but not exportable: no CUDA IPC here
            failed, refused = str(exc), True
        except Exception as exc:  # noqa: BLE001 (raised on every rank below)
            failed = f"{type(exc).__name__}: {exc}"
        got = gather((handle, failed, refused))
        addrs: list[int] = []
        mapping = all(f is None for _, f, _ in got)  # every segment allocated: now the peers' are mapped
        # no CUDA IPC: a segment allocated but refused export, and none failed for want of memory
        no_ipc = not mapping and all(r for _, f, r in got if f is not None)
        if mapping:
            try:
                for peer, (h, _, _) in enumerate(got):
                    addrs.append(mine if peer == local.rank else self.open(h))
            except Exception as exc:  # noqa: BLE001
                failed = f"{type(exc).__name__}: {exc}"
            got = gather((None, failed, False))
            no_ipc = True  # (where something failed: mapping a peer's memory did)
        bad = [(r, f) for r, (_, f, _) in enumerate(got) if f is not None]
        if not bad:
            return addrs
        for peer, addr in enumerate(addrs):  # the peers' segments this rank mapped before the failure
            if peer != local.rank:
                self.close(addr)
        if handle is not None:
            self.release()
        said = "; ".join(f"local rank {r}: {f}" for r, f in bad)
        if no_ipc:  # allocated, but a segment cannot be exported or a peer's mapped: no CUDA IPC between them
            raise IpcUnavailable(f"the node's GPUs cannot map each other's memory through CUDA IPC ({said})")
        raise TunelabError(f"device staging of {nbytes} bytes per rank could not be set up: {said}"
                           " (less device memory for staging: a smaller fusion threshold or segment_bytes)")

    def allocate(self, nbytes: int) -> tuple[int, Any]:
        """Allocate this rank's segment: (its address, a handle peers can open).  Where the memory was
        allocated but the driver refuses to export it, the allocation is given back and
        :class:`ExportRefused` raised."""
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
        try:
            return self._mine, bytes(self._rt.ipcGetMemHandle(self._mine))
        except Exception as exc:
            self.release()  # (not leaked: map() releases only a segment whose handle it got)
            raise ExportRefused(f"{type(exc).__name__}: {exc}") from exc

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
        try:
            return int(self._mine.device_ctypes_pointer.value), self._mine.get_ipc_handle()
        except Exception as exc:
            self.release()
            raise ExportRefused(f"{type(exc).__name__}: {exc}") from exc

    def open(self, handle: Any) -> int:
        ipc = getattr(handle, "_ipc_handle", None)  # (the driver's handle; not under the simulator)
        if getattr(ipc, "source_info", None) is not None:
            context = self._cuda.current_context()
            if not ipc.can_access_peer(context):
                # numba would open a private copy of the peer's memory instead (staged through the host):
                # a snapshot, not the peer's buffer, freed as soon as this returns its address
                raise OSError(f"GPU {context.device.id} has no peer access to the GPU of this handle: "
                              "numba-cuda cannot map its memory (CuPy can, where CUDA IPC itself can)")
        array = handle.open()  # an IpcArrayHandle opens as a device array (numba-cuda 0.30 and older)
        addr = int(array.device_ctypes_pointer.value)
        self._opened[addr] = handle
        return addr

    def close(self, addr: int) -> None:
        self._opened.pop(addr).close()

    def release(self) -> None:
        self._mine = None


class _SimulatedIpc(_Ipc):
    """Under the simulator device memory is host memory: one shared-memory segment per rank, every
    rank's mapped already (an MPI shared window); a "handle" is the peer's local rank, and opening it
    looks its segment up, through the same collective protocol as a GPU's handles."""

    def __init__(self, local: MPI.Comm) -> None:
        from .shm import SharedArena

        self._arena = SharedArena(local)
        self._rank = local.rank

    def allocate(self, nbytes: int) -> tuple[int, Any]:
        self._arena.ensure(-(-nbytes // 2))  # (collective) the arena's two halves make one segment here
        return int(self._arena.half_addrs(0)[self._rank]), self._rank

    def open(self, handle: Any) -> int:
        return int(self._arena.half_addrs(0)[handle])

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
                try:
                    import cupy
                except ImportError:  # the numba-cuda back end alone: its own page-locked array
                    from numba import cuda

                    self._mem, self.array = None, cuda.pinned_array(nbytes, dtype=np.uint8)
                else:
                    self._mem = cupy.cuda.alloc_pinned_memory(nbytes)
                    self.array = np.frombuffer(self._mem, dtype=np.uint8, count=nbytes)
        return self.array[:nbytes].view(dtype)

    def free(self) -> None:
        self._mem, self.array = None, np.empty(0, dtype=np.uint8)
