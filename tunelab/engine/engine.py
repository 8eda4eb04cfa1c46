"""The synchronous allreduce engine: agreement, fusion planning, and the two data paths.

* shared memory (ranks of one node, and the node-local stages of hierarchical):
  every rank packs a piece of the bucket into its own shared segment; rank r
  reduces shard r of that piece straight from all peers' segments (in rank
  order, so results never depend on how the bucket was cut); with
  ``hierarchical`` the shard then goes round the cross-node MPI ring; finally
  every rank unpacks all shards from their owners' segments (applying the
  average's scale while it copies).
* MPI ring (several nodes, ``hierarchical`` off): pack into a fusion buffer,
  ring allreduce over the world communicator, unpack.

All ranks must make the same calls in the same order (a mismatch is detected
and reported on every rank before any data moves).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import EngineConfig, load_engine_config
from ..dtypes import FLOAT_CODES, dtype_code
from ..errors import TopologyError, TunelabError
from ..kernels import ReduceOp, get_backend
from ..knobs import Knobs
from .consensus import DEVICE_ROW, agree
from .fusion import Bucket, Entry, Layout, plan_buckets
from .link import EmulatedLink
from .mpi_ring import RingAllreduce
from .shm import NodeBarrier, SharedArena
from .topology import build_topology

if TYPE_CHECKING:
    from mpi4py import MPI

OPS = {"sum": (ReduceOp.SUM, False), "average": (ReduceOp.SUM, True),
       "min": (ReduceOp.MIN, False), "max": (ReduceOp.MAX, False)}
_OP_CODES = {name: i for i, name in enumerate(OPS)}
_HEADER_LABELS = (("op", tuple(OPS)), ("number of tensors", None))
_PLAN_CACHE_SIZE = 256


def _op(op: str) -> tuple[str, ReduceOp, bool]:
    name = {"avg": "average", "mean": "average"}.get(op, op)
    if name not in OPS:
        raise ValueError(f"unknown reduction {op!r}; choose from {', '.join(OPS)}")
    return (name, *OPS[name])


class Engine:
    """Allreduce engine for the ranks of ``comm`` (default: MPI.COMM_WORLD).  Collective to create."""

    def __init__(self, comm: MPI.Comm | None = None, config: EngineConfig | None = None) -> None:
        from mpi4py import MPI

        self.config = config or load_engine_config()
        self.topology = build_topology(comm or MPI.COMM_WORLD, self.config.ranks_per_node)
        # Host tensors use the Numba CPU kernels and the node's shared-memory segments.  Device
        # tensors (CUDA) use the GPU kernels of ``config.backend`` ("auto": CuPy, else numba-cuda)
        # and staging segments in device memory mapped between ranks with CUDA IPC, set up on the
        # first device tensor.  Between nodes, device data goes to MPI directly when the MPI is
        # CUDA-aware, otherwise through a pinned host buffer.
        self.kernels = get_backend("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # Ranks sharing a host share its cores.  The setting is per thread (Numba's is thread-local):
        # threads that run collectives (the coordinator) call use_kernel_threads() themselves.
        self.kernel_threads = max(1, (cores or 1) // self.topology.host_size)
        self.use_kernel_threads()
        self.arena = SharedArena(self.topology.local)
        self._host = _Memory(self.kernels, self.arena)
        self._device: _Memory | None = None
        self.barrier = NodeBarrier(self.topology.local, self.config.timeout_s)
        self.link = self._emulated_link()
        self._ring_world = RingAllreduce(self.topology.world, self.kernels,
                                         self._link_from_left(self.topology.world))
        self._ring_cross = RingAllreduce(self.topology.cross, self.kernels,
                                         self._link_from_left(self.topology.cross))
        self._fusion = np.empty(0, dtype=np.uint8)
        self._plans: dict[tuple, list[Bucket]] = {}
        self._calls = 0
        self._knobs = Knobs()
        self.set_knobs(self.config.knobs)

    def _emulated_link(self) -> EmulatedLink | None:
        topo, gbps = self.topology, self.config.link_gbps
        if gbps is None or topo.num_nodes == 1:
            return None
        return EmulatedLink(topo.local, gbps, self.config.link_latency_us)

    def _link_from_left(self, comm: MPI.Comm) -> EmulatedLink | None:
        """The link for a ring over ``comm`` when its left neighbour is on another emulated node of
        this host (collective over ``comm``)."""
        world_ranks = comm.allgather(self.topology.rank)
        left = world_ranks[(comm.rank - 1) % comm.size]
        if self.link is None or not self.topology.emulated_boundary(left, self.topology.rank):
            return None
        return self.link

    def use_kernel_threads(self) -> None:
        """Apply this engine's kernel thread budget to the calling thread."""
        self.kernels.set_threads(self.kernel_threads)

    # ---- knobs -------------------------------------------------------------------------------
    @property
    def knobs(self) -> Knobs:
        return self._knobs

    def set_knobs(self, knobs: Knobs | None = None, **changes: object) -> Knobs:
        """Apply new knobs now.  Every rank must call this at the same point with the same value
        (the coordinator does that for live changes)."""
        new = (knobs or self._knobs).replace(**changes) if changes else (knobs or self._knobs)
        self.check_knobs(new)
        self._knobs = new
        return new

    def check_knobs(self, knobs: Knobs) -> None:
        """TopologyError if ``knobs`` cannot run on this topology."""
        topo = self.topology
        if knobs.hierarchical and topo.num_nodes > 1 and not topo.homogeneous:
            raise TopologyError("hierarchical allreduce needs the same number of ranks on every node, "
                                f"got {list(topo.node_sizes)}")

    # ---- collectives -------------------------------------------------------------------------
    def allreduce(self, tensor: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Allreduce one array.  Out-of-place by default; ``out=tensor`` reduces in place."""
        return self.allreduce_batch([tensor], op, None if out is None else [out])[0]

    def grouped_allreduce(self, tensors: Sequence[np.ndarray], op: str = "sum",
                          outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Allreduce a list as one group: it is planned as a unit, and without group fusion it never
        shares a fusion buffer with other tensors, so its results are bitwise reproducible."""
        return self.allreduce_batch(tensors, op, outs, groups=[0] * len(tensors))

    def allreduce_batch(self, tensors: Sequence[np.ndarray], op: str = "sum",
                        outs: Sequence[np.ndarray] | None = None,
                        groups: Sequence[int | None] | None = None,
                        verify: bool = True) -> list[np.ndarray]:
        """Allreduce many arrays at once, fused into buffers of at most ``fusion_threshold_bytes``.
        ``verify=False`` skips rank agreement: only for callers (the coordinator) that negotiated
        the exact same call on every rank already."""
        name, kop, average = _op(op)
        n = len(tensors)
        if outs is not None and len(outs) != n:
            raise ValueError(f"{len(outs)} outputs for {n} tensors")
        groups_ = list(groups) if groups is not None else [None] * n
        if len(groups_) != n:
            raise ValueError(f"{len(groups_)} group ids for {n} tensors")
        on_device = [is_device_tensor(t) for t in tensors]
        arrays, outs_ = self._inputs(tensors, outs, on_device)
        # Where a tensor lives is part of the call: ranks that disagree get one clear error.
        rows = [(_safe_code(a.dtype) | (DEVICE_ROW if d else 0), -1 if g is None else int(g), *a.shape)
                for a, g, d in zip(arrays, groups_, on_device)]
        self._calls += 1
        if verify:
            agree(self.topology.world, (_OP_CODES[name], n), rows,
                  self.config.timeout_s, f"allreduce call #{self._calls}", _HEADER_LABELS,
                  self.barrier if self.topology.num_nodes == 1 else None)
        # The verdicts below are the same on every rank: the dtypes were just agreed.
        for a, row in zip(arrays, rows):
            code = row[0] & ~DEVICE_ROW
            if code == 0:
                dtype_code(a.dtype)  # raises TypeError naming the dtype
            if average and code not in FLOAT_CODES:
                raise TypeError(f"average needs a floating dtype, got {a.dtype.name}; use sum")
        factor = 1.0 / self.topology.size if average else 1.0
        for device in (False, True):  # host tensors, then device tensors, each in submission order
            idx = [i for i in range(n) if on_device[i] == device]
            if not idx:
                continue
            mem = self._device_memory() if device else self._host
            if device:
                mem.kernels.synchronize()  # the producers' kernels (e.g. backward) wrote the inputs
            for bucket in self._plan([arrays[i] for i in idx], [groups_[i] for i in idx], [rows[i] for i in idx]):
                members = [idx[j] for j in bucket.indices]
                srcs = [arrays[i] if device or arrays[i].flags.c_contiguous else np.ascontiguousarray(arrays[i])
                        for i in members]
                self._run(Layout(srcs, [outs_[i] for i in members]), kop, factor, mem)
            if device:
                mem.kernels.synchronize()  # results are in place before anyone reads them
        return [o.owner if d else o for o, d in zip(outs_, on_device)]

    @property
    def direct_device_mpi(self) -> bool:
        """Whether device data crosses nodes without host staging (a CUDA-aware MPI, several nodes)."""
        return self._device is not None and self._device.direct is not None

    def is_device_tensor(self, tensor: object) -> bool:
        """Whether ``tensor`` lives in device memory (and so takes the device path)."""
        return is_device_tensor(tensor)

    def _inputs(self, tensors: Sequence[Any], outs: Sequence[Any] | None,
                on_device: list[bool]) -> tuple[list[Any], list[Any]]:
        """Host tensors as numpy arrays, device tensors as zero-copy device buffers, and an output
        for each (checked, or allocated like its input on the same side)."""
        arrays: list[Any] = []
        results: list[Any] = []
        for i, (t, device) in enumerate(zip(tensors, on_device)):
            if device:
                from .device import device_buffer, empty_like

                a = device_buffer(t)
                o = device_buffer(outs[i] if outs is not None else empty_like(a))
                if o.shape != a.shape or o.dtype != a.dtype:
                    raise ValueError(f"output {i} must be a device array of shape {a.shape} and dtype {a.dtype}")
            else:
                a = np.asarray(t)
                o = _check_out(i, a, outs[i]) if outs is not None else np.empty_like(a, order="C")
            arrays.append(a)
            results.append(o)
        return arrays, results

    def _device_memory(self) -> _Memory:
        if self._device is None:
            from .device import DeviceArena, DeviceScratch, PinnedStaging, cuda_aware_mpi, device_backend_name

            kernels = get_backend(device_backend_name(self.config.backend))
            if kernels.name == "cpu":
                raise TunelabError("device tensors need a GPU kernel back end (cupy or numba-cuda) and a "
                                   "CUDA device; none is available")
            # Several nodes and a CUDA-aware MPI: the rings hand device memory to MPI directly.
            # Every rank must choose alike (one allreduce), or they would run different protocols.
            direct = self.topology.num_nodes > 1 and cuda_aware_mpi()
            from mpi4py import MPI

            direct = bool(self.topology.world.allreduce(int(direct), op=MPI.MIN))
            self._device = _Memory(kernels, DeviceArena(self.topology.local, kernels.name), PinnedStaging(),
                                   (DeviceScratch(kernels.name), DeviceScratch(kernels.name)) if direct else None)
        return self._device

    def _plan(self, arrays: list[np.ndarray], groups: list[int | None], rows: list) -> list[Bucket]:
        k = self._knobs
        key = (tuple(rows), k.fusion_threshold_bytes, k.group_fusion)
        plan = self._plans.get(key)
        if plan is None:
            entries = [Entry(a.nbytes, str(row[0]), g) for a, g, row in zip(arrays, groups, rows)]
            plan = plan_buckets(entries, k.fusion_threshold_bytes, k.group_fusion)
            if len(self._plans) >= _PLAN_CACHE_SIZE:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    # ---- data paths --------------------------------------------------------------------------
    def _run(self, layout: Layout, op: ReduceOp, factor: float, mem: _Memory) -> None:
        if layout.count == 0:
            return
        topo = self.topology
        if topo.num_nodes == 1 or self._knobs.hierarchical:
            self._shared_memory(layout, op, factor, mem, cross=topo.num_nodes > 1)
        else:
            self._flat_ring(layout, op, factor, mem)

    def _shared_memory(self, layout: Layout, op: ReduceOp, factor: float, mem: _Memory, cross: bool) -> None:
        isz, dtype = layout.itemsize, layout.dtype
        me, nloc = self.topology.local_rank, self.topology.local_size
        arena, kernels = mem.arena, mem.kernels
        piece = max(1, min(self._knobs.segment_bytes // isz, layout.count))
        arena.ensure(piece * isz)
        for p0 in range(0, layout.count, piece):
            m = min(layout.count, p0 + piece) - p0
            parity = arena.parity
            addrs = arena.half_addrs(parity)
            kernels.copy_table(_bytes(layout.pack_rows(p0, p0 + m, int(addrs[me])), isz))
            mem.sync()  # peers read this segment after the barrier
            self.barrier.wait()
            lo, hi = m * me // nloc, m * (me + 1) // nloc
            if hi > lo:
                kernels.reduce(int(addrs[me]) + lo * isz, addrs + lo * isz, hi - lo, dtype, op)
                if cross:
                    self._cross_ring(int(addrs[me]) + lo * isz, hi - lo, dtype, op, mem)
            mem.sync()
            self.barrier.wait()
            parts = [layout.unpack_rows(p0 + m * q // nloc, p0 + m * (q + 1) // nloc,
                                        int(addrs[q]) + (m * q // nloc) * isz) for q in range(nloc)]
            self._unpack(np.concatenate(parts), dtype, factor, mem)
            arena.parity ^= 1

    def _cross_ring(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp, mem: _Memory) -> None:
        """Allreduce this rank's shard (``count`` elements at ``addr``) with its peers on the other
        nodes: in place in shared memory, or through the pinned staging buffer for device memory."""
        nbytes = count * dtype.itemsize
        if not mem.device:
            shard = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr)).view(dtype)
            self._ring_cross(shard, op, self._knobs.segment_bytes)
            return
        if mem.direct is not None:  # CUDA-aware MPI reads and writes the device shard itself
            self._ring_cross.run(addr, count, dtype, op, self._knobs.segment_bytes, mem.kernels,
                                 mem.direct[0].addr, device=True)
            return
        host = mem.staging.view(nbytes, dtype)
        mem.kernels.copy_table(np.array([[addr, host.ctypes.data, nbytes]], dtype=np.int64))
        mem.sync()
        self._ring_cross(host, op, self._knobs.segment_bytes)
        mem.kernels.copy_table(np.array([[host.ctypes.data, addr, nbytes]], dtype=np.int64))

    def _flat_ring(self, layout: Layout, op: ReduceOp, factor: float, mem: _Memory) -> None:
        isz, nbytes = layout.itemsize, layout.count * layout.itemsize
        if mem.direct is not None:  # a device fusion buffer that a CUDA-aware MPI reads directly
            scratch, fusion = mem.direct
            addr = fusion.addr(nbytes)
            mem.kernels.copy_table(_bytes(layout.pack_rows(0, layout.count, addr), isz))
            self._ring_world.run(addr, layout.count, layout.dtype, op, self._knobs.segment_bytes, mem.kernels,
                                 scratch.addr, device=True)
            self._unpack(layout.unpack_rows(0, layout.count, addr), layout.dtype, factor, mem)
            return
        if mem.device:  # pinned host memory is addressable by device kernels (unified addressing)
            buf = mem.staging.view(nbytes, layout.dtype)
        else:
            if self._fusion.size < nbytes:
                self._fusion = np.empty(nbytes, dtype=np.uint8)
            buf = self._fusion[:nbytes].view(layout.dtype)
        mem.kernels.copy_table(_bytes(layout.pack_rows(0, layout.count, buf.ctypes.data), isz))
        mem.sync()
        self._ring_world(buf, op, self._knobs.segment_bytes)
        self._unpack(layout.unpack_rows(0, layout.count, buf.ctypes.data), layout.dtype, factor, mem)

    @staticmethod
    def _unpack(rows: np.ndarray, dtype: np.dtype, factor: float, mem: _Memory) -> None:
        if factor == 1.0:
            mem.kernels.copy_table(_bytes(rows, dtype.itemsize))
        else:
            mem.kernels.scale_copy_table(rows, dtype, factor)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.barrier.free()
        if self._device is not None:
            self._device.arena.free()
        self.arena.free()
        self.topology.free()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes(rows: np.ndarray, itemsize: int) -> np.ndarray:
    out = rows.copy()
    out[:, 2] *= itemsize
    return out


def _safe_code(dtype: np.dtype) -> int:
    try:
        return dtype_code(dtype)
    except TypeError:
        return 0  # agreed like any other code; rejected on every rank after agreement


def _check_out(i: int, a: np.ndarray, o: Any) -> np.ndarray:
    if not isinstance(o, np.ndarray) or o.shape != a.shape or o.dtype != a.dtype:
        raise ValueError(f"output {i} must be an array of shape {a.shape} and dtype {a.dtype}")
    if not o.flags.c_contiguous or not o.flags.writeable:
        raise ValueError(f"output {i} must be C-contiguous and writeable")
    return o


class _Memory:
    """One side of the data path: its kernels, its node staging arena, and (device memory only) how
    data meets the MPI rings: a pinned host buffer, or device buffers for a CUDA-aware MPI."""

    def __init__(self, kernels: Any, arena: Any, staging: Any = None, direct: Any = None) -> None:
        self.kernels, self.arena, self.staging = kernels, arena, staging
        self.device = staging is not None
        self.direct = direct  # (receive scratch, fusion buffer) in device memory for a CUDA-aware MPI

    def sync(self) -> None:
        if self.device:
            self.kernels.synchronize()


def is_device_tensor(tensor: object) -> bool:
    """Device memory: a ``__cuda_array_interface__`` exporter, or a DLPack exporter on a CUDA
    device; under Numba's CUDA simulator, its simulated device arrays."""
    if isinstance(tensor, np.ndarray):
        return False
    if type(tensor).__name__ in ("DeviceBuffer", "FakeCUDAArray"):  # ours; the simulator's arrays
        return True
    try:  # torch raises TypeError (not AttributeError) for the interface of a CPU tensor
        tensor.__cuda_array_interface__  # noqa: B018 - evaluated for the exception it may raise
        return True
    except (AttributeError, TypeError, RuntimeError):
        pass
    dev = getattr(tensor, "__dlpack_device__", None)
    if dev is None:
        return False
    try:
        return int(dev()[0]) in (2, 3)  # kDLCUDA, kDLCUDAHost
    except (TypeError, ValueError, RuntimeError, IndexError):
        return False
