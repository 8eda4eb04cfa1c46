"""The device data path: the algorithms' :class:`~tunelab.engine.paths.DataPath` for CUDA memory.

Everything is ordered on the engine's **own CUDA stream**, never by waiting for the whole device:

* ``begin``: the engine stream waits on events recorded on the producers' streams (the framework's
  current stream: torch's, CuPy's, or the legacy default stream), so the collective starts after the
  kernels that wrote its inputs without the host waiting for them.  A tensor submitted through the
  coordinator carries its own event, recorded where it was submitted (:meth:`DevicePath.mark_ready`:
  the work queued after that, the rest of backward, is not waited for); others get one recorded
  when the call starts, on their producer's stream as the submitting thread saw it (a side stream
  under ``torch.cuda.stream(s)`` included), and that stream is ordered after the results too;
* kernels launch on the engine stream.  Their address tables are uploaded once and cached by
  content (:class:`TableCache`): a warmed-up call moves no table from the host and allocates
  nothing;
* the node's ordering point is chosen by topology (:func:`choose_ordering`):

  - ``ipc-events`` (each rank has a GPU of its own, P2P/NVLink between them): each rank records an
    interprocess event on its stream, ranks meet at a host barrier (microseconds: nobody waits for
    the GPU), then each stream waits on its peers' events.  The host never blocks on device work;
  - ``stream-sync`` (ranks share a GPU, where waiting on another process's event costs
    milliseconds): each rank waits for its own stream only, then meets the others on the host;

* ``end``: the engine stream records an event the producers' streams (and the calling thread's) wait
  on, so the framework's next kernels (the optimizer step) see the results, again without a host wait.
  With the numba-cuda back end the engine's stream is a blocking one, which the legacy default stream
  also orders against everything: there a call cannot overlap work on that stream (CuPy's stream is
  non-blocking).

Choose ``TUNELAB_DEVICE_ORDERING=auto|ipc-events|stream-sync`` to override the choice.  Under
Numba's CUDA simulator kernels run synchronously in the calling process and there are no
interprocess events: ``ipc-events`` then uses process-local events as stand-ins, which keeps the
protocol (and its counts of records and waits) testable without a GPU.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CollectiveTimeoutError, TunelabError
from ..kernels import ReduceOp, get_backend
from ..kernels.base import DeviceTable
from . import device as _device
from .device import cuda_aware_mpi, device_backend_name, simulated
from .device_ipc import DeviceArena, PinnedStaging
from .device_share import SharedGpu

if TYPE_CHECKING:
    from ..config import EngineConfig
    from .mpi_ring import RingAllreduce
    from .shm import NodeBarrier
    from .topology import Topology

ENV_ORDERING = "TUNELAB_DEVICE_ORDERING"
MARK_STOCK = 512  # events kept for marking submitted tensors (a model's gradients in flight, and more)
ORDERINGS = ("auto", "ipc-events", "stream-sync")
_TABLE_CACHE_SIZE = 4096


class TableCache:
    """Kernel tables in device memory, keyed by their content: the same bucket layout at the same
    addresses (a training step's gradients, the staging segments) reuses one upload."""

    def __init__(self, kernels: Any, stream: Any) -> None:
        self._kernels, self._stream = kernels, stream
        self._tables: dict[bytes, DeviceTable] = {}

    def get(self, table: np.ndarray) -> DeviceTable:
        table = np.ascontiguousarray(table, dtype=np.int64)
        # (the whole shape: a list of 3 source addresses and one copy row of 3 numbers can hold the same bytes)
        key = np.asarray(table.shape, np.int64).tobytes() + b"|" + table.tobytes()
        found = self._tables.get(key)
        if found is None:
            if len(self._tables) >= _TABLE_CACHE_SIZE:
                self._kernels.stream_sync(self._stream)  # no queued launch still reads a table
                self._tables.clear()
            found = self._tables[key] = self._kernels.upload_table(table, self._stream)  # ordered before its launches
        return found

    def __len__(self) -> int:
        return len(self._tables)

    def clear(self) -> None:
        """Drop every table (the caller has synchronized the stream: no launch still reads one)."""
        self._tables.clear()


class StreamSyncOrdering:
    """Each rank waits for its own stream (not the device), then meets its peers on the host."""

    name = "stream-sync"

    def __init__(self, path: DevicePath) -> None:
        self._path = path

    def order(self, what: str) -> None:
        self._path.kernels.stream_sync(self._path.stream)
        self._path.barrier.wait(what=what)

    def free(self) -> None:
        pass


class IpcEventOrdering:
    """Each rank's stream waits on its peers' interprocess events; the host barrier only says that
    every rank has *queued* its part, so no rank waits for the GPU."""

    name = "ipc-events"

    def __init__(self, path: DevicePath, local: Any, gather: Callable[[Any], list[Any]] | None = None) -> None:
        """``gather``: the node's timed exchange (``local.allgather`` when not given)."""
        self._path = path
        gather = gather or local.allgather
        kernels = path.kernels
        if not simulated() and kernels.name != "cupy":
            raise TunelabError(f"{ENV_ORDERING}=ipc-events needs the cupy kernel back end (numba-cuda has "
                               "no interprocess events); use stream-sync")
        self._opened: list[int] = []
        if simulated():
            # Process-local stand-ins: the simulator runs kernels synchronously, so they order
            # nothing more than the barrier does, and the protocol's counts stay testable.  (Made
            # through the same exchange as a GPU's handles, failures included.)
            def stand_ins() -> None:
                self._mine = kernels.new_event()
                self._peers = [kernels.new_event() for _ in range(local.size - 1)]

            _joint(gather, stand_ins, "an interprocess event")
            return
        import cupy

        rt = cupy.cuda.runtime
        def handle() -> bytes:
            self._mine = kernels.new_event(interprocess=True)
            return bytes(rt.ipcGetEventHandle(self._mine.ptr))

        handles = _joint(gather, handle, "an interprocess event")
        self._peers = []
        self._runtime = rt

        def open_peers() -> None:
            for q, h in enumerate(handles):
                if q != local.rank:
                    self._opened.append(int(rt.ipcOpenEventHandle(h)))

        try:
            _joint(gather, open_peers, "opening the peers' interprocess events")
        except BaseException:
            self.free()
            raise

    def order(self, what: str) -> None:
        kernels, stream = self._path.kernels, self._path.stream
        if self._opened:  # real interprocess events, through the runtime's raw handles
            self._runtime.eventRecord(self._mine.ptr, stream.ptr)
            self._path.barrier.wait(what=what)
            for ptr in self._opened:
                self._runtime.streamWaitEvent(stream.ptr, ptr, 0)
            return
        kernels.record(self._mine, stream)
        self._path.barrier.wait(what=what)
        for event in self._peers:
            kernels.wait_event(stream, event)

    def free(self) -> None:
        if self._opened:
            import cupy

            for ptr in self._opened:
                cupy.cuda.runtime.eventDestroy(ptr)
            self._opened = []


ENV_SHARED_GPU = "TUNELAB_SHARED_GPU"
SHARED_GPU_MODES = ("auto", "leader", "peers")


def _leader_mode(device_ids: list[str], topology: Topology) -> bool:
    """Whether this rank votes for the leader protocol: ``TUNELAB_SHARED_GPU=leader`` forces it,
    ``peers`` refuses it, ``auto`` takes it when every rank of the (only) node uses the same GPU."""
    mode = os.environ.get(ENV_SHARED_GPU, "auto").strip() or "auto"
    if mode not in SHARED_GPU_MODES:
        raise ValueError(f"{ENV_SHARED_GPU} must be one of {', '.join(SHARED_GPU_MODES)}, got {mode!r}")
    possible = topology.num_nodes == 1 and topology.local_size > 1
    if mode == "auto":  # the simulator's one "GPU" is not a device processes contend for
        return possible and len(set(device_ids)) == 1 and not simulated()
    return possible and mode == "leader"


def _vote(gather: Callable[[Any], list[Any]], decide: Any, *args: Any) -> list[Any]:
    """Every rank's verdict of ``decide(*args)`` (``gather``: the node's timed exchange); a setting one
    rank rejects fails on every rank alike (a rank raising alone would leave its peers waiting in the
    exchange)."""
    try:
        verdict, error = decide(*args), ""
    except ValueError as exc:
        verdict, error = None, str(exc)
    votes = gather((verdict, error))
    errors = [e for _, e in votes if e]
    if errors:
        raise TunelabError(errors[0])
    return [v for v, _ in votes]


def _joint(gather: Callable[[Any], list[Any]], make: Callable[[], Any], what: str,
           ranks: str = "local rank") -> list[Any]:
    """Every rank's ``make()``, where making it may fail on one rank alone (a device, a driver, memory):
    the outcome is exchanged, so such a failure raises on every rank at once (its own error where it
    happened, one naming the ranks elsewhere) instead of leaving the others in the next exchange.
    ``gather`` is timed, so a rank that died or stalled is a CollectiveTimeoutError, not a hang."""
    mine, failed = None, None
    try:
        mine = make()
    except Exception as exc:  # noqa: BLE001 - raised below, on every rank
        failed = exc
    got = gather((mine, None if failed is None else f"{type(failed).__name__}: {failed}"))
    bad = [(r, f) for r, (_, f) in enumerate(got) if f is not None]
    if failed is not None:
        raise failed
    if bad:
        raise TunelabError(f"{what} failed on " + "; ".join(f"{ranks} {r} ({f})" for r, f in bad))
    return [v for v, _ in got]


def choose_ordering(configured: str, device_ids: list[str], backend: str) -> str:
    """``ipc-events`` when every rank of the node has a GPU of its own (and the back end can share
    events), ``stream-sync`` when some share one; a configured choice wins."""
    if configured not in ORDERINGS:
        raise ValueError(f"{ENV_ORDERING} must be one of {', '.join(ORDERINGS)}, got {configured!r}")
    if configured != "auto":
        return configured
    if simulated():
        return "ipc-events"  # the stand-ins exercise the protocol of the fast path
    if len(set(device_ids)) == len(device_ids) and backend == "cupy":
        return "ipc-events"
    return "stream-sync"


class DevicePath:
    """Device memory: staging segments mapped with CUDA IPC, kernels on the engine's stream."""

    device = True

    def __init__(self, topology: Topology, config: EngineConfig, barrier: NodeBarrier,
                 index: int | None = None) -> None:
        from .consensus import allgather_object

        me, timeout_s = topology.world.rank, config.timeout_s

        def gather(comm: Any, what: str) -> Callable[[Any], list[Any]]:
            # every exchange of the setup is timed: a peer that died or stalled is an error, not a hang
            return lambda value: allgather_object(comm, value, timeout_s, f"the device path's setup ({what})", me)

        self.index = index  # the device of the tensors: the stream, events and staging live there
        self.barrier = barrier

        def local_part() -> tuple[bool, str]:
            kernels = get_backend(device_backend_name(config.backend))
            if kernels.name == "cpu":
                raise TunelabError("device tensors need a GPU kernel back end (cupy or numba-cuda) and a "
                                   "CUDA device; none is available")
            self.kernels = kernels
            if index is not None:
                kernels.use_device(index)
            self.stream = kernels.new_stream()
            return topology.num_nodes > 1 and cuda_aware_mpi(), kernels.device_id()

        made = _joint(gather(topology.world, "a stream on every rank's GPU"), local_part, "the device path's setup",
                      "rank")
        kernels = self.kernels
        # Several nodes and a CUDA-aware MPI: the rings hand device memory to MPI directly.  Every
        # rank must choose alike, or they would run different protocols.
        self.direct = all(direct for direct, _ in made)
        node = gather(topology.local, "the node's GPUs")
        self.tables = TableCache(kernels, self.stream)
        self.arena = DeviceArena(topology.local, kernels.name, self.synchronize, timeout_s, me)
        self.slots = DeviceArena(topology.local, kernels.name, self.synchronize, timeout_s, me)
        self.staging = PinnedStaging()
        self.host_stage = PinnedStaging()  # a bucket staged through host memory (no CUDA IPC)
        self.host_staged: str | None = None  # why buckets are staged through host memory, or None
        self._buffers: dict[str, tuple[Any, int]] = {}
        self._ready, self._done = kernels.new_event(), kernels.new_event()
        self._ready_more: list[Any] = []  # for unmarked inputs of more producers' streams than one
        self._producers: dict[int, Any] = {}
        self._consumers: list[Any] = []  # the producers' streams of the call under way
        self._marked: list[Any] = []     # its inputs' marks (back to the stock when it ends)
        self._waited: list[Any] = []     # what its stream waits on: each producer stream's last mark,
        #                                  and _ready (and _ready_more) for inputs that had none
        self._free_marks: list[Any] = []
        self._mark_count = 0  # marks recorded so far (numbers them in recording order)
        self._marks_lock = threading.Lock()
        device_ids = node(made[me][1])
        leader = _vote(node, _leader_mode, device_ids, topology)
        self.shared: SharedGpu | None = None
        if all(leader):  # ranks sharing one GPU: the node's first rank does the device work
            self.shared = SharedGpu(self, topology.local)
        configured = os.environ.get(ENV_ORDERING, "auto").strip() or "auto"
        if self.shared is not None and configured == "auto":
            configured = "stream-sync"  # for calls the leader cannot take: waiting on a shared GPU's events is slow
        verdicts = _vote(node, choose_ordering, configured, device_ids, kernels.name)
        name = verdicts[0] if len(set(verdicts)) == 1 else "stream-sync"  # all ranks alike
        self.ordering: IpcEventOrdering | StreamSyncOrdering = StreamSyncOrdering(self)
        if name == "ipc-events":
            try:
                self.ordering = IpcEventOrdering(self, topology.local, node)
            except CollectiveTimeoutError:
                raise
            except Exception as exc:  # (on every rank of the node: the events' outcome is exchanged)
                if configured != "auto":
                    raise
                if topology.local.rank == 0:  # chosen, not asked for: the ranks order by stream syncs instead
                    warnings.warn(f"tunelab: interprocess CUDA events cannot be shared on this node ({exc}): "
                                  "ranks order their device work by waiting for their own streams (stream-sync)",
                                  RuntimeWarning, stacklevel=4)

    def mark_ready(self, buf: Any) -> Any:
        """``buf`` with an event recorded now on its producer's stream (the calling thread's current
        stream: a gradient hook's), so the call that reduces it waits for the work queued before this
        point, not for what the framework queues while the call waits its turn (the rest of the
        backward pass).  Called where tensors are submitted, from any thread: it takes an event the
        engine's thread made (:meth:`begin` keeps a stock), and leaves ``buf`` unmarked when none is left.
        Marks are numbered in the order they are recorded (under the lock), and carry the recording
        thread, so a call can tell which of its marks on one stream of one thread came last."""
        handle = _device.submitted_stream_handle(buf.owner)
        stream = self._stream_of(handle)
        with self._marks_lock:  # (one section: taking a mark, recording it and numbering it)
            if not self._free_marks:  # none left: the call records one on this stream when it starts
                return _device.with_ready(buf, (None, handle))
            event = self._free_marks.pop()
            try:
                self.kernels.record(event, stream)
            except BaseException:
                self._free_marks.append(event)
                raise
            self._mark_count += 1
            order = self._mark_count
        return _device.with_ready(buf, (event, stream, order, threading.get_ident()))

    def wait_producers(self) -> None:
        """Wait on the host for what the producers of this call's inputs queued before them."""
        for event in self._waited:
            self.kernels.event_sync(event)

    def run_shared(self, ins: list[Any], outs: list[Any], op: ReduceOp, factor: float, what: str) -> bool:
        """The whole call through the shared-GPU leader, when ranks share one GPU; False (on every
        rank alike) when they do not, or when some rank's memory cannot be shared."""
        if self.shared is None:
            return False
        keep = [i for i, b in enumerate(ins) if b.size]
        return self.shared.allreduce([ins[i] for i in keep], [outs[i] for i in keep], op, factor, what)

    # ---- a collective's bounds -------------------------------------------------------------------
    def begin(self, inputs: list[Any]) -> None:
        """Order the engine stream after the producers of ``inputs``: the events marked where they were
        submitted (:meth:`mark_ready`), and for inputs without one, an event recorded now on each of
        their producers' streams: the stream the submitting thread named (``ready=(None, handle)``:
        submitted before the device path existed, or when the marks ran out), else the owner's current
        stream in this thread (the caller's, or the coordinator's)."""
        if self.index is not None:
            self.kernels.use_device(self.index)  # this thread's current device (threads differ)
        if self._marked:  # a call that raised before end(): its marks go back to the stock, not lost
            with self._marks_lock:
                self._free_marks.extend(self._marked)
            self._marked = []
        # Events recorded on one stream complete in the order they were recorded: the last mark of each
        # producer stream covers that stream's earlier ones (a call fusing a model's gradients waits
        # on one event, not on one per gradient).  Streams are told apart by handle *and* recording
        # thread: a default-stream handle (0, or 2 under per-thread default streams) names a different
        # stream in each thread.  (One pass over the inputs: this runs for every call.)
        marked: dict[int, Any] = {}  # all go back to the stock at end
        last: dict[tuple[int, int], tuple] = {}
        unmarked: dict[int, Any] = {}
        for b in inputs:
            r = b.ready
            if r is not None and r[0] is not None:
                marked[id(r[0])] = r[0]
                key = (id(r[1]), r[3])
                m = last.get(key)
                if m is None or r[2] > m[2]:
                    last[key] = r
            else:
                stream = self._stream_of(r[1]) if r is not None else self._producer_stream(b.owner)
                unmarked[id(stream)] = stream
        here = self._producer_stream(inputs[0].owner)
        self._marked = list(marked.values())
        self._waited = [m[0] for m in last.values()]
        while len(self._ready_more) < len(unmarked) - 1:
            self._ready_more.append(self.kernels.new_event())
        for event, stream in zip([self._ready, *self._ready_more], unmarked.values()):
            self.kernels.record(event, stream)
            self._waited.append(event)
        # the results are ordered before the producers' streams and this thread's current one (where a
        # framework that synchronised a side stream into its own goes on)
        consumers = {id(m[1]): m[1] for m in last.values()}
        consumers.update(unmarked)
        consumers.setdefault(id(here), here)
        self._consumers = list(consumers.values())
        for event in self._waited:
            self.kernels.wait_event(self.stream, event)
        with self._marks_lock:  # a stock of marks for the submitting threads, made in this one
            short = MARK_STOCK - len(self._free_marks)
        made = [self.kernels.new_event() for _ in range(max(0, short))]
        with self._marks_lock:
            self._free_marks.extend(made)

    def end(self, outputs: list[Any]) -> None:
        """Order the producers' streams after the results (their next kernels read them); the marks
        this call waited on may be recorded again (a stream's wait took the event as it was)."""
        self.kernels.record(self._done, self.stream)
        for stream in self._consumers:
            self.kernels.wait_event(stream, self._done)
        with self._marks_lock:
            self._free_marks.extend(self._marked)
        self._marked, self._waited = [], []

    def synchronize(self) -> None:
        """Wait on the host for everything queued on the engine stream."""
        self.kernels.stream_sync(self.stream)

    def _producer_stream(self, owner: Any) -> Any:
        return self._stream_of(_device.producer_stream_handle(owner))

    def _stream_of(self, handle: int) -> Any:
        stream = self._producers.get(handle)
        if stream is None:
            stream = self._producers[handle] = self.kernels.external_stream(handle)
        return stream

    # ---- what the algorithms use ---------------------------------------------------------------
    def copy(self, rows: np.ndarray) -> None:
        self.kernels.copy_table(self.tables.get(rows), stream=self.stream)

    def scale_copy(self, rows: np.ndarray, dtype: np.dtype, factor: float) -> None:
        self.kernels.scale_copy_table(self.tables.get(rows), dtype, factor, stream=self.stream)

    def reduce(self, out: int, srcs: np.ndarray, count: int, dtype: np.dtype, op: ReduceOp) -> None:
        self.kernels.reduce(out, self.tables.get(np.asarray(srcs)), count, dtype, op, stream=self.stream)

    def order(self, what: str) -> None:
        self.ordering.order(what)

    def scratch(self, nbytes: int) -> int:
        return self._buffer("scratch", nbytes)

    def _buffer(self, name: str, nbytes: int) -> int:
        """Address of a private device buffer ``name`` of at least ``nbytes`` (grown, never shrunk)."""
        found = self._buffers.get(name)
        if found is None or found[1] < nbytes:
            if found is not None:
                self.kernels.stream_sync(self.stream)  # queued launches may still use the old one
            size = max(nbytes, 2 * found[1]) if found is not None else max(nbytes, 1 << 16)
            array = self.kernels.alloc(size, self.stream)
            found = self._buffers[name] = (array, size)
        return self.kernels.address(found[0])

    def cross_allreduce(self, addr: int, count: int, dtype: np.dtype, op: ReduceOp,
                        ring: RingAllreduce, segment_bytes: int) -> None:
        """A shard's ring between nodes: device memory straight to a CUDA-aware MPI, otherwise
        through the pinned host buffer (which the device kernels address directly)."""
        nbytes = count * dtype.itemsize
        if self.direct:
            ring.run(addr, count, dtype, op, segment_bytes, self.reduce,
                     lambda n: self._buffer("ring", n), self.synchronize)
            return
        if nbytes > self.staging.array.size:
            self.synchronize()  # a queued copy may still read the staging buffer being replaced
        host = self.staging.view(nbytes, dtype)
        self.copy(np.array([[addr, host.ctypes.data, nbytes]], dtype=np.int64))
        self.synchronize()  # MPI reads the staged shard from the host
        ring(host, op, segment_bytes)
        self.copy(np.array([[host.ctypes.data, addr, nbytes]], dtype=np.int64))

    # ---- staging through host memory ---------------------------------------------------------------
    def stage_through_host(self, reason: str) -> None:
        """Take every bucket through host memory from now on (:meth:`Engine._staged`): ``reason``, why
        device memory cannot be shared (no CUDA IPC between some node's GPUs; every rank of the job
        calls this alike).  Device staging mapped already is given back (collective over the node)."""
        self.host_staged = reason
        self.slots.free()
        self.arena.free()
        if self.shared is not None:  # the shared-GPU leader maps its peers' tensors through CUDA IPC too
            self.shared.free()
            self.shared = None

    def host_buffer(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        """Page-locked host memory for a bucket staged through the host (its kernels' copies reach it
        through unified addressing, as the cross-node staging's do)."""
        if nbytes > self.host_stage.array.size:
            self.synchronize()  # a queued copy may still read the buffer being replaced
        return self.host_stage.view(nbytes, dtype)

    # ---- lifetime ------------------------------------------------------------------------------
    def ensure_slots(self, oneshot_max_bytes: int) -> None:
        """Size the one-shot staging (collective over the node; nothing while staging through the host)."""
        if self.host_staged is None and oneshot_max_bytes > self.slots.half_bytes:
            if self.index is not None:  # (the coordinator's thread applies live knobs: its current GPU is 0)
                self.kernels.use_device(self.index)
            self.slots.ensure(max(oneshot_max_bytes, 1))

    def free(self) -> None:
        if self.index is not None:
            self.kernels.use_device(self.index)  # mappings and memory are closed in their own GPU's context
        self.synchronize()
        if self.shared is not None:
            self.shared.free()
        self.ordering.free()
        self.slots.free()
        self.arena.free()
        self._buffers.clear()
        # what else holds device or page-locked memory: the uploaded tables, the events, the host staging
        self.tables.clear()
        self.host_stage.free()
        self._free_marks.clear()
        self._ready_more.clear()
        self._producers.clear()
        self._marked.clear()
        self._waited.clear()
        self._consumers.clear()
        self.staging.free()
