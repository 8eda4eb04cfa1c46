"""A kernel back end that runs launches as late as CUDA allows, for the device path under the simulator.

Numba's CUDA simulator runs every kernel at once, in the calling thread: a launch is done before the
next line runs, so code that forgets to wait for a stream before the host (MPI, a peer process
through a host barrier, ``free``) touches what the stream writes or reads passes there and fails on
a GPU.  :class:`LazyStreams` wraps the simulator's back end and queues every launch on its stream;
queued work runs only when something makes it: ``stream_sync``, ``event_sync``, ``synchronize``, or a
stream that waits on an event and is itself made to run.  That is the latest schedule a GPU may
choose, so any host access that relies on a launch having run without a wait reads stale memory
here, and a test compares results with numpy.

Cross-process ordering through interprocess events cannot be modelled in one process (a peer's queue
lives in its own process), so the device path runs with ``stream-sync`` ordering under this back end.
Allocations are kept alive while the back end lives, so a queued launch never reads freed simulator
memory (on a GPU, ``cudaFree`` waits for the device).
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from typing import Any


class _Event:
    def __init__(self) -> None:
        self.stream: Any = None
        self.position = 0


class LazyStreams:
    def __init__(self, inner: Any) -> None:
        self._inner, self.name = inner, inner.name
        self._queues: dict[int, list[tuple[int, Any]]] = {}  # per stream: (position, work)
        self._queued: Counter = Counter()    # launches queued on each stream so far
        self._streams: dict[int, Any] = {}
        self._external: dict[int, Any] = {}  # handle -> stream, for external_stream
        self._keep: list[Any] = []
        self.deferred = 0  # launches that were queued behind the host's back at some point (0: lazy did nothing)
        self._lock = threading.RLock()  # threads queue and run launches (the coordinator's, the caller's)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    # ---- launches ---------------------------------------------------------------------------------
    def _launch(self, attr: str, args: tuple, kwargs: dict) -> None:
        fn = getattr(self._inner, attr)
        bound = inspect.signature(fn).bind(*args, **kwargs)
        stream = bound.arguments.get("stream", 0)
        bound.arguments["stream"] = stream
        with self._lock:
            key = self._key(stream)
            self._queued[key] += 1
            self._queues.setdefault(key, []).append((self._queued[key], ("run", fn, bound.args, bound.kwargs)))
            self.deferred += 1

    def copy_table(self, *args: Any, **kwargs: Any) -> None:
        self._launch("copy_table", args, kwargs)

    def scale_copy_table(self, *args: Any, **kwargs: Any) -> None:
        self._launch("scale_copy_table", args, kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> None:
        self._launch("reduce", args, kwargs)

    def reduce_bcast(self, *args: Any, **kwargs: Any) -> None:
        self._launch("reduce_bcast", args, kwargs)

    # ---- streams and events -------------------------------------------------------------------------
    def _key(self, stream: Any) -> int:
        key = 0 if isinstance(stream, int) else id(stream)
        self._streams.setdefault(key, stream)
        return key

    def new_stream(self) -> Any:
        stream = self._inner.new_stream()
        self._key(stream)
        return stream

    def external_stream(self, handle: int) -> Any:
        """Another library's stream: the legacy default for 0, else a stream of its own per handle (the
        simulator's back end would give 0 for every handle)."""
        if not handle:
            return 0
        with self._lock:
            if handle not in self._external:
                self._external[handle] = self.new_stream()
            return self._external[handle]

    def new_event(self, *args: Any, **kwargs: Any) -> _Event:
        return _Event()

    def record(self, event: _Event, stream: Any) -> None:
        with self._lock:
            event.stream, event.position = self._key(stream), self._queued[self._key(stream)]

    def wait_event(self, stream: Any, event: _Event) -> None:
        if event.stream is None:
            return  # never recorded: nothing to wait for
        with self._lock:
            key = self._key(stream)
            self._queued[key] += 1
            self._queues.setdefault(key, []).append((self._queued[key], ("wait", event.stream, event.position)))

    def event_sync(self, event: _Event) -> None:
        if event.stream is not None:
            self._run(event.stream, event.position)

    def stream_sync(self, stream: Any) -> None:
        key = self._key(stream)
        self._run(key, self._queued[key])

    def synchronize(self) -> None:
        for key in list(self._queues):
            self._run(key, self._queued[key])

    def _run(self, key: int, upto: int) -> None:
        with self._lock:
            queue = self._queues.get(key, [])
            while queue and queue[0][0] <= upto:
                _, work = queue.pop(0)
                if work[0] == "wait":
                    self._run(work[1], work[2])
                else:
                    work[1](*work[2], **work[3])

    # ---- memory: kept alive while queued launches may still address it -----------------------------
    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        array = self._inner.alloc(nbytes, stream)
        self._keep.append(array)
        return array

    def upload_table(self, table: Any, stream: Any = None) -> Any:
        uploaded = self._inner.upload_table(table, stream)
        self._keep.append(uploaded)
        return uploaded

    def pending(self) -> int:
        """Launches queued and not run yet, over every stream."""
        return sum(len(q) for q in self._queues.values())
