"""The background coordinator: negotiation, live knobs, fusion and completion, once per cycle.

Framework hooks submit tensors as they become ready.  Every ``cycle_time_ms`` the
coordinator thread of each rank takes part in one small non-blocking allreduce (bitwise AND)
of:

* control bits: "I have no new tensor names", "I want to shut down", "nothing of mine is
  stalled" (and "... waited long enough to warn of"), "I am not leaving" (shutting down with
  nothing pending: what others wait for from me never comes), "nothing is pending here", and rank
  0's "no knob change pending";
* a bit set over the tensor names negotiated before (the *cache*: names get the same id
  on every rank the first time they are negotiated), one bit per name ready here.

The AND is exactly "ready on every rank", so steady-state steps send a few bytes per
tensor.  Only when some rank has a name not in the cache do ranks exchange names and
metadata (an allgather); only when rank 0 changed knobs do they broadcast them, and
every rank applies them before planning that cycle's fusion, so knobs always change at
the same point everywhere.  Tensors ready everywhere are reduced in id order (new ones
after cached ones), fused by the engine under the current knobs, and their handles
complete.  Any error is decided from data every rank has, so all ranks raise it at the
same cycle instead of some of them hanging.  A call the ranks disagree on (shape, dtype, op,
group) fails through its own handles on every rank, and the coordinator goes on serving later
calls; a stall or a rank that stops cycling fails the coordinator for good.  A rank that leaves
(shuts down, as a script that ended or raised does at exit) fails the others' pending calls at once,
naming it; a stall is said in one line after ``stall_warning_s``, long before it fails.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import RankExitedError, RankMismatchError, StallError, TunelabError, seen
from ..knobs import Knobs
from ..units import counted
from .consensus import allgather_object, bcast_object, say_still_waiting, wait_or_timeout
from .device import device_buffer, empty_like
from .engine import check_reducible, memory_span, refuse_overlaps
from .timeline import Timeline

if TYPE_CHECKING:
    from .engine import Engine

_NO_NEW_NAMES = 1
_SHUTDOWN = 2
_NO_STALL = 4
_NO_KNOB_CHANGE = 8
_NOT_JOINED = 16  # AND: nobody has joined
_ALL_JOINED = 32  # AND: everybody has joined
_ALL_WAITING = 64  # AND: a thread of every rank is blocked on a handle
_NO_STALL_WARNING = 128  # AND: no request anywhere has waited past the warning without being warned of
_NONE_LEAVING = 256  # AND: no rank is shutting down with nothing pending (it will submit nothing more)
_NOTHING_PENDING = 512  # AND: no rank has a request pending
_OPS = ("sum", "average", "min", "max")
_IDLE_FACTOR = 10
_QUIET_CYCLES = 3  # empty cycles in a row before a rank goes idle
CACHE_CAPACITY = 4096  # names kept negotiated before some are forgotten (see Coordinator._forget_names)


class Handle:
    """Completion of one submitted tensor; ``wait()`` returns the reduced array.  Completion is a lock
    held from creation until the coordinator releases it (a ``threading.Event`` builds a condition
    and a lock in Python: microseconds on every gradient a hook submits)."""

    __slots__ = ("_done", "_error", "_latch", "_owner", "name", "out", "waited")

    def __init__(self, name: str, out: np.ndarray, owner: Coordinator | None = None) -> None:
        self.name = name
        self.out = out
        self._owner = owner  # told while a thread waits here: its cycles do not wait for the grid
        self._latch = threading.Lock()
        self._latch.acquire()
        self._done = False
        self._error: BaseException | None = None
        self.waited = False  # whether anyone waited for it (its error, if any, then reached the job)

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> np.ndarray:
        self.waited = True
        if not self._done:
            owner = self._owner
            if owner is not None:
                owner._waiting(+1)
            try:
                limit = -1 if timeout is None else min(max(0.0, timeout), threading.TIMEOUT_MAX)
                acquired = self._latch.acquire(True, limit)
            finally:
                if owner is not None:
                    owner._waiting(-1)
            if acquired:
                self._latch.release()  # (for any other thread waiting on the same handle)
            elif not self._done:  # (done, yet not acquired: another waiter held the latch just then)
                raise TimeoutError(f"allreduce of {self.name!r} not done within {timeout} s")
        if self._error is not None:
            raise seen(self._error)
        return self.out

    def _complete(self, error: BaseException | None = None) -> None:
        """Called once by the coordinator's thread (a second call is ignored)."""
        if self._done:
            return
        self._error = error
        self._done = True
        self._owner = None
        self._latch.release()


class _Request:
    """One submitted tensor: what it reduces, where its result goes and what ranks agree on (``meta``,
    compared with the name cache's every cycle).  A plain slotted class: one is built for every
    gradient a hook submits, and a dataclass's default factories and ``__post_init__`` cost more."""

    __slots__ = ("array", "group", "handle", "meta", "name", "op", "out_view", "since", "warned")

    def __init__(self, name: str, array: Any, handle: Handle, op: str, group: str | None,
                 out_view: Any = None) -> None:
        self.name, self.array, self.handle, self.op, self.group = name, array, handle, op, group
        self.out_view = out_view  # the output as a device buffer (device tensors only)
        self.since = time.monotonic()
        self.warned = False  # named in a stall warning already
        dtype = array.dtype
        dname = _DTYPE_NAMES.get(dtype)
        if dname is None:  # (numpy builds a dtype's name in Python: microseconds, on every gradient)
            dname = _DTYPE_NAMES[dtype] = dtype.name
        self.meta = (dname, array.shape, op, group, out_view is not None)


_DTYPE_NAMES: dict[Any, str] = {}


class Coordinator:
    """Runs one engine's collectives from a background thread.  Collective to create and to shut down."""

    def __init__(self, engine: Engine, timeline_path: str | None = None,
                 stall_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.comm = engine.topology.world.Dup()
        from mpi4py import MPI  # (here, once: an import statement costs microseconds on every cycle)

        self._word, self._band = MPI.UINT64_T, MPI.BAND
        self.rank, self.size = self.comm.rank, self.comm.size
        self.stall_timeout_s = stall_timeout_s or engine.config.timeout_s
        # the timeline is opened on rank 0 alone (or per rank): a path that cannot be written must fail
        # every rank here, not leave the others in the runtime's next collective
        try:
            self.timeline, failed = Timeline.for_rank(timeline_path, self.rank), ""
        except OSError as exc:
            self.timeline, failed = None, f"cannot write the timeline {exc.filename or timeline_path}: {exc.strerror or exc}"
        said = allgather_object(self.comm, failed, engine.config.timeout_s, "the timeline's opening", self.rank)
        bad = next(((r, s) for r, s in enumerate(said) if s), None)
        if bad is not None:
            if self.timeline is not None:
                self.timeline.close()
            self.comm.Free()
            raise TunelabError(bad[1] if bad[0] == self.rank else f"rank {bad[0]}: {bad[1]}")
        self.cycles = 0
        self.knob_changes: list[tuple[int, Knobs]] = []  # (cycle, knobs) as applied, same on every rank
        self._lock = threading.Lock()
        self._pending: dict[str, _Request] = {}
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._requested: Knobs | None = None
        self._shutdown = False
        self._error: BaseException | None = None
        self.lost: list[Handle] = []  # the handles a failure completed with its error (_fail)
        self.left: tuple[int, ...] = ()  # the ranks seen leaving the job (shut down, nothing pending)
        self._warned = False  # a stall was warned of, and nothing was reduced since: no second line for it
        self._rejected: dict[str, BaseException] = {}  # calls ranks disagreed on, this cycle
        self._timeline_swap: tuple[Timeline | None, threading.Event] | None = None
        self._metas: list[tuple | None] = []  # per cached name: its metadata (None: renegotiate it)
        self._used: list[int] = []  # per cached name: the cycle it was last reduced in
        self._hits: list[int] = []  # per cached name: how often it was reduced
        self._last_forget = 0  # the cycle the cache last forgot names in
        self.cache_capacity = CACHE_CAPACITY
        self._device_zeros: dict[int, tuple[Any, Any]] = {}  # per cached name, while joined: (zeros, out)
        self._joined, self._join_cycle, self._join_last = False, -1, -1
        self._join_done = threading.Event()
        self._wake = threading.Event()
        self._hurried = False  # a thread began waiting on a handle: the next cycle starts at once
        self._waiters = 0      # threads blocked on a handle now: cycles keep starting at once...
        self._stuck = False    # ...unless every rank has one and the last cycle completed nothing
        self._idle = False  # nothing pending here for a while: sleep longer, but wake on the next submit
        self._quiet = 0     # cycles in a row that found nothing pending, before or after they ran
        self._had_work = False  # the last cycle found something pending when it began
        self.wakes = 0      # submits that woke an idle coordinator
        self._thread = threading.Thread(target=self._run, name="tunelab-coordinator", daemon=True)
        self._thread.start()

    # ---- user side ----------------------------------------------------------------------------
    @property
    def knobs(self) -> Knobs:
        return self.engine.knobs

    def submit(self, name: str, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> Handle:
        """Queue ``array`` for allreduce under ``name`` (the same name on every rank)."""
        return self.submit_group([name], [array], op, None if out is None else [out], group=None)[0]

    def submit_group(self, names: list[str], arrays: list[np.ndarray], op: str = "sum",
                     outs: list[np.ndarray] | None = None, group: str | None = None) -> list[Handle]:
        """Queue several tensors at once; with ``group`` set they are reduced together as one group."""
        self._raise_if_failed()
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}; choose from {', '.join(_OPS)}")
        if outs is not None and len(outs) != len(arrays):
            raise ValueError(f"{len(outs)} outputs for {len(arrays)} tensors")
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {twice!r} is named twice in one call; each tensor needs its own name")
        # A group's size is part of what ranks agree on: ranks that pass a group of different sizes
        # disagree on its first tensor, rather than reducing the common ones and stalling on the rest.
        group = None if group is None else f"{group} ({counted(len(names), 'tensor')})"
        reqs = []
        for i, (name, a) in enumerate(zip(names, arrays)):
            if self.engine.is_device_tensor(a):  # zero-copy views of device tensors; results land in ``out``
                src = self.engine.mark_ready(device_buffer(a))  # here, in the submitting thread
                out = outs[i] if outs is not None else empty_like(src)
                view = device_buffer(out)
                if view.shape != src.shape or view.dtype != src.dtype:
                    raise ValueError(f"output for {name!r} must be a device array {src.dtype}{list(src.shape)}")
                if outs is not None and view.addr != src.addr:  # here: in the coordinator it would fail every call
                    self.engine.check_gpu(view)
                reqs.append(_Request(name, src, Handle(name, out, self), op, group, view))
                continue
            src = np.ascontiguousarray(a).reshape(np.shape(a))  # (a 0-d array stays 0-d)
            out = outs[i] if outs is not None else np.empty_like(src)
            if out.shape != src.shape or out.dtype != src.dtype or not out.flags.c_contiguous \
                    or not out.flags.writeable:
                raise ValueError(f"output for {name!r} must be a C-contiguous, writeable "
                                 f"{src.dtype}{list(src.shape)}")
            reqs.append(_Request(name, src, Handle(name, out, self), op, group))
        for r in reqs:  # here, not in the coordinator's thread, where it would fail every later call
            check_reducible(r.array.dtype, r.op == "average")
        host = [r for r in reqs if r.out_view is None]
        if outs is not None and host:  # (one tensor too: an output partly over its input; a group's members together)
            refuse_overlaps([r.array for r in host], [r.handle.out for r in host])
        self._enqueue(reqs)
        return [r.handle for r in reqs]

    def submit_one(self, name: str, array: Any, op: str) -> Handle:
        """Queue one tensor for an in-place allreduce under ``name``: what a gradient hook submits,
        for every gradient of every step, without :meth:`submit_group`'s lists and output checks.
        ``array`` is a C-contiguous numpy array or a device buffer (``device_buffer``), reduced where
        it lies."""
        self._raise_if_failed()
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}; choose from {', '.join(_OPS)}")
        if type(array) is np.ndarray:
            if not (array.flags.c_contiguous and array.flags.writeable):
                raise ValueError(f"{name!r} must be C-contiguous and writeable to be reduced in place")
            r = _Request(name, array, Handle(name, array, self), op, None)
        else:
            view = device_buffer(array)
            src = self.engine.mark_ready(view)  # here, in the submitting thread
            r = _Request(name, src, Handle(name, array, self), op, None, view)
        check_reducible(r.array.dtype, op == "average")
        self._enqueue([r])
        return r.handle

    def _enqueue(self, reqs: list[_Request]) -> None:
        """Make ``reqs`` pending (all or none), and wake an idle coordinator."""
        with self._lock:
            if self._error is not None:  # (failed since the check above: _fail has emptied pending)
                raise seen(self._error)
            if self._shutdown:
                raise TunelabError("the coordinator is shut down")
            for r in reqs:
                if r.name in self._pending:
                    raise ValueError(f"tensor {r.name!r} is already in flight; wait for it first")
            for r in reqs:
                self._pending[r.name] = r
            if self._idle:  # (once: the flag is cleared until the next cycle finds nothing to do)
                self._idle = False
                self.wakes += 1
                self._wake.set()

    def set_knobs(self, knobs: Knobs | None = None, **changes: object) -> Knobs:
        """Ask for new knobs.  Rank 0's request is applied by every rank at the same cycle; requests
        on other ranks are ignored (so every rank may call this with its own view)."""
        with self._lock:  # on top of a request not applied yet (a profile's, say), not only what is applied
            base = knobs or self._requested or self.engine.knobs
            new = base.replace(**changes) if changes else base
            self.engine.check_knobs(new)
            self._requested = new
        return new

    def join(self) -> int:
        """Contribute zeros to every allreduce the other ranks run until all ranks have joined (a rank
        shutting down with nothing in flight counts as joined: it will submit nothing more); returns
        the rank that joined last (the highest such rank when several joined at the same cycle)."""
        with self._lock:
            if self._pending:
                raise TunelabError("join() while collectives of this rank are in flight: synchronize them first")
            self._join_done.clear()
            self._joined = True
        self._wake.set()
        while not self._join_done.wait(0.05):
            if not self._thread.is_alive():
                self._raise_if_failed()
                raise TunelabError("the coordinator stopped during join()")
        return self._join_last

    def _finish_join(self) -> None:
        cycles = self._allgather(self._join_cycle, "the end of join()")
        self._join_last = max(range(self.size), key=lambda r: (cycles[r], r))
        self._joined, self._join_cycle = False, -1
        self._device_zeros.clear()  # (the engine's stream orders their last use before any reuse)
        self._join_done.set()

    def replace_timeline(self, path: str | None) -> None:
        """Start writing a new timeline to ``path`` (None: stop).  The coordinator thread swaps it
        between cycles and closes the old one; returns once that happened."""
        done = threading.Event()
        with self._lock:
            self._timeline_swap = (Timeline.for_rank(path, self.rank), done)
        self._wake.set()
        while not done.wait(0.05):
            if not self._thread.is_alive():
                self._raise_if_failed()
                break

    def _swap_timeline(self) -> None:
        with self._lock:
            swap, self._timeline_swap = self._timeline_swap, None
        if swap is not None:
            old, self.timeline = self.timeline, swap[0]
            if old is not None:
                old.close()
            swap[1].set()

    def shutdown(self) -> None:
        """Finish: returns when every rank has asked to shut down and nothing is pending anywhere."""
        with self._lock:
            self._shutdown = True
        self._wake.set()
        self._thread.join()
        if self.timeline is not None:
            self.timeline.close()
        if self.comm:  # (a null handle once freed: a second shutdown has nothing left to free)
            self.comm.Free()
        if self._error is not None:  # (raised as it is: whoever shut down says whether the job met it)
            raise self._error

    def _waiting(self, change: int) -> None:
        """A thread starts (+1) or stops (-1) waiting on a handle (:meth:`Handle.wait`).  While one waits,
        cycles do not wait for the cycle grid: nothing it waits for comes sooner by waiting, and a peer
        may submit at any moment (the waiter's rank must be in the next negotiation when it does)."""
        with self._lock:
            self._waiters += change
        if change > 0:
            self._hurried = True
            self._wake.set()

    def _hurry(self) -> bool:
        """Whether the next cycle starts at once: a waiter arrived since the last cycle began, or one is
        still blocked (unless every rank has one and the last cycle completed nothing: the tensors they
        wait for are not ready anywhere, and cycling back to back would only spin until the stall
        timeout)."""
        return self._hurried or (self._waiters > 0 and not self._stuck)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise seen(self._error)

    # ---- background ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine.use_kernel_threads()
            while True:
                start = time.monotonic()
                if self._cycle():
                    return
                cycle_s = self.engine.knobs.cycle_time_ms / 1000.0
                with self._lock:
                    # Idle ranks (between backward passes) cycle 10x slower to leave the cores to the
                    # framework; a submit wakes them.  With work in flight the cycle is exact, and a
                    # rank stays on it for a few empty cycles after its last work: during backward the
                    # next gradient comes within a cycle or two, and a hook that must wake the
                    # coordinator pays for it (an Event's condition in Python, and a thread woken to
                    # contend for the GIL), about once per cycle had every empty cycle gone idle.
                    busy = self._had_work or bool(self._pending)
                    self._quiet = 0 if busy else self._quiet + 1
                    self._idle = idle = (self._quiet >= _QUIET_CYCLES and not self._shutdown
                                         and not self._joined)
                sleep_s = cycle_s
                if idle:  # (well inside the time a peer's negotiation waits for this rank)
                    sleep_s = min(cycle_s * _IDLE_FACTOR, max(cycle_s, self.engine.config.timeout_s / 4))
                rest = sleep_s - (time.monotonic() - start)
                if rest > 0 and not self._hurry() and self._wake.wait(rest):
                    self._wake.clear()
                    # Woken early (a submit, a join, shutdown): the next cycle still starts on the cycle
                    # grid, not at once, so what is submitted within the cycle is negotiated and fused
                    # with the tensor that woke it.  (Cycling at once reduced each gradient of a
                    # backward pass alone whenever its framework released the GIL between them.)  Only
                    # a thread waiting on a handle cuts that short (a blocking allreduce, synchronize()
                    # after backward): see _waiting.
                    elapsed = time.monotonic() - start
                    deadline = start + cycle_s * math.ceil(elapsed / cycle_s)
                    while not self._hurry():
                        rest = deadline - time.monotonic()
                        if rest <= 0:
                            break
                        if self._wake.wait(rest):
                            self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 (whatever stops the thread is handed to the caller)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            pending = list(self._pending.values())
            self._pending.clear()
            self.lost = [r.handle for r in pending]  # this rank's own work the failure ended
        for r in pending:
            r.handle._complete(exc)

    def _cycle(self) -> bool:
        self.cycles += 1
        # (before pending is read: a later waiter's or submit's tensor is in this cycle, or wakes the next;
        # before the timeline swap is read, for the same reason)
        self._hurried = False
        self._wake.clear()
        self._swap_timeline()
        with self._lock:
            pending = list(self._pending.values())
            shutdown = self._shutdown
            requested = self._requested
        self._had_work = bool(pending)
        now = time.monotonic()
        flags = 0
        # bit i of the set is tensor id i, for a request that matches what its name was negotiated with
        # (a Python int: numpy scalar updates cost ~1 us each); any other request is negotiated in full
        mask, fresh = 0, False
        for r in pending:
            i = self._ids.get(r.name)
            if i is not None and self._metas[i] == r.meta:
                mask |= 1 << i
            else:
                fresh = True
        if not fresh:
            flags |= _NO_NEW_NAMES
        if shutdown and not pending:
            flags |= _SHUTDOWN
        waited = now - min((r.since for r in pending), default=now)  # by the oldest request
        if waited <= self.stall_timeout_s:
            flags |= _NO_STALL
        warn_s = self.engine.config.stall_warning_s
        if waited <= warn_s or warn_s >= self.stall_timeout_s or self._warned or \
                all(r.warned or now - r.since <= warn_s for r in pending):
            flags |= _NO_STALL_WARNING
        if not pending:
            flags |= _NOTHING_PENDING
        leaving = shutdown and not pending and not self._joined
        if not leaving:
            flags |= _NONE_LEAVING
        if self.rank != 0 or requested is None or requested == self.engine.knobs:
            flags |= _NO_KNOB_CHANGE
        if self._waiters > 0:
            flags |= _ALL_WAITING
        joined = self._joined
        if joined and self._join_cycle < 0:
            self._join_cycle = self.cycles
        # A rank shutting down with nothing pending has finished as a joined rank has: a join waits for
        # it no more (it will never join: without this both would wait for each other for ever)
        if joined or (shutdown and not pending):
            flags |= _ALL_JOINED
        if not joined:
            flags |= _NOT_JOINED
        # The exchange: 1 + nwords little-endian 64-bit words (the flags, then one bit per name),
        # AND-reduced.  Built and read as one Python int: numpy's small-array calls cost more than the
        # words themselves, and this runs every cycle while the framework wants the GIL.
        nwords = (len(self._names) + 63) // 64
        if joined:  # ready for anything: the others' bits decide
            mask = (1 << (64 * nwords)) - 1
        words = bytearray(((mask << 64) | flags).to_bytes(8 * (1 + nwords), "little"))
        agreed = bytearray(len(words))
        req = self.comm.Iallreduce([words, self._word], [agreed, self._word], op=self._band)
        wait_or_timeout(req, self.engine.config.timeout_s, f"negotiation cycle {self.cycles}", self.rank)
        both = int.from_bytes(agreed, "little")
        flags = both & 0xFFFF_FFFF_FFFF_FFFF
        if flags & _ALL_JOINED and not flags & _NOT_JOINED:  # (a rank joined, and every other one too or done)
            self._finish_join()
            return False
        if not flags & _NO_KNOB_CHANGE:
            self._apply_knobs(self._bcast(requested if self.rank == 0 else None, "the knob change"))
        if not flags & _NONE_LEAVING and not self.left:  # (the first cycle a rank leaves in, alike everywhere)
            everyone = self._allgather(leaving, "the ranks leaving")
            self.left = tuple(rank for rank, left in enumerate(everyone) if left)
        if not flags & (_NONE_LEAVING | _NOTHING_PENDING):
            # A rank left while calls are pending: they can never complete.  (Every rank sees the same
            # bits: every rank ends here.  A rank that left while nothing is pending anywhere, one that
            # finished first at the job's end, waits for the others' shutdown as before.)
            return self._end_for_leavers(pending, leaving)
        if not flags & _NO_STALL:
            self._report_stall(pending, now)
        if not flags & _NO_STALL_WARNING:
            self._report_stall(pending, now, warn_s)
        bits = (both >> 64) & ((1 << len(self._names)) - 1)
        ready = []  # the set bits, lowest first
        while bits:
            low = bits & -bits
            ready.append(low.bit_length() - 1)
            bits ^= low
        if not flags & _NO_NEW_NAMES:
            ready += self._negotiate_new_names(pending, joined)
            self._deliver_rejected()
        ready = self._whole_groups(ready)
        self._stuck = bool(flags & _ALL_WAITING) and not ready
        if ready:
            self._warned = False  # (a stall ended: the next one is warned of again)
            self._execute(ready)
            for i in ready:
                self._used[i] = self.cycles
                self._hits[i] += 1
            if len(self._names) > self.cache_capacity:
                self._forget_names()
        return bool(flags & _SHUTDOWN)

    def _forget_names(self) -> None:
        """Keep the cache bounded (every name costs a bit in every cycle's negotiation; unnamed calls
        and per-call names add one each).  Names reduced more than once and again since the last time
        names were forgotten (a model's gradients) stay; the rest, least recently reduced first (calls
        made once), go until half the capacity is left, and the rest keep their place, renumbered in id
        order.  When the names in use fill half the capacity, the capacity doubles instead: a
        large model's gradients are never negotiated again every step.  Every rank holds the same names,
        ids, uses and cycles, so every rank forgets the same names at the same cycle; a request for a
        forgotten name is negotiated in full again, like a new one."""
        half = max(1, self.cache_capacity // 2)
        live = [i for i in range(len(self._names)) if self._hits[i] > 1 and self._used[i] >= self._last_forget]
        self._last_forget = self.cycles
        if len(live) >= half:  # (a working set larger than half forgets part of itself, which fills it again)
            self.cache_capacity *= 2
            return
        keep = set(live)
        for i in sorted(range(len(self._names)), key=lambda i: self._used[i], reverse=True):
            if len(keep) >= half:
                break
            keep.add(i)
        order = sorted(keep)
        self._names = [self._names[i] for i in order]
        self._metas = [self._metas[i] for i in order]
        self._used = [self._used[i] for i in order]
        self._hits = [self._hits[i] for i in order]
        self._ids = {name: i for i, name in enumerate(self._names)}
        self._drop_device_zeros()

    def _drop_device_zeros(self, i: int | None = None) -> None:
        """Forget a joined rank's device zeros (all, or tensor ``i``'s) once the engine's stream is done
        with them: they came from a memory pool that may hand their blocks to the next allocation."""
        if not self._device_zeros or (i is not None and i not in self._device_zeros):
            return
        device = self.engine._device
        if device is not None:
            device.synchronize()
        if i is None:
            self._device_zeros.clear()
        else:
            del self._device_zeros[i]

    # Every exchange after a cycle's first is waited for with the engine's timeout too: a peer whose
    # coordinator failed between two of them (applying knobs, say) would otherwise block this one for ever.
    def _allgather(self, obj: object, what: str) -> list:
        return allgather_object(self.comm, obj, self.engine.config.timeout_s, f"{what} (cycle {self.cycles})", self.rank)

    def _bcast(self, obj: object, what: str) -> object:
        return bcast_object(self.comm, obj, 0, self.engine.config.timeout_s, f"{what} (cycle {self.cycles})", self.rank)

    def _apply_knobs(self, knobs: Knobs) -> None:
        self.engine.set_knobs(knobs)
        with self._lock:  # applied: later requests build on the engine's knobs (unless asked for since)
            if self._requested == knobs or self.rank != 0:
                self._requested = None
        self.knob_changes.append((self.cycles, knobs))
        timeline = self.timeline
        if timeline is not None:
            timeline.instant("knobs", "knobs", cycle=self.cycles, **knobs.as_dict())

    def _negotiate_new_names(self, pending: list[_Request], joined: bool) -> list[int]:
        """Names not negotiated before, and negotiated names submitted with other metadata than they
        were negotiated with (a tensor whose shape changed between steps): those every active rank
        submitted alike are ready (their metadata updated), those they disagree on are rejected."""
        mine = [(r.name, r.meta) for r in pending
                if r.name not in self._ids or self._metas[self._ids[r.name]] != r.meta]
        everyone = self._allgather((joined, mine), "the exchange of new names")  # (joined: what its bits said)
        active = [r for r, (joined, _) in enumerate(everyone) if not joined]  # joined ranks follow the rest
        tables = [dict(everyone[r][1]) for r in active]
        new: list[int] = []
        for name, meta in everyone[active[0]][1]:  # the first active rank's order decides new names' order
            if not all(name in t for t in tables[1:]):
                continue
            metas = [t[name] for t in tables]
            if any(m != meta for m in metas):
                # Every rank sees the same tables, so every rank rejects this call alike; only its
                # handles get the error and the coordinator goes on serving the next cycle.
                self._rejected[name] = RankMismatchError(f"ranks disagree on tensor {name!r}: " + "; ".join(
                    f"rank {r}: {'cuda ' if m[4] else ''}{m[0]}{list(m[1])} op={m[2]} group={m[3]}" for r, m in zip(active, metas)))
                continue
            i = self._ids.get(name)
            if i is None:
                i = self._ids[name] = len(self._names)
                self._names.append(name)
                self._metas.append(meta)
                self._used.append(self.cycles)
                self._hits.append(0)
            else:
                self._metas[i] = meta
                self._drop_device_zeros(i)
            new.append(i)
        # A negotiated name that some rank submitted with other metadata and that is not settled here
        # (the others had it ready under the old metadata, or have not submitted it yet): its metadata
        # is forgotten on every rank alike, so each rank's request for it is negotiated in full, and
        # compared, from the next cycle on.  (Without this, ranks whose request matched the old
        # metadata would wait on its bit for ever, or reduce it against the changed one.)
        settled = set(new)
        for table in tables:
            for name in table:
                i = self._ids.get(name)
                if i is not None and i not in settled:
                    self._metas[i] = None
        return new

    def _whole_groups(self, ready: list[int]) -> list[int]:
        """``ready`` less the members of any group not all of whose members are ready in this cycle (a
        member whose shape changed on some ranks only is negotiated again next cycle, and rejected there
        with the rest of its group): a group is reduced together or not at all.  Every rank holds the same
        ids and metadata, so every rank holds back the same ones."""
        sizes: dict[str, int] = {}
        for i in ready:
            group = self._metas[i][3]
            if group is not None:
                sizes[group] = sizes.get(group, 0) + 1
        short = {g for g, n in sizes.items() if n < _group_size(g)}
        return [i for i in ready if self._metas[i][3] not in short] if short else ready

    def _deliver_rejected(self) -> None:
        """Complete the rejected calls' handles with their error and forget the calls."""
        with self._lock:
            reqs = [self._pending.pop(name) for name in self._rejected if name in self._pending]
            errors, self._rejected = self._rejected, {}
            # the rest of a group one of whose tensors was rejected here: reduced together or not at all
            # (a member only some ranks hold would otherwise wait for the others until the stall timeout)
            failed = {r.group: errors[r.name] for r in reqs if r.group is not None}
            for name in [n for n, r in self._pending.items() if r.group in failed]:
                r = self._pending.pop(name)
                errors[name] = RankMismatchError(f"{failed[r.group]}; so tensor {name!r} of its group is not "
                                                 "reduced either")
                reqs.append(r)
        for r in reqs:
            r.handle._complete(errors[r.name])

    def _end_for_leavers(self, pending: list[_Request], leaving: bool) -> bool:
        """Some rank left (``self.left``) while calls are pending somewhere: none of them can complete, and
        no later call can either.  Every rank is here at the same cycle: a rank that left finishes
        its shutdown (True); every other one fails for good (RankExitedError, naming who left and what
        of its own waited), as a stall does, so its job hears of it at its next wait or submit."""
        if leaving:
            return True
        gone = self.left
        who, them = (f"ranks {', '.join(map(str, gone))}", "them") if len(gone) > 1 else (f"rank {gone[0]}", "it")
        names = sorted(r.name for r in pending)
        waited = (f"tensor {names[0]!r}{f' and {len(names) - 1} more' if len(names) > 1 else ''} waited for {them} "
                  "here" if names else f"other ranks' collectives waited for {them}")
        raise RankExitedError(f"{who} shut down (a script that ended or raised) while {waited}; a rank that has "
                              "shut down takes part in no later collective (for ranks with uneven data, use join())")

    def _report_stall(self, pending: list[_Request], now: float, warn_s: float | None = None) -> None:
        """StallError naming what some ranks submitted and others did not; with ``warn_s``, rank 0 says
        it in one line instead (once a stall: until something is reduced again) and the wait goes on."""
        everyone = self._allgather(sorted(r.name for r in pending), "the stall report")
        # by the ranks that submitted them: one line names the first tensor of each such set (those that
        # fewest ranks submitted first), so that a model one rank holds more of than the others shows
        # both what is missing there and what only that rank has
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for name in sorted(set().union(*map(set, everyone))):
            have = tuple(rank for rank, names in enumerate(everyone) if name in names)
            if len(have) < self.size:
                by_ranks.setdefault(have, []).append(name)
        problems = []
        for have, names in sorted(by_ranks.items(), key=lambda item: (len(item[0]), item[0])):
            missing = [rank for rank in range(self.size) if rank not in have]
            more = f" and {len(names) - 1} more like it" if len(names) > 1 else ""
            problems.append(f"tensor {names[0]!r} (submitted by ranks {list(have)}, missing on ranks {missing}){more}")
        if warn_s is not None:  # one line for the stall: what a rank submits while it lasts is not said again
            for r in pending:
                r.warned = True
            self._warned = True
            if problems and self.rank == 0:
                say_still_waiting("", "every rank to submit " + "; ".join(problems), self.stall_timeout_s)
            return
        if problems:
            raise StallError(f"stalled for more than {self.stall_timeout_s:g} s: {'; '.join(problems)}")

    def _zeros(self, i: int) -> _Request:
        """A joined rank's contribution to tensor ``i``: zeros of its dtype and shape, in device memory
        where the others' tensor is a device tensor (it takes the device path on every rank), else on
        the host."""
        from ..dtypes import dtype_from_name

        dtype, shape, op, group, on_device = self._metas[i]
        if on_device:
            # made once per tensor while this rank is joined, not every cycle: the zeros are only read,
            # and the output is written by calls that run one after another on the engine's stream
            want = dtype_from_name(dtype)
            found = self._device_zeros.get(i)
            if found is None:
                src = device_buffer(self.engine.device_zeros(tuple(shape), want))
                found = self._device_zeros[i] = (src, empty_like(src))
            src, out = found
            view = device_buffer(out)
            if src.dtype != want:  # bfloat16 zeros are held as uint16 (:func:`.device.zeros`): the same bits
                src, view = dataclasses.replace(src, dtype=want), dataclasses.replace(view, dtype=want)
            return _Request(self._names[i], src, Handle(self._names[i], out), op, group, view)
        zeros = np.zeros(shape, dtype_from_name(dtype))
        return _Request(self._names[i], zeros, Handle(self._names[i], np.empty_like(zeros)), op, group)

    def _execute(self, ids: list[int]) -> None:
        with self._lock:
            reqs = [self._pending.get(self._names[i]) or self._zeros(i) for i in ids]
        # made safe across the whole cycle, not one op's call at a time: a call of one op would otherwise
        # write memory that a later op's submit reads
        all_arrays, all_outs, copy_back = _unaliased(
            [r.array for r in reqs], [r.handle.out if r.out_view is None else r.out_view for r in reqs],
            [i for i, r in enumerate(reqs) if r.out_view is None])
        for op in dict.fromkeys(r.op for r in reqs):
            batch = [i for i, r in enumerate(reqs) if r.op == op]
            group_ids: dict[str, int] = {}
            groups = [None if reqs[i].group is None else group_ids.setdefault(reqs[i].group, len(group_ids))
                      for i in batch]
            arrays = [all_arrays[i] for i in batch]
            outs = [all_outs[i] for i in batch]
            timeline = self.timeline  # read once: start/stop_timeline may swap it from another thread
            if timeline is None:
                self.engine.allreduce_batch(arrays, op, outs, groups, verify=False)
            else:
                with timeline.span("allreduce", "allreduce", op=op, tensors=len(batch),
                                        bytes=int(sum(a.nbytes for a in arrays)), cycle=self.cycles):
                    self.engine.allreduce_batch(arrays, op, outs, groups, verify=False)
        for private, out in copy_back:
            np.copyto(out, private)
        with self._lock:
            for r in reqs:
                if self._pending.get(r.name) is r:  # (not a submit of the same name since: a joined rank's)
                    del self._pending[r.name]
        for r in reqs:
            r.handle._complete()


def _group_size(label: str) -> int:
    """The member count in a group's label, as :meth:`Coordinator.submit_group` writes it."""
    return int(label[label.rindex("(") + 1:].split()[0])


def _unaliased(arrays: list[Any], outs: list[Any], host: list[int]) -> tuple[list[Any], list[Any], list[tuple]]:
    """A fused call's host tensors (indices ``host``) made safe to reduce together: separate submits may
    share memory (a tensor submitted in place and again out of place, or in place twice, in one cycle),
    which one engine call would read after writing it.  Where they do, every host input is read from a
    snapshot taken now (as a fusion buffer would: each submit reduces what its tensor held when the cycle
    began), and outputs that overlap an earlier one are written to memory of their own and copied to
    theirs after the call, in submit order.  Each rank decides alone: the call itself is the same on
    every rank.  Returns the call's inputs and outputs, and the (private, output) pairs to copy back."""
    if len(host) < 2:
        return arrays, outs, []
    try:
        refuse_overlaps([arrays[i] for i in host], [outs[i] for i in host])
        return arrays, outs, []
    except ValueError:
        pass
    arrays, outs, copy_back = list(arrays), list(outs), []
    for i in host:
        arrays[i] = arrays[i].copy()
    reach = -1  # the furthest end of the outputs so far, in address order
    for start, end, i in sorted((*memory_span(outs[i]), i) for i in host if outs[i].size):
        if start < reach:  # (the outputs left in place are then disjoint)
            copy_back.append((i, np.empty_like(outs[i]), outs[i]))
            outs[i] = copy_back[-1][1]
        reach = max(reach, end)
    return arrays, outs, [(private, out) for _, private, out in sorted(copy_back, key=lambda c: c[0])]
