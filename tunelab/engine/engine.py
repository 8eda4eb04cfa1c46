"""The synchronous allreduce engine: agreement, fusion planning, and dispatch to an algorithm
(:mod:`tunelab.engine.algorithms`) over a data path (:mod:`tunelab.engine.paths`: host memory, or
device memory in :mod:`tunelab.engine.device`).

* one node, buckets up to ``oneshot_max_bytes``: one-shot (one ordering point);
* one node, larger buckets, or several nodes with ``hierarchical``: two-shot through the node's
  staging, with a cross-node ring of each shard when there are several nodes;
* several nodes, ``hierarchical`` off (or nodes of one rank each): a flat MPI ring over every rank.

Between nodes, buffers up to ``doubling_max_bytes`` (a flat bucket, a hierarchical shard) take recursive
doubling instead of the ring (:mod:`tunelab.engine.mpi_ring`).

A single small host tensor on one node (the latency-bound case) takes the shortest route: ranks
agree on the call in the same barrier that publishes their data, so the whole allreduce costs one
synchronisation, about what MPI_Allreduce pays.  On several nodes (flat path, buffers up to
``doubling_max_bytes``) it is agreed as every call is, then reduced by recursive doubling straight on
the output array, with no fusion plan, staging or packing in between.

All ranks must make the same calls in the same order (a mismatch is detected and reported on
every rank before any result is written).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import os
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from ..config import EngineConfig, load_engine_config
from ..dtypes import FLOAT_CODES, dtype_code
from ..errors import CollectiveTimeoutError, RankMismatchError, TopologyError, TunelabError, UsageError
from ..kernels import ReduceOp, get_backend
from ..kernels.base import half_kind
from ..knobs import Knobs
from . import algorithms
from .consensus import (
    DEVICE_ROW,
    agree,
    allgather_object,
    describe_mismatch,
    set_stall_warning,
    signature_hash,
)
from .device import device_buffer, device_index, empty_like
from .fusion import Bucket, Entry, Layout, plan_buckets
from .link import EmulatedLink
from .mpi_ring import RingAllreduce
from .paths import Call, HostPath
from .shm import NodeBarrier
from .topology import build_topology, private_copy

if TYPE_CHECKING:
    from mpi4py import MPI

OPS = {"sum": (ReduceOp.SUM, False), "average": (ReduceOp.SUM, True),
       "min": (ReduceOp.MIN, False), "max": (ReduceOp.MAX, False)}
_OP_CODES = {name: i for i, name in enumerate(OPS)}
_NO_OP = len(OPS)  # the op code of a call whose op is not one (refused on that rank: Engine._refuse)
_HEADER_LABELS = (("op", (*OPS, "not an op")), ("number of tensors", None),
                  ("the knobs in force (a code of them: Engine.set_knobs called on some ranks only, or with "
                   + "other values)", None),
                  ("arguments", ("invalid (an error on that rank)", "valid")))
_VALID, _INVALID = 1, 0  # a header's last field: whether this rank's arguments were valid
_PLAN_CACHE_SIZE = 256


def _min_as_kernels(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``min(a, b)`` into ``out`` as the CPU kernels take it: ``b`` where it is NaN or smaller, else ``a``
    (ties such as +0 and -0 keep ``a``; np.minimum keeps ``b``)."""
    np.copyto(out, np.where((b != b) | (b < a), b, a))  # noqa: PLR0124 - b != b is the NaN test


def _max_as_kernels(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``max(a, b)`` as the CPU kernels take it (see :func:`_min_as_kernels`)."""
    np.copyto(out, np.where((b != b) | (b > a), b, a))  # noqa: PLR0124


# by ReduceOp, for the short routes: the same bits as the kernels (a sum of two is one rounding either way)
_NUMPY_REDUCE = (lambda a, b, out: np.add(a, b, out=out), _min_as_kernels, _max_as_kernels)


_OP_LOOKUP = {**{name: (name, *spec) for name, spec in OPS.items()},
              "avg": ("average", *OPS["average"]), "mean": ("average", *OPS["average"])}


def _op(op: str) -> tuple[str, ReduceOp, bool]:
    found = _OP_LOOKUP.get(op) if isinstance(op, str) else None
    if found is None:
        raise ValueError(f"unknown reduction {op!r}; choose from {', '.join(OPS)}")
    return found


def _agree_on_settings(world: MPI.Comm, config: EngineConfig) -> None:
    """Every rank plans its buckets and picks its algorithm from its own knobs (only live changes are
    sent from rank 0): knobs that differ from rank to rank (a ``TUNELAB_*`` variable set on some ranks,
    an ``init()`` argument computed per rank) would pair one rank's bucket with another's, a silent
    mix of data.  So they are compared when the engine is made, with the node layout and the emulated
    link, and any difference fails on every rank, naming it."""
    from ..knobs import knob_text

    mine = {**config.knobs.as_dict(), "ranks_per_node": config.ranks_per_node, "link_gbps": config.link_gbps,
            "link_latency_us": config.link_latency_us,
            # (which profile a job loads: rank 0 looks it up and the others wait for its answer, so a
            # rank told "off" alone would leave that answer unread)
            "profile": config.profile}
    everyone = allgather_object(world, mine, config.timeout_s, "the engine's settings (init)", world.rank)
    differ = [k for k in mine if any(e[k] != everyone[0][k] for e in everyone)]
    if differ:
        def text(name: str, value: object) -> str:
            return knob_text(name, value) if name in config.knobs.as_dict() and value is not None else repr(value)

        what = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {text(k, e[k])}" for r, e in enumerate(everyone))
                         for k in differ[:3])
        raise RankMismatchError(f"ranks disagree on the engine's settings ({what}): give every rank the same "
                                "TUNELAB_* environment and init() arguments")


class Engine:
    """Allreduce engine for the ranks of ``comm`` (default: MPI.COMM_WORLD).  Collective to create."""

    def __init__(self, comm: MPI.Comm | None = None, config: EngineConfig | None = None) -> None:
        from mpi4py import MPI

        self.config = config or load_engine_config()
        # Every exchange below is collective: the first is timed, so that a rank that never makes its
        # engine (it died, or never calls init()) fails the others here instead of leaving them waiting.
        set_stall_warning(self.config.stall_warning_s)
        world = private_copy(comm or MPI.COMM_WORLD, self.config.timeout_s, "the engine's setup (init)")
        try:
            _agree_on_settings(world, self.config)
        except BaseException:
            world.Free()
            raise
        self.topology = build_topology(world, self.config.ranks_per_node, duplicate=False)
        try:  # knobs this topology cannot run are refused before anything is allocated (the same verdict
            self.check_knobs(self.config.knobs)  # on every rank: the topology is the same everywhere)
        except TopologyError:
            self.topology.free()
            raise
        self._exit_comm = self.topology.world.Dup()  # for close()'s one exchange (_all_closing)
        # Host tensors use the Numba CPU kernels and the node's shared-memory segments.  Device
        # tensors (CUDA) take the device path (tunelab.engine.device), set up on the first one.
        self.kernels = get_backend("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        # Ranks sharing a host share its cores.  The setting is per thread (Numba's is thread-local):
        # threads that run collectives (the coordinator) call use_kernel_threads() themselves.
        self.kernel_threads = max(1, (cores or 1) // self.topology.host_size)
        self.use_kernel_threads()
        # Waiting ranks spin briefly when every rank has a core of its own, and yield at once when
        # ranks outnumber cores (a spinning rank would steal the core the awaited peer needs).
        spin = 2000 if self.topology.host_size <= (cores or 1) else 0
        # Agreeing on a call through MPI (several nodes) polls for up to 200 us, yielding the core between
        # polls, before it sleeps: a round trip between hosts takes tens of microseconds, a sleep at least
        # 50 us more, and where ranks outnumber cores the yield hands the core to the rank waited for.
        self._spin_s = 200e-6
        self.barrier = NodeBarrier(self.topology.local, self.config.timeout_s, spin=spin)
        self._host = HostPath(self.topology.local, self.kernels, self.barrier)
        self._device: Any = None
        self._closed = False
        self._failed: str | None = None  # why the engine stopped (see _stop), once it has
        self._marking = True  # device tensors marked ready where they are submitted (mark_ready)
        self._gpu_seen: int | None = None  # the GPU of this rank's device tensors, before the device path
        self.link = self._emulated_link()
        self._ring_world = self._ring_over(self.topology.world)
        self._ring_cross = self._ring_over(self.topology.cross)
        self._plans: dict[tuple, list[Bucket]] = {}
        self._small: dict[tuple, _SmallCall] = {}
        self._calls = 0
        self._knobs = Knobs()
        self._knob_code = 0  # (set with the knobs: a call's header carries it, so ranks agree on them too)
        self.set_knobs(self.config.knobs)

    def _emulated_link(self) -> EmulatedLink | None:
        topo, gbps = self.topology, self.config.link_gbps
        if gbps is None or topo.num_nodes == 1:
            return None
        return EmulatedLink(topo.local, gbps, self.config.link_latency_us)

    def _ring_over(self, comm: MPI.Comm) -> RingAllreduce:
        """The ring (and recursive doubling) over ``comm``, with the emulated link that what arrives from
        the left neighbour, or from any partner on another emulated node, passes through (collective
        over ``comm``)."""
        world_ranks = comm.allgather(self.topology.rank)
        timeout_s = self.config.timeout_s
        if self.link is None:
            return RingAllreduce(comm, self.kernels, timeout_s=timeout_s)
        me = self.topology.rank
        remote = frozenset(i for i, w in enumerate(world_ranks) if self.topology.emulated_boundary(w, me))
        left = (comm.rank - 1) % comm.size
        return RingAllreduce(comm, self.kernels, self.link if left in remote else None, self.link, remote,
                             timeout_s=timeout_s)

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
        self._check_usable()
        new = (knobs or self._knobs).replace(**changes) if changes else (knobs or self._knobs)
        self.check_knobs(new)
        self._small.clear()  # the slots may move (their old window is freed first), the size limit change
        if new.oneshot_max_bytes > self._host.slots.half_bytes:  # the same verdict on every rank
            try:
                self._host.ensure_slots(new.oneshot_max_bytes)
            except BaseException as exc:  # (the old slots are gone, and a peer's may not be)
                self._stop(exc, "a knob change (the one-shot staging's allocation)")
                raise
        for ring in (self._ring_world, self._ring_cross):
            ring.doubling_max_bytes = new.doubling_max_bytes
        if self._device is not None:
            try:
                self._device.ensure_slots(new.oneshot_max_bytes)
            except BaseException as exc:  # (the old device staging is freed before the new one is mapped)
                self._stop(exc, "a knob change (the device one-shot staging's allocation)")
                raise
        self._knobs = new
        # every knob shapes what a call does (the route, the buckets, the pieces): a rank that changed
        # them alone would pair its calls with differently planned ones, so every call agrees on them
        self._knob_code = zlib.crc32(repr(dataclasses.astuple(new)).encode())
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
        if self._failed is not None or self._closed:
            self._check_usable()
        if type(tensor) is np.ndarray and isinstance(op, str):
            small = self._small.get((tensor.dtype, tensor.shape, op))
            if small is None and op in _OP_LOOKUP and self._small_host_call(tensor):
                small = self._small_call(tensor.dtype, tensor.shape, op)
            if small is not None:
                try:
                    checked = None if out is None else _check_out(0, tensor, out)
                except ValueError as exc:
                    self._refuse(exc, *small.signature)
                return self._short_route(small, tensor, checked)
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
        self._check_usable()
        n = len(tensors)
        try:
            name, kop, average = _op(op)
            if outs is not None and len(outs) != n:
                raise ValueError(f"{len(outs)} outputs for {n} tensors")
            groups_ = list(groups) if groups is not None else [None] * n
            if len(groups_) != n:
                raise ValueError(f"{len(groups_)} group ids for {n} tensors")
            for g in groups_:  # -1 stands for "no group" in the agreed rows and the plan cache
                if g is not None and (isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 0):
                    raise ValueError(f"a group id is None or an integer >= 0, got {g!r}")
            on_device = [is_device_tensor(t) for t in tensors]
            arrays, outs_ = self._inputs(tensors, outs, on_device, check_overlaps=verify)
            # Where a tensor lives is part of the call: ranks that disagree get one clear error.
            rows = [(_safe_code(a.dtype) | (DEVICE_ROW if d else 0), -1 if g is None else int(g), *a.shape)
                    for a, g, d in zip(arrays, groups_, on_device)]
        except (ValueError, TypeError) as exc:
            if not verify:
                raise
            found = _OP_LOOKUP.get(op) if isinstance(op, str) else None
            self._refuse(exc, (_NO_OP if found is None else _OP_CODES[found[0]], n, self._knob_code, _VALID), [])
        if verify and n == 1 and not on_device[0] and groups_[0] is None and self._small_host_call(arrays[0]):
            small = self._small_call(arrays[0].dtype, arrays[0].shape, name)
            return [self._short_route(small, arrays[0], outs_[0])]
        self._calls += 1
        what = f"allreduce call #{self._calls}"
        if verify:
            try:
                agree(self.topology.world, (_OP_CODES[name], n, self._knob_code, _VALID), rows, self.config.timeout_s, what,
                      _HEADER_LABELS, self.barrier if self.topology.num_nodes == 1 else None, self._spin_s)
            except CollectiveTimeoutError as exc:
                self._stop(exc, what)
                raise
        # The verdicts below are the same on every rank: the dtypes were just agreed.
        for a, row in zip(arrays, rows):
            _check_reducible(a.dtype, row[0] & ~DEVICE_ROW, average)
        call = Call(kop, 1.0 / self.topology.size if average else 1.0)
        try:
            self._buckets(arrays, outs_, groups_, rows, on_device, call, what)
        except CollectiveTimeoutError as exc:  # (the device path's agreed setup errors leave it usable)
            self._stop(exc, what)
            raise
        return [o.owner if d else o for o, d in zip(outs_, on_device)]

    def _buckets(self, arrays: list[Any], outs_: list[Any], groups_: list[int | None], rows: list[tuple],
                 on_device: list[bool], call: Call, what: str) -> None:
        """An agreed call's data: host tensors, then device tensors, each in submission order.  An error
        in the algorithms (this rank's alone, say a kernel's) stops the engine (:meth:`_stop`)."""
        n = len(arrays)
        for device in (False, True):  # host tensors, then device tensors, each in submission order
            idx = [i for i in range(n) if on_device[i] == device]
            if not idx:
                continue
            path = self._device_path(arrays[idx[0]].owner) if device else self._host
            if device:
                path.begin([arrays[i] for i in idx])  # after the producers' work on these tensors
                if path.run_shared([arrays[i] for i in idx], [outs_[i] for i in idx], call.op, call.factor, what):
                    path.end([outs_[i] for i in idx])
                    continue
            for bucket in self._plan([arrays[i] for i in idx], [groups_[i] for i in idx], [rows[i] for i in idx]):
                members = [idx[j] for j in bucket.indices]
                srcs = [arrays[i] if device or arrays[i].flags.c_contiguous else np.ascontiguousarray(arrays[i])
                        for i in members]
                layout = Layout(srcs, [outs_[i] for i in members])
                try:
                    if device and path.host_staged is not None:
                        self._staged(layout, call, path, what)
                    else:
                        self._run(layout, call, path, what)
                except BaseException as exc:
                    self._stop(exc, what)
                    raise
            if device:
                path.end([outs_[i] for i in idx])  # results ordered before their consumers

    @property
    def direct_device_mpi(self) -> bool:
        """Whether device data crosses nodes without host staging (a CUDA-aware MPI, several nodes)."""
        return self._device is not None and self._device.direct

    @property
    def shared_gpu(self) -> bool:
        """Whether this node's ranks share one GPU and its first rank does their device work (the
        shared-GPU path; known once a device call has set the device path up)."""
        return self._device is not None and self._device.shared is not None

    def device_zeros(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """Zeros in device memory, on the device and through the kernel library this engine's device path
        uses: a joined rank's share of its peers' device allreduces (they take the device path on every
        rank, so a host array there would be refused as a rank mismatch)."""
        from .device import device_backend_name, zeros

        index = self._device.index if self._device is not None else self._gpu_seen
        return zeros(shape, dtype, device_backend_name(self.config.backend), index)

    def is_device_tensor(self, tensor: object) -> bool:
        """Whether ``tensor`` lives in device memory (and so takes the device path)."""
        return is_device_tensor(tensor)

    def mark_ready(self, buf: Any) -> Any:
        """A device buffer marked ready on its producer's stream where it is submitted (the coordinator's
        callers: gradient hooks), so its call waits for no later work of the framework
        (:meth:`DevicePath.mark_ready`).  Before the first device call has made the device path (that
        takes every rank), or when this thread cannot record on that stream, it carries its producer's
        stream instead: its call records an event there when it starts, which is also correct, only
        later.  Marks come from a stock the engine's thread makes (no event is created, nor a device
        switched, in the caller's thread).  ValueError for a tensor on another GPU than this rank's
        others."""
        self.check_gpu(buf)
        path = self._device
        if path is None or not self._marking:
            # its call records an event on this producer's stream when it starts (current streams are
            # per thread: the coordinator's would be the default stream, not a side stream of this one)
            try:
                from .device import submitted_stream_handle, with_ready

                return with_ready(buf, (None, submitted_stream_handle(buf.owner)))
            except UsageError:
                raise
            except Exception:  # noqa: BLE001 - left unmarked: its call records on the coordinator's stream
                return buf
        try:
            return path.mark_ready(buf)
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a back end's CUDA error of any kind: fall back, once said
            self._marking = False
            warnings.warn(f"tunelab: device tensors are ordered when their call starts, not where they are "
                          f"submitted ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
            return buf

    def check_gpu(self, buf: Any) -> None:
        """ValueError unless ``buf`` is on this rank's GPU (where its device path works, or where its
        first device tensor was): one rank reduces on one GPU, and a tensor on another would be read
        through the wrong device's stream (a CUDA error at best)."""
        index = device_index(buf.owner)
        mine = self._device.index if self._device is not None else self._gpu_seen
        if index is None or mine is None:
            self._gpu_seen = index if mine is None else mine
            return
        if index != mine:
            raise ValueError(f"a device tensor on GPU {index}, but this rank reduces on GPU {mine}: tunelab "
                             "reduces one GPU's tensors per rank (keep the tensors a rank reduces on one "
                             "device, e.g. after torch.cuda.set_device(local_rank))")

    def _inputs(self, tensors: Sequence[Any], outs: Sequence[Any] | None,
                on_device: list[bool], check_overlaps: bool = True) -> tuple[list[Any], list[Any]]:
        """Host tensors as numpy arrays, device tensors as zero-copy device buffers, and an output
        for each (checked, or allocated like its input on the same side).  ``check_overlaps``: refuse
        outputs that share memory with another tensor of the call (:func:`refuse_overlaps`); off for the
        coordinator's fused calls, whose members were checked where they were submitted, per group
        (there an error would fail the coordinator for good)."""
        arrays: list[Any] = []
        results: list[Any] = []
        for i, (t, device) in enumerate(zip(tensors, on_device)):
            if device:
                a = device_buffer(t)
                if a.ready is None:  # (a marked buffer was checked where it was marked: mark_ready)
                    self.check_gpu(a)
                o = device_buffer(outs[i] if outs is not None else empty_like(a))
                if o.shape != a.shape or o.dtype != a.dtype:
                    raise ValueError(f"output {i} must be a device array of shape {a.shape} and dtype {a.dtype}")
                if outs is not None and o.addr != a.addr:  # (written through this rank's GPU's stream too)
                    self.check_gpu(o)
            else:
                a = np.asarray(t)
                o = _check_out(i, a, outs[i]) if outs is not None else np.empty_like(a, order="C")
            arrays.append(a)
            results.append(o)
        if outs is not None and check_overlaps:  # (fresh outputs share memory with nothing)
            refuse_overlaps(arrays, results)
        return arrays, results

    def _device_path(self, owner: Any) -> Any:
        if self._device is None:
            from .device_ipc import IpcUnavailable
            from .device_path import DevicePath

            path = DevicePath(self.topology, self.config, self.barrier, device_index(owner))
            try:
                staged, failed = None, None
                try:  # (slots of one byte at least: they map the peers' memory, which tells whether CUDA IPC works)
                    path.ensure_slots(max(1, self._knobs.oneshot_max_bytes))
                except IpcUnavailable as exc:  # (every rank of the node: the mapping's outcome is voted)
                    staged = str(exc)
                except Exception as exc:  # noqa: BLE001 - raised below, every node told at once
                    failed = exc
                # no CUDA IPC on some node: every node stages through host memory, so every rank runs
                # the same algorithms on the same pieces; a node that failed otherwise fails every node
                told = allgather_object(self.topology.world,
                                        (staged, None if failed is None else f"{type(failed).__name__}: {failed}"),
                                        self.config.timeout_s, "the device path's setup (its staging)",
                                        self.topology.world.rank)
                if failed is not None:
                    raise failed
                bad = [(r, f) for r, (_, f) in enumerate(told) if f is not None]
                if bad:
                    raise TunelabError("the device path's staging could not be set up on "
                                       + "; ".join(f"rank {r} ({f})" for r, f in bad[:4]))
                reason = next((r for r, _ in told if r), None)
                if reason is not None:
                    path.stage_through_host(reason)
            except BaseException:
                # (every rank raises: the setup is collective) kept, a path without its staging would
                # fail every later call; freed, the next call sets it up again
                with contextlib.suppress(Exception):
                    path.free()
                raise
            if path.host_staged is not None and self.topology.world.rank == 0:
                warnings.warn(f"tunelab: {path.host_staged}: device tensors are staged through host memory "
                              "(slower: every bucket crosses the bus twice)", RuntimeWarning, stacklevel=3)
            self._device = path
        return self._device

    def _staged(self, layout: Layout, call: Call, path: Any, what: str) -> None:
        """A device bucket through host memory, where the node's GPUs cannot map each other's: its
        tensors are packed into page-locked host memory on the engine's stream, the host algorithms
        reduce it there (the average's scale included), and the results are unpacked on the stream,
        ordered before the call's consumers as every device call's are."""
        if layout.count == 0:
            return
        isz, count = layout.itemsize, layout.count
        host = path.host_buffer(count * isz, layout.dtype)
        path.copy(algorithms.as_bytes(layout.pack_rows(0, count, int(host.ctypes.data)), isz))
        path.synchronize()  # the packed bytes are on the host before the host algorithms read them
        self._run(Layout([host], [host]), call, self._host, what)
        path.copy(algorithms.as_bytes(layout.unpack_rows(0, count, int(host.ctypes.data)), isz))

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

    # ---- algorithms ----------------------------------------------------------------------------
    def _run(self, layout: Layout, call: Call, path: Any, what: str) -> None:
        if layout.count == 0:
            return
        topo, k = self.topology, self._knobs
        if topo.size == 1:
            algorithms.alone(path, layout)
        elif topo.num_nodes == 1 and layout.count * layout.itemsize <= k.oneshot_max_bytes:
            algorithms.oneshot(path, layout, call, topo.local_rank, what)
        elif topo.num_nodes == 1 or (k.hierarchical and topo.local_size > 1):
            # (on nodes of one rank the hierarchical ring over nodes is the flat ring: take it whole,
            # pipelined by segments, rather than one segment-sized ring after another)
            cross = self._ring_cross if topo.num_nodes > 1 else None
            algorithms.twoshot(path, layout, call, topo.local_rank, topo.local_size, k.segment_bytes, cross, what)
        else:
            algorithms.flat_ring(path, layout, call, self._ring_world, k.segment_bytes)

    def _small_host_call(self, a: np.ndarray) -> bool:
        """Whether a one-tensor host call takes the short route (a verdict every rank reaches alike for
        the same call): on one node the agreed one-shot, on several the flat path's recursive doubling
        straight on the output."""
        topo, k = self.topology, self._knobs
        if topo.num_nodes == 1:
            return 0 < a.nbytes <= k.oneshot_max_bytes
        return 0 < a.nbytes <= k.doubling_max_bytes and not (k.hierarchical and topo.local_size > 1)

    def _small_call(self, dtype: np.dtype, shape: tuple[int, ...], op: str) -> _SmallCall:
        """Everything a one-tensor one-shot call of this kind needs, computed once (cached)."""
        name, kop, average = _op(op)
        code = _safe_code(dtype)
        header, row = (_OP_CODES[name], 1, self._knob_code, _VALID), (code, -1, *shape)
        error: Exception | None = None
        try:
            _check_reducible(dtype, code, average)
        except TypeError as exc:
            error = exc
        count = int(np.prod(shape, dtype=np.int64))
        if self.topology.num_nodes == 1 and error is None:  # (an unreducible dtype, such as object, has no
            slots, nloc = self._host.slots, self.topology.local_size  # view: it is refused after agreeing)
            views = tuple([slots.half(q, parity)[:count * dtype.itemsize].view(dtype).reshape(shape)
                           for q in range(nloc)] for parity in (0, 1))
        else:  # several nodes: recursive doubling receives into the ring's scratch, not into slots
            views = ([], [])
        half = bool(half_kind(dtype))
        factor, before = None, None
        if average and error is None:  # halves scale in float32 (the kernel's way), others in their dtype
            pre, post = Call(kop, 1.0 / self.topology.size).scales(dtype)  # float16: partly before the sum
            before = None if pre == 1.0 else pre
            factor = post if half else dtype.type(post)
        small = _SmallCall(signature_hash(header, [row]), (header, [row]), views, kop, half, factor, before,
                           error)
        if len(self._small) >= _PLAN_CACHE_SIZE:
            self._small.clear()
        self._small[(dtype, shape, op)] = small
        return small

    def _short_route(self, small: _SmallCall, a: np.ndarray, o: np.ndarray | None) -> np.ndarray:
        """A call :meth:`_small_host_call` admits: the agreed one-shot on one node, recursive doubling on
        the output on several.  Any error but the agreed ones (a mismatch, an unreducible dtype) stops
        the engine (:meth:`_stop`)."""
        try:
            if self.topology.num_nodes > 1:
                return self._agreed_doubling(small, a, o)
            return self._agreed_oneshot(small, a, o)
        except RankMismatchError:
            raise
        except BaseException as exc:
            if small.error is None or isinstance(exc, CollectiveTimeoutError):
                self._stop(exc, self._call_name())
            raise

    def _agreed_oneshot(self, small: _SmallCall, a: np.ndarray, o: np.ndarray | None) -> np.ndarray:
        """One host tensor on one node: copy it into this rank's slot, agree on the call in the same
        barrier that publishes the slot, then reduce every peer's slot straight into the output."""
        self._calls += 1
        views = small.views[self.barrier.next_parity()]  # the parity is alike on every rank
        if small.error is None:
            np.copyto(views[self.topology.local_rank], a)
            if small.before is not None:
                self.kernels.scale(views[self.topology.local_rank], small.before)
        if not self.barrier.wait_agreeing(small.digest, self._call_name):
            what = self._call_name()
            everyone = allgather_object(self.topology.world, small.signature, self.config.timeout_s, what,
                                        self.topology.rank)
            raise RankMismatchError(f"ranks disagree on {what}: {describe_mismatch(everyone, _HEADER_LABELS)}")
        if small.error is not None:
            raise type(small.error)(*small.error.args)
        out = np.empty(a.shape, a.dtype) if o is None else o
        if small.half:  # halves accumulate in float32 and round once: the kernel does that
            self.kernels.reduce(out.ctypes.data, [v.ctypes.data for v in views], a.size, a.dtype, small.op)
            if small.factor is not None and small.factor != 1.0:
                self.kernels.scale(out, float(small.factor))
            return out
        if len(views) == 1:
            np.copyto(out, views[0])
        else:
            combine = _NUMPY_REDUCE[small.op]
            combine(views[0], views[1], out)
            for v in views[2:]:
                combine(out, v, out)
        if small.factor is not None:
            np.multiply(out, small.factor, out=out)
        return out

    def _agreed_doubling(self, small: _SmallCall, a: np.ndarray, o: np.ndarray | None) -> np.ndarray:
        """One small host tensor on several nodes: agree on the call (as every call through MPI is),
        then recursive doubling over every rank on the output array itself."""
        self._calls += 1
        header, rows = small.signature
        agree(self.topology.world, header, rows, self.config.timeout_s, self._call_name(), _HEADER_LABELS,
              None, self._spin_s)
        if small.error is not None:
            raise type(small.error)(*small.error.args)
        out = np.empty(a.shape, a.dtype) if o is None else o
        np.copyto(out, a)
        if small.before is not None:
            self.kernels.scale(out, small.before)
        tmp = self._ring_world.host_area(a.nbytes).view(a.dtype).reshape(a.shape)
        if small.half:  # halves accumulate in float32 and round once: the kernel does that
            def combine(first: np.ndarray, second: np.ndarray) -> None:
                self.kernels.reduce(out.ctypes.data, [first.ctypes.data, second.ctypes.data], a.size, a.dtype,
                                    small.op)
        else:
            reduce = _NUMPY_REDUCE[small.op]

            def combine(first: np.ndarray, second: np.ndarray) -> None:
                reduce(first, second, out)
        self._ring_world.doubling(out, tmp, combine)
        if small.factor is not None and small.factor != 1.0:
            if small.half:
                self.kernels.scale(out, float(small.factor))
            else:
                np.multiply(out, small.factor, out=out)
        return out

    def _call_name(self) -> str:
        return f"allreduce call #{self._calls}"

    def _refuse(self, exc: Exception, header: tuple[int, ...], rows: list[tuple[int, ...]]) -> NoReturn:
        """This rank's arguments to a call are invalid (``exc``): the call still takes its part in the
        agreement every rank makes, under a header marked invalid, so the other ranks fail this call at
        once (RankMismatchError, naming this rank) instead of pairing it with this rank's next call, a
        silent mix of two calls' data; then ``exc`` is raised here.  Where every rank passed the same
        invalid arguments, they agree, and each raises its own error."""
        self._calls += 1
        try:
            agree(self.topology.world, (*header[:-1], _INVALID), rows, self.config.timeout_s, self._call_name(),
                  _HEADER_LABELS, self.barrier if self.topology.num_nodes == 1 else None, self._spin_s)
        except RankMismatchError:
            pass  # the others raise it; here the error is this rank's own
        except CollectiveTimeoutError as timeout:
            self._stop(timeout, self._call_name())
            raise
        raise exc

    # ---- failure ----------------------------------------------------------------------------
    def _stop(self, exc: BaseException, what: str) -> None:
        """A call failed where its ranks need not have failed alike: a timeout (some rank is elsewhere),
        or an error in the algorithms on this rank.  The ranks' calls, node barriers and windows may
        no longer be in step, and a later call could pair one rank's data with another call's, or wait
        for ever in a collective a peer never makes: the engine takes no more calls
        (:meth:`_check_usable`), and :meth:`close` frees what needs the other ranks only where they all
        close too."""
        if self._failed is None:
            first = str(exc).splitlines()[0] if str(exc) else ""
            self._failed = f"{what} ({type(exc).__name__}{': ' + first if first else ''})"

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise TunelabError(f"this engine stopped after an error in {self._failed}: its ranks may be out "
                               "of step, so it takes no more calls (close it and make a new one; through "
                               "the runtime, shutdown() and init())")
        if self._closed:
            raise TunelabError("this engine is closed: make a new one")

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self, free_shared: bool | None = None) -> None:
        """Free the engine's memory, windows and communicators; a second call does nothing (collective).
        Freeing a shared-memory window waits for every rank of the node, and after a failure on some rank
        (:meth:`_stop`) a peer may never come: so the ranks first agree that every one of them is closing
        (:meth:`_all_closing`, with the timeout), and where they do not, only this rank's own resources
        are let go and the rest is left to the process's end.  ``free_shared``: the caller's own verdict
        (True: it knows every rank frees now, as the runtime agrees at shutdown; False: free nothing
        shared), in place of that exchange."""
        if self._closed:
            return
        self._closed = True
        if self.link is not None:
            self.link.close()
        if not (self._all_closing() if free_shared is None else free_shared):
            self._small.clear()
            self._device = None
            return
        if self._device is not None:
            self._device.free()
            self._device = None
        self._small.clear()
        self._host.free()
        self.barrier.free()
        self._exit_comm.Free()
        self.topology.free()

    def _all_closing(self) -> bool:
        """Whether every rank closes this engine now: a timed barrier on a communicator kept for it (the
        engine's own may hold a request a timeout left), then a second one, so that a rank whose wait ran
        out just as the last came does not leave the others in the frees.  False where a rank did not
        come within the timeout (it failed elsewhere, or never closes)."""
        from .consensus import all_came

        return all_came(self._exit_comm, self.config.timeout_s, "the engine's close", rounds=2)

    def __enter__(self) -> Engine:  # noqa: PYI034 (not subclassed; py3.10 has no typing.Self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _SmallCall:
    """A one-tensor one-shot call of one dtype, shape and op, prepared once."""

    digest: int
    signature: tuple  # (header, rows), for the mismatch message
    views: tuple[list[np.ndarray], list[np.ndarray]]  # every rank's slot as dtype[shape], per half (one node)
    op: ReduceOp
    half: bool
    factor: Any  # the average's scale after the sum (1/N in the dtype, or float16's part), or None
    before: float | None  # float16's part of the average's scale before the sum, or None
    error: Exception | None  # raised after agreement (every rank alike) for unreducible calls


def check_reducible(dtype: np.dtype, average: bool) -> None:
    """TypeError when the engine cannot reduce ``dtype`` (with ``average``: a non-floating dtype), for
    callers that check a tensor where it is submitted; the verdict is cached per dtype."""
    key = (dtype, average)
    error = _REDUCIBLE.get(key, False)
    if error is False:
        try:
            _check_reducible(dtype, _safe_code(dtype), average)
            error = None
        except TypeError as exc:
            error = str(exc)
        _REDUCIBLE[key] = error
    if error is not None:
        raise TypeError(error)


_REDUCIBLE: dict[tuple[np.dtype, bool], str | None] = {}


def _check_reducible(dtype: np.dtype, code: int, average: bool) -> None:
    if code == 0:
        dtype_code(dtype)  # raises TypeError naming the dtype
    if average and code not in FLOAT_CODES:
        raise TypeError(f"average needs a floating dtype, got {dtype.name}; use sum")


def _safe_code(dtype: np.dtype) -> int:
    try:
        return dtype_code(dtype)
    except TypeError:
        return 0  # agreed like any other code; rejected on every rank after agreement


def memory_span(x: Any) -> tuple[int, int]:
    """The bytes ``x`` (a numpy array or a device buffer) spans: [start, end)."""
    if isinstance(x, np.ndarray):
        start = x.__array_interface__["data"][0]
        if x.flags.c_contiguous:
            return start, start + x.nbytes
        low = high = start  # (a strided view: from its lowest to its highest element)
        for n, stride in zip(x.shape, x.strides):
            low, high = (low + (n - 1) * stride, high) if stride < 0 else (low, high + (n - 1) * stride)
        return low, high + x.itemsize
    return x.addr, x.addr + x.size * x.dtype.itemsize


def refuse_overlaps(arrays: list[Any], results: list[Any]) -> None:
    """ValueError where an output shares memory with another tensor of the call than its own input
    (exactly in its place): the algorithms write a piece of the results while later pieces of the
    inputs are still to be read, so such a call would give results that depend on the sizes and knobs.
    One sweep over the spans, sorted (about 3 us a tensor); a call wholly in place (every output its
    input, the common case: gradients) checks that no tensor comes twice, and sweeps only where two of
    its tensors are views of one buffer (``x[:n]`` and ``x[1:]`` in place would overwrite each other)."""
    if all(o is a for a, o in zip(arrays, results)):
        seen: dict[int, int] = {}
        buffers: set[int] = set()
        shared = False
        for i, a in enumerate(arrays):
            if id(a) in seen and a.size:
                raise ValueError(f"output {seen[id(a)]} overlaps input {i} of the same call (the same "
                                 "tensor twice, in place): give it memory of its own")
            seen[id(a)] = i
            owner = _owner(a)
            shared = shared or id(owner) in buffers
            buffers.add(id(owner))
        if not shared:
            return
    spans = []
    for i, (a, o) in enumerate(zip(arrays, results)):
        if a.size:
            spans.append((*memory_span(a), i, False))
            spans.append((*memory_span(o), i, True))
    spans.sort()
    active: list[tuple[int, int, int, bool]] = []
    for start, end, i, out in spans:
        active = [x for x in active if x[1] > start]
        for s2, e2, j, out2 in active:
            if (out or out2) and not (i == j and (s2, e2) == (start, end) and out != out2):
                (k, other), kind = ((i, j) if out else (j, i)), ("output" if out and out2 else "input")
                raise ValueError(f"output {k} overlaps its input without being in its place" if i == j else
                                 f"output {k} overlaps {kind} {other} of the same call (its results would "
                                 "overwrite what is still to be read): give it memory of its own")
        active.append((start, end, i, out))


def _owner(a: Any) -> Any:
    """The object whose memory ``a`` views (``a`` itself where it owns its memory): two views of one
    buffer have the same owner."""
    while isinstance(getattr(a, "base", None), np.ndarray):
        a = a.base
    return a.base if getattr(a, "base", None) is not None else a


def _check_out(i: int, a: np.ndarray, o: Any) -> np.ndarray:
    if not isinstance(o, np.ndarray) or o.shape != a.shape or o.dtype != a.dtype:
        raise ValueError(f"output {i} must be an array of shape {a.shape} and dtype {a.dtype}")
    if not o.flags.c_contiguous or not o.flags.writeable:
        raise ValueError(f"output {i} must be C-contiguous and writeable")
    return o


def is_device_tensor(tensor: object) -> bool:
    """Device memory: a ``__cuda_array_interface__`` exporter, or a DLPack exporter on a CUDA
    device; under Numba's CUDA simulator, its simulated device arrays."""
    if isinstance(tensor, np.ndarray):
        return False
    is_cuda = getattr(tensor, "is_cuda", None)  # torch: a flag, cheaper than building the interface
    if isinstance(is_cuda, bool):
        return is_cuda
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
