"""The per-process state behind the framework adapters' Horovod-shaped API.

``tunelab.torch.init()`` (or ``tunelab.tensorflow.init()``) creates one Runtime: the
engine, its background coordinator, and a separate communicator for synchronous
collectives (broadcast, allgather) issued from the caller's thread.  Module-level
functions of the adapters act on the current runtime; there is at most one.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import ENV_PROFILE, EngineConfig, load_engine_config
from .errors import CollectiveTimeoutError, RankExitedError, RankMismatchError, TunelabError, UsageError

if TYPE_CHECKING:
    from mpi4py import MPI

    from .engine.coordinator import Coordinator
    from .engine.engine import Engine
    from .hardware import Fingerprint
    from .profiles import ProfileKey

_current: Runtime | None = None


class Runtime:
    def __init__(self, comm: MPI.Comm | None = None, config: EngineConfig | None = None) -> None:
        from mpi4py import MPI

        from .engine.coordinator import Coordinator
        from .engine.engine import Engine

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise TunelabError("tunelab's background coordinator needs MPI_THREAD_MULTIPLE, which this MPI "
                               "library did not grant (import tunelab before initialising MPI yourself, or "
                               "use an MPI built with thread support)")
        self.config = config or load_engine_config()
        self.engine: Engine = Engine(comm or MPI.COMM_WORLD, self.config)
        try:
            self.coordinator: Coordinator = Coordinator(self.engine, self.config.timeline)
        except TunelabError as exc:
            if not isinstance(exc, CollectiveTimeoutError):  # (a rank missing would leave the close waiting)
                self.engine.close()  # every rank fails here alike: the coordinator's setup agreed on its outcome
            raise
        self.sync_comm = self.engine.topology.world.Dup()
        self._exit_comm = self.engine.topology.world.Dup()  # one exchange, at shutdown (_all_freeing)
        self._names = itertools.count()
        self._profiles_loaded: dict[tuple[str, str], str] = {}
        self._knobs_from = ""  # the model / framework whose profile set the job's knobs (rank 0's words)
        self._chosen_done = False  # the profile setting (TUNELAB_PROFILE) was acted on: off said, or an id loaded
        self._watch: Any = None  # rank 0, with the retune setting, once a profile was loaded
        self._shut_down = False
        self._sync_failed = ""  # the collective a timeout ended: the ranks' exchanges no longer line up after it
        self._fingerprints: dict[str | None, Fingerprint] = {}  # by framework (:meth:`fingerprint`)

    @property
    def topology(self):
        return self.engine.topology

    def auto_name(self, kind: str) -> str:
        """Names for unnamed tensors: the same sequence on every rank that makes the same calls."""
        return f"{kind}.noname.{next(self._names)}"

    # ---- synchronous collectives on the caller's thread ----------------------------------------
    # Each exchange is waited for with the engine's timeout: a rank that skipped the call, stalled or
    # died makes the others raise CollectiveTimeoutError naming the call, instead of blocking for ever.
    # Each call's first exchange is an allgather (:meth:`_allgather`) that carries the call's kind and
    # name on this rank: ranks in differently named calls (one skipped a broadcast, say, and went on to
    # the next) fail both calls on every rank, rather than pairing one rank's call with the other's next
    # one (its data, silently).  Calls of one kind and name cannot be told apart so (a count kept on each
    # rank pairs the k-th call with the k-th whatever was skipped).  After a timeout the ranks' exchanges
    # no longer line up (the timed-out one is still posted), so this rank refuses later calls in one
    # line; its peers then time out in theirs.
    def _sync_usable(self) -> None:
        if self._sync_failed:
            raise TunelabError(f"tunelab's collectives stopped after {self._sync_failed}: the ranks' "
                               "exchanges no longer line up (shutdown() ends the job)")

    @contextlib.contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Around an exchange of ``what``: a timeout in it, or a peer that left the job during it, stops
        this rank's later calls (:meth:`_sync_usable`)."""
        try:
            yield
        except (CollectiveTimeoutError, RankExitedError) as exc:
            left = isinstance(exc, RankExitedError)
            self._sync_failed = self._sync_failed or (f"a rank left during {what}" if left else f"a timeout in {what}")
            raise

    def _wait(self, req: Any, what: str) -> None:
        from .engine.consensus import wait_or_timeout

        with self._timed(what):
            wait_or_timeout(req, self.config.timeout_s, what, self.sync_comm.rank, gone=self._gone)

    def _allgather(self, obj: object, what: str) -> list:
        from .engine.consensus import allgather_object

        self._sync_usable()
        with self._timed(what):
            everyone = allgather_object(self.sync_comm, (what, obj), self.config.timeout_s, what, self.sync_comm.rank,
                                        gone=self._gone)
        calls = [w for w, _ in everyone]
        if any(w != calls[0] for w in calls[1:]):
            raise RankMismatchError("ranks are in different collectives: " + "; ".join(
                f"rank {r}: {w}" for r, w in enumerate(calls)))
        return [o for _, o in everyone]

    def _bcast(self, obj: object, root: int, what: str, extra_s: float = 0.0) -> object:
        from .engine.consensus import bcast_object

        self._sync_usable()
        with self._timed(what):
            return bcast_object(self.sync_comm, obj, root, self.config.timeout_s + extra_s, what,
                                self.sync_comm.rank, gone=self._gone)

    def _gone(self) -> tuple[int, ...]:
        """The ranks the coordinator saw leave the job (shut down): a peer's wait for them ends."""
        return self.coordinator.left

    def _lookup_done(self, obj: object) -> object:
        """Rank 0's profile lookup, broadcast: the others wait as long as the store may keep rank 0
        waiting for its lock too, on top of the timeout."""
        from .profiles import BUSY_TIMEOUT_S

        return self._bcast(obj, 0, "the profile lookup", BUSY_TIMEOUT_S)

    def check_same(self, value: object, what: str) -> None:
        """RankMismatchError on every rank unless ``value`` (picklable) is equal on all ranks."""
        values = self._allgather(value, what)
        if any(v != values[0] for v in values[1:]):
            detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise RankMismatchError(f"ranks disagree on {what}: {detail}")

    def broadcast_(self, array: np.ndarray, root: int, what: str) -> None:
        """In-place broadcast of a C-contiguous array from ``root``.  Ranks first agree on the root,
        dtype and shape (one allgather), so a disagreement raises on every rank instead of hanging."""
        metas = self._allgather((root, array.dtype.name, tuple(array.shape)), f"broadcast {what}")
        self._check_roots([m[0] for m in metas], f"broadcast {what}")
        if any(m != metas[root] for m in metas):
            raise RankMismatchError(f"ranks disagree on broadcast {what}: " + "; ".join(
                f"rank {r}: {m[1]}{list(m[2])}" for r, m in enumerate(metas)))
        from mpi4py import MPI

        self._wait(self.sync_comm.Ibcast([array.reshape(-1).view(np.uint8), MPI.BYTE], root=root), f"broadcast {what}")

    def broadcast_object(self, obj: object, root: int, name: str | None = None) -> object:
        """``root``'s ``obj`` (picklable) on every rank; ``name``, where given, is part of what the ranks
        agree on (as a tensor's is)."""
        what = f"broadcast_object {name}" if name else "broadcast_object"
        self._check_roots(self._allgather(root, what), what)
        return self._bcast(obj, root, what)

    def allgather_object(self, obj: object, name: str | None = None) -> list:
        """Every rank's ``obj`` (picklable), in rank order (``name`` as for :meth:`broadcast_object`)."""
        return self._allgather(obj, f"allgather_object {name}" if name else "allgather_object")

    def barrier(self) -> None:
        self._allgather(None, "barrier")  # (an allgather: what the call is travels with it)

    def alltoall(self, array: np.ndarray, splits: list[int] | None, what: str) -> tuple[np.ndarray, list[int]]:
        """Send ``splits[i]`` rows of ``array`` (dim 0, in order) to rank i (``None``: equal parts, the
        first dimension divisible by the ranks); returns the rows received, in rank order, and how many
        came from each rank.  A bad plan on any rank raises ValueError on every rank."""
        from mpi4py import MPI

        n = self.sync_comm.size
        rows = array.shape[0] if array.ndim else 1
        me = self.sync_comm.rank
        if splits is None:
            bad = f"{rows} rows on rank {me}, not divisible by {n} (no splits: equal parts)" if rows % n else ""
            splits = [rows // n] * n
        elif len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
            bad = (f"splits {list(splits)} for {rows} rows on rank {me} (they must be {n} non-negative counts "
                   "summing to the first dimension)")
        else:
            bad = ""
        # Every rank learns of a bad call (so none is left waiting in the exchange below).
        metas = self._allgather((array.dtype.name, tuple(array.shape[1:]), bad), f"alltoall of {what}")
        culprits = [r for r, m in enumerate(metas) if m[2]]
        if culprits:
            raise ValueError(f"alltoall of {what}: wrong on ranks {culprits}: "
                             + "; ".join(metas[r][2] for r in culprits))
        if any(m[:2] != metas[0][:2] for m in metas):
            raise RankMismatchError(f"alltoall of {what} needs the same dtype and trailing shape: " + "; ".join(
                f"rank {r}: {m[0]}[*, {', '.join(map(str, m[1]))}]" for r, m in enumerate(metas)))
        counts = np.array(splits, dtype=np.int64)
        got = np.empty(n, dtype=np.int64)
        self._wait(self.sync_comm.Ialltoall(counts, got), f"alltoall of {what}")
        received = [int(x) for x in got]
        src = np.ascontiguousarray(array).reshape(rows, *array.shape[1:])
        row_bytes = int(np.prod(src.shape[1:], dtype=np.int64)) * src.itemsize
        out = np.empty((sum(received), *src.shape[1:]), dtype=src.dtype)
        send = [s * row_bytes for s in splits]
        recv = [s * row_bytes for s in received]
        self._wait(self.sync_comm.Ialltoallv([src.reshape(-1).view(np.uint8), (send, _displs(send)), MPI.BYTE],
                                             [out.reshape(-1).view(np.uint8), (recv, _displs(recv)), MPI.BYTE]),
                   f"alltoall of {what}")
        return out, received

    def start_timeline(self, path: str) -> None:
        """Write a Chrome trace of the coordinator's work to ``path`` from now on (``{rank}`` in the path
        gives one file per rank; otherwise rank 0 writes it)."""
        self.coordinator.replace_timeline(path)

    def stop_timeline(self) -> None:
        self.coordinator.replace_timeline(None)

    def allgather(self, array: np.ndarray, what: str) -> np.ndarray:
        """Concatenate every rank's array along axis 0 (first dims may differ)."""
        return self.allgatherv(array, what)[0]

    def allgatherv(self, array: np.ndarray, what: str) -> tuple[np.ndarray, list[int]]:
        """:meth:`allgather`, and how many rows came from each rank."""
        from mpi4py import MPI

        metas = self._allgather((array.dtype.name, array.shape[1:], array.shape[0] if array.ndim else 1),
                                f"allgather of {what}")
        if len({m[:2] for m in metas}) > 1:
            detail = "; ".join(f"rank {r}: {m[0]}[*, {', '.join(map(str, m[1]))}]" for r, m in enumerate(metas))
            raise RankMismatchError(f"allgather of {what} needs the same dtype and trailing shape: {detail}")
        src = np.ascontiguousarray(array).reshape(-1, *array.shape[1:]) if array.ndim else array.reshape(1)
        rows = [m[2] for m in metas]
        row_bytes = src[:1].nbytes if src.shape[0] else int(np.prod(src.shape[1:], dtype=np.int64)) * src.itemsize
        out = np.empty((sum(rows), *src.shape[1:]), dtype=src.dtype)
        counts = [r * row_bytes for r in rows]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        self._wait(self.sync_comm.Iallgatherv([src.reshape(-1).view(np.uint8), MPI.BYTE],
                                              [out.reshape(-1).view(np.uint8), (counts, displs), MPI.BYTE]),
                   f"allgather of {what}")
        return out, rows

    def load_profile(self, signature: str, framework: str, model_name: str = "", legacy: str | None = None) -> str:
        """Apply the best stored knobs for this hardware, model signature, framework and world size
        (collective).  Knobs the user set explicitly or through ``TUNELAB_*`` stay as they are.
        Returns the one-line log (printed by rank 0).  A model already looked up is not looked up again
        (every rank skips alike: they make the same calls), so wrapping a tape every step costs nothing.
        ``legacy``: the model's signature as an earlier tunelab computed it, looked up when nothing is
        stored under ``signature`` (a profile tuned before the signature changed still loads).

        The profile setting (``TUNELAB_PROFILE``) chooses: "auto" as above; "off", no lookup (said once);
        a profile id, that profile, once a job, whatever its key (refused on every rank where its world
        size is not the job's, warned where its model, framework or hardware are not the job's)."""
        if (signature, framework) in self._profiles_loaded:
            return self._profiles_loaded[(signature, framework)]
        choice = self.config.profile
        if choice != "auto" and self._chosen_done:  # (said, or loaded, for an earlier model of the job)
            self._profiles_loaded[(signature, framework)] = ""
            return ""
        if choice == "off":
            line = (f"tunelab: {ENV_PROFILE}=off: no tuned profile is looked up; training with the knobs as given"
                    if self.sync_comm.rank == 0 else "")
            if line:
                print(line, flush=True)
            self._chosen_done = True
            self._profiles_loaded[(signature, framework)] = line
            return line
        if choice == "auto":
            look = lambda: self._lookup_profile(signature, framework, model_name, legacy)
        else:
            look = lambda: self._chosen_profile(int(choice), signature, framework, model_name, legacy)
        line, knobs, stored_as = self._on_rank0(look)
        self._chosen_done = choice != "auto"
        line = line if self.sync_comm.rank == 0 else ""  # (rank 0 speaks for the job)
        if knobs:
            self.coordinator.set_knobs(self.engine.knobs.replace(**knobs))
            self._knobs_from = f"{model_name or signature} / {framework}"
        if self.sync_comm.rank == 0 and line:
            print(line, flush=True)
        if knobs and self.sync_comm.rank == 0 and self._watch is not None:
            # the knobs are the job's, not a model's: the watched configuration is gone
            self._watch = None
            print(f"tunelab: retune off: {model_name or signature}'s profile changed the knobs of the profile "
                  "being watched (a job watches one model's profile)", flush=True)
        elif knobs and self.config.retune and self.sync_comm.rank == 0 and self._watch is None:
            if stored_as is None:  # (a profile chosen by id, stored under another key: not this job's to retune)
                print(f"tunelab: retune off: the profile {ENV_PROFILE} chose is stored under another model's or "
                      "hardware's key; a job retunes only its own", flush=True)
            else:
                self._watch = self._watch_profile(self.engine.knobs.replace(**knobs), signature, framework, stored_as)
        self._profiles_loaded[(signature, framework)] = line
        return line

    @property
    def watching(self) -> bool:
        """Whether a loaded profile is being watched (the retune setting): adapters then report steps."""
        return self._watch is not None

    def step_done(self, signature: str, framework: str) -> None:
        """A training step of the model ``signature`` finished (the framework adapters call it every
        step): with the retune setting, the watch of that model's loaded profile
        (:mod:`tunelab.tuning.watch`) times it; another model's steps, or none watched: nothing.  An
        error inside the watch is said once and ends the watch; training goes on."""
        watch = self._watch
        if watch is None or watch.key != (signature, framework):
            return
        try:
            watch.step_done()
        except Exception as exc:  # noqa: BLE001 - the watch must never stop the training it watches
            self._watch = None
            print(f"tunelab: warning: retune off after an error in the watch ({type(exc).__name__}: {exc}); "
                  "training goes on with its last lock", flush=True)

    def _watch_profile(self, loaded: Any, signature: str, framework: str, stored_as: ProfileKey) -> Any:
        """The watch of a loaded profile (rank 0), or None where it cannot start (a store that cannot be
        read again, a damaged trial): said in one line, and the job trains on without it.  ``stored_as``:
        the key the profile is stored under (an older one of the same job, where it was found so)."""
        from .profiles import ProfileStore
        from .tuning.plan import Plan
        from .tuning.result import RETUNE_RUN_PREFIX, samples_per_step, stored_observations
        from .tuning.space import search_space
        from .tuning.watch import ProfileWatch, StoreWriter, stored_claim

        pinned = {k: getattr(self.engine.knobs, k) for k in self.config.pinned}
        # a GPU model's profile (its signature says so) was tuned over the device path's knobs too: a
        # search re-opened here searches them as well, rather than putting them back to their defaults
        space = search_space(pinned, self.topology.num_nodes, base=self.config.knobs,
                             device=signature.startswith("cuda-"), uniform_nodes=self.topology.homogeneous)
        try:
            store = ProfileStore(create=False)
            best = store.best(stored_as)
            trials = store.trials(best.profile_id) if best else []
            # (only runs measured against this job's default: a re-opened search's ratios are to it)
            stored = stored_observations(trials, Plan().warm_start_noise, space.base, space.names)
        except Exception as exc:  # noqa: BLE001 - the job itself must not stop for it (on rank 0 alone)
            print(f"tunelab: warning: retune off: the profile's trials could not be read ({exc})", flush=True)
            return None
        # rank 0 writes on the training's thread: a store locked by another process must not hold it for
        # as long as the others' gradients may wait for it (the stall timeout: every rank would fail),
        # nor long enough to be warned of as a stall; a write that waits longer is given up (the writer
        # says so, and training goes on)
        store.busy_timeout_s = min(store.busy_timeout_s, self.config.timeout_s / 4, self.config.stall_warning_s / 4)
        writer = StoreWriter(store, best.profile_id, f"{RETUNE_RUN_PREFIX}{uuid.uuid4().hex[:8]}") if best else None
        # the store keeps samples/s; a step's samples are read from the profile's own trials
        per_step = samples_per_step(trials)
        unit = (f"{per_step:g} samples a step, as the profile's trials were measured" if per_step is not None
                else "its scores stored as steps/s: the profile's trials do not tell a step's samples")
        print(f"tunelab: retune on: watching the loaded configuration's step time ({unit})", flush=True)
        claimed = stored_claim(best, trials, loaded, space.base)
        return ProfileWatch(self.coordinator, space, loaded, stored, writer=writer, key=(signature, framework),
                            interval=claimed, samples_per_step=per_step or 1.0)

    def fingerprint(self, framework: str | None = None) -> Fingerprint:
        """This job's hardware fingerprint: the host, the node layout and any emulated or lab link;
        ``framework``: the job's, the only one whose version the hash takes (None: every installed one's).
        Taken once a runtime and framework (on a GPU host it runs ``nvidia-smi``): none of it changes
        while the runtime lives."""
        if framework not in self._fingerprints:
            self._fingerprints[framework] = self._take_fingerprint(framework)
        return self._fingerprints[framework]

    def _take_fingerprint(self, framework: str | None) -> Fingerprint:
        from .engine.link import describe_link
        from .hardware import fingerprint

        topo, cfg = self.topology, self.config
        from .lab.launch import current_lab

        link = describe_link(cfg.link_gbps, cfg.link_latency_us) if self.engine.link is not None else None
        lab = current_lab()
        lab_link = f"{lab.spec.link_gbps:g} Gb/s tc-shaped TCP" if lab is not None else None
        return fingerprint(topo.num_nodes, list(topo.node_sizes), emulated_link=link, lab_link=lab_link,
                           usable_cores=topo.host_cores, framework=framework)

    def profile_key(self, signature: str, framework: str) -> ProfileKey:
        """The store key of this job: hardware fingerprint (with the node layout), model, framework, size."""
        return self.profile_keys(signature, framework)[0]

    def profile_keys(self, signature: str, framework: str, legacy: str | None = None) -> list[ProfileKey]:
        """The keys this job's profile may be stored under, in the order they are looked up: today's
        first, then under the model's earlier signature (``legacy``), each under today's hardware hash
        and then under the hash of before 2026-11-29 (:attr:`~tunelab.hardware.Fingerprint.legacy_hash`:
        every installed framework's full version and the GPU driver counted).  A profile found under an
        older key loads, and moves to today's at its model's next ``tune``."""
        from .profiles import ProfileKey

        fp = self.fingerprint(framework)
        return list(dict.fromkeys(ProfileKey(h, s, framework, self.topology.size)
                                  for h in (fp.hash, fp.legacy_hash or fp.hash)
                                  for s in (signature, legacy or signature)))

    def has_profile(self, signature: str, framework: str, legacy: str | None = None) -> bool:
        """Whether a tuned config is stored for this job (collective; rank 0 reads the store); ``legacy``
        as for :meth:`load_profile`.  With the profile setting off: False; with a profile id: whether
        that profile has one (what :meth:`load_profile` would load)."""
        choice = self.config.profile
        if choice == "off":
            return False

        def look() -> bool:
            from .profiles import ProfileStore

            store = ProfileStore(create=False)
            if choice != "auto":
                return store.best_of(int(choice)) is not None
            return any(store.best(key) is not None for key in self.profile_keys(signature, framework, legacy))

        return self._on_rank0(look)

    def _on_rank0(self, look: Any) -> Any:
        """``look()`` on rank 0, its result broadcast (collective); what it raises there is raised on every
        rank (the others would wait on the broadcast until their timeout): a store's error as the
        ``StoreError`` it is, anything else as a ``TunelabError`` saying it happened on rank 0."""
        from .errors import StoreError

        found: Any = None
        if self.sync_comm.rank == 0:
            try:
                found = look()
            except StoreError as exc:
                found = _LookupFailed(str(exc), store=True)
            except UsageError as exc:  # (a profile setting that cannot be followed: said as such)
                found = _LookupFailed(str(exc), usage=True)
            except Exception as exc:  # noqa: BLE001 - a defect too: said on every rank, not rank 0's alone
                found = _LookupFailed(f"the profile lookup failed on rank 0: {type(exc).__name__}: {exc}")
        found = self._lookup_done(found)
        if isinstance(found, _LookupFailed):
            raise (StoreError if found.store else UsageError if found.usage else TunelabError)(found.why)
        return found

    def _lookup_profile(self, signature: str, framework: str, model_name: str,
                        legacy: str | None = None) -> tuple[str, dict | None, ProfileKey | None]:
        """(the line to print, the knobs to apply or None, the key the profile is stored under: today's, or
        an older one of the same job, :meth:`profile_keys`)."""
        from .errors import StoreError
        from .profiles import ProfileStore

        topo = self.topology
        what = f"{model_name or signature} / {framework} / {topo.size} ranks"
        # another model's profile may have set the job's knobs already: those stay (knobs are the job's)
        instead = (f"keeping the knobs of {self._knobs_from}'s profile" if self._knobs_from
                   else "using default knobs")
        best = stored_as = None
        try:
            store = ProfileStore(create=False)
            for key in self.profile_keys(signature, framework, legacy):
                if (best := store.best(key)) is not None:
                    stored_as = key
                    break
        except StoreError as exc:
            return f"tunelab: warning: {exc}; {instead}", None, None
        if best is None:
            return f"tunelab: no tuned profile for {what} on this hardware: {instead}", None, None
        line, knobs = _loaded(self.config, store, best, what)
        return line, knobs, stored_as

    def _chosen_profile(self, profile_id: int, signature: str, framework: str, model_name: str,
                        legacy: str | None = None) -> tuple[str, dict | None, ProfileKey | None]:
        """The profile the setting names by id (rank 0), as :meth:`_lookup_profile` gives one; the
        key it is stored under is None where that key is not this job's (another model, framework or
        hardware: said in a warning line before the usual one).  UsageError where it cannot be loaded: no
        such profile, no tuned configuration in it, or tuned for another world size (its knobs were
        measured with other ranks); StoreError where the store cannot be read."""
        from .errors import StoreError
        from .profiles import ProfileStore

        setting = f"{ENV_PROFILE}={profile_id}"
        size = self.topology.size
        try:
            store = ProfileStore(create=False)
            summary = store.get(profile_id)
            best = store.best_of(profile_id) if summary is not None else None
        except StoreError as exc:
            raise StoreError(f"{setting}: {exc}") from None
        if summary is None:
            raise UsageError(f"{setting}: no profile with id {profile_id} in {store.path} "
                             "(`tunelab profiles list` shows the ids)")
        if summary.world_size != size:
            raise UsageError(f"{setting}: profile {profile_id} was tuned for {summary.world_size} ranks, and this job "
                             f"has {size}: its knobs were measured at another size (unset {ENV_PROFILE} to look "
                             "up this job's own)")
        if best is None:
            raise UsageError(f"{setting}: profile {profile_id} has no tuned configuration yet")
        keys = self.profile_keys(signature, framework, legacy)
        others = []
        if summary.model_signature not in (signature, legacy or signature):
            others.append(f"the model {summary.model_name} [{summary.model_signature}], not this job's "
                          f"{model_name or signature} [{signature}]")
        if summary.framework != framework:
            others.append(f"{summary.framework}, not {framework}")
        if summary.hardware_hash not in {k.hardware_hash for k in keys}:
            others.append(f"the hardware {summary.hardware_name} [{summary.hardware_hash}], not this job's "
                          f"[{keys[0].hardware_hash}]")
        what = f"{model_name or signature} / {framework} / {size} ranks"
        line, knobs = _loaded(self.config, store, best, what)
        if not others:
            return line, knobs, summary.key
        warning = (f"tunelab: warning: {setting}: profile {profile_id} was tuned for " + "; ".join(others)
                   + ": loaded as the setting asks")
        return f"{warning}\n{line}", knobs, None

    def _check_roots(self, roots: list[int], what: str) -> None:
        """Every rank's root, gathered: a root that is not a rank fails the call on every rank."""
        n = self.sync_comm.size
        bad = [(r, root) for r, root in enumerate(roots) if not (isinstance(root, (int, np.integer)) and 0 <= root < n)]
        if bad:
            raise ValueError(f"{what}: root_rank " + ", ".join(f"{root!r} on rank {r}" for r, root in bad)
                             + f" is not a rank (world size {n})")
        if any(root != roots[0] for root in roots):
            raise RankMismatchError(f"ranks disagree on the root of {what}: "
                                    + "; ".join(f"rank {r}: root {root}" for r, root in enumerate(roots)))

    def shutdown(self) -> None:
        """Stop the coordinator and free the engine (collective), then raise the coordinator's final
        error, if it had one.  Freeing a shared-memory window waits for every rank of the node, without a
        timeout, so the engine is freed only where every rank agrees to (:meth:`_all_freeing`); else
        nothing collective is freed (the process's end releases it) and no rank waits for the others.
        A second call does nothing (the first said the error, if there was one)."""
        if self._shut_down:
            return
        self._shut_down = True
        error: BaseException | None = None
        try:
            self.coordinator.shutdown()
        except BaseException as exc:  # noqa: BLE001 - raised below, once the frees are settled
            error = exc
        try:
            if self._all_freeing(error):
                self._free()
        except CollectiveTimeoutError:
            if error is None:
                raise
        if error is not None:
            raise error

    def _all_freeing(self, error: BaseException | None) -> bool:
        """Whether every rank frees the engine now.  Each rank says how its coordinator ended in one
        exchange.  A rank that timed out or stalled waits for nobody: its peers may never come (they are
        stuck, or gone), so it posts its word and frees nothing, and every peer that reads the word frees
        nothing either.  The others wait with the timeout; when every rank came without one, a timed
        barrier confirms that all of them read the same, and only then do they free.  (Without that
        barrier, a peer whose wait ran out just before the last word came would leave while the others
        waited in the frees.)  CollectiveTimeoutError where a peer never came."""
        from .engine.consensus import park, wait_or_timeout
        from .errors import StallError

        comm, timeout_s = self._exit_comm, self.config.timeout_s
        left = isinstance(error, (CollectiveTimeoutError, StallError))
        words = np.empty(comm.size, dtype=np.int8)
        req = comm.Iallgather(np.array([1 if left else 0], dtype=np.int8), words)
        if left:
            park(req)  # (completed by the peers' words; never freed while they may still come)
            return False
        wait_or_timeout(req, timeout_s, "the shutdown", comm.rank)
        if words.any():
            return False
        wait_or_timeout(comm.Ibarrier(), timeout_s, "the shutdown", comm.rank)
        return True

    def _free(self) -> None:
        self.sync_comm.Free()
        self._exit_comm.Free()
        self.engine.close(free_shared=True)


@dataclass(frozen=True)
class _LookupFailed:
    """Rank 0's profile lookup raised: broadcast in place of the knobs, so that every rank raises it
    (the others would otherwise wait on the broadcast until their timeout)."""
    why: str
    store: bool = False  # a StoreError's text (raised as one)
    usage: bool = False  # a UsageError's (raised as one); neither: a defect's


def _loaded(config: Any, store: Any, best: Any, what: str) -> tuple[str, dict]:
    """(the line, the knobs to apply) for a stored best: the configuration its measurement ran with
    (knobs added since it was stored at the value they had then: :func:`~tunelab.knobs.stored_knobs`),
    less the knobs the job pins.  A best whose tuning kept the default is that run's default, and a
    value that was tunelab's default then, and is not now, gives way to today's (said in the line)."""
    from .knobs import ADDED_LATER, former_default, knob_text, stored_knobs

    ran = stored_knobs(best.knobs).as_dict()
    knobs = {k: v for k, v in ran.items() if k not in config.pinned}
    if best.gain_low is None and (best.outcome is not None or _kept_before_outcomes(store, best)):
        why = (best.kept_reason() + ("" if best.ended in ("every knob is pinned", None) else f"; {best.ended}")
               if best.outcome is not None else "stored before tunelab recorded why")
        # the default of that run: the knobs pinned while it tuned may differ from this job's, and so
        # may a default that changed since (FORMER_DEFAULTS), which gives way to today's, as does a knob
        # added since (the run had no such route: that was its default, not a choice)
        ours = config.knobs.as_dict()
        differ = {k: v for k, v in knobs.items() if ours.get(k, v) != v}
        added = {k: v for k, v in differ.items() if k in ADDED_LATER and k not in best.knobs}
        former = {k: v for k, v in differ.items() if k not in added and former_default(k, v, best.updated)}
        knobs.update({k: ours[k] for k in (*former, *added)})  # today's, stated: an earlier profile's must not stay
        other = ", ".join(f"{k}={knob_text(k, v)}" for k, v in differ.items() if k not in former and k not in added)
        since = ", ".join([f"{k}={knob_text(k, v)}, tunelab's default then, is {knob_text(k, ours[k])} now"
                           for k, v in former.items()]
                          + [f"{k}={knob_text(k, v)} (stored before that knob existed) is {knob_text(k, ours[k])} now"
                             for k, v in added.items()])
        return (f"tunelab: loaded profile {best.profile_id} for {what}: its tuning kept the default knobs "
                f"({why})" + (f"; that run's default had {other} (pinned then), applied here" if other else "")
                + (f"; its {since}, and that applies" if since else "")), knobs
    shown = ", ".join(f"{k}={knob_text(k, v)}" for k, v in knobs.items())
    return (f"tunelab: loaded tuned profile {best.profile_id} for {what}: {shown} "
            f"(measured {best.interval_text()} the default)"), knobs


def _kept_before_outcomes(store: Any, best: Any) -> bool:
    """Whether a best stored before the store recorded how a search ended (schema 1: no outcome, no
    interval) is its run's default: the knobs of that run's default blocks.  Such a profile kept the
    default, and is read as one that says so (its values are that run's default, not a tuned choice)."""
    if best.outcome is not None or best.gain_low is not None:
        return False
    try:
        defaults = [t.knobs for t in store.trials(best.profile_id) if t.run_id == best.run_id and t.phase == "default"]
    except Exception:  # noqa: BLE001 - unreadable trials: read as a tuned choice, as before
        return False
    return bool(defaults) and all(k == best.knobs for k in defaults)


def _displs(counts: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist() if counts else []


def init(comm: MPI.Comm | None = None, **settings: object) -> Runtime:
    """Create the runtime (idempotent).  ``settings``: knobs and engine settings (ranks_per_node,
    timeout_s, stall_warning_s, timeline, ...), taking precedence over ``TUNELAB_*`` variables."""
    global _current
    if _current is None:
        _current = Runtime(comm, load_engine_config(**settings))
        atexit.register(_shutdown_at_exit)
    elif settings:  # (settings that differ from the running ones were dropped without a word)
        _check_same_settings(_current.config, load_engine_config(**settings))
    return _current


def _check_same_settings(running: EngineConfig, wanted: EngineConfig) -> None:
    """UsageError naming what ``wanted`` changes from the ``running`` runtime's settings."""
    if wanted == running:
        return
    changed = [f"{name}={getattr(wanted.knobs, name)!r} (running: {getattr(running.knobs, name)!r})"
               for name in running.knobs.as_dict() if getattr(wanted.knobs, name) != getattr(running.knobs, name)]
    changed += [f"{f.name}={getattr(wanted, f.name)!r} (running: {getattr(running, f.name)!r})"
                for f in dataclasses.fields(running) if f.name not in ("knobs", "pinned")
                and getattr(wanted, f.name) != getattr(running, f.name)]
    pinned = [name for name in sorted(wanted.pinned ^ running.pinned)  # (the same values, set explicitly
              if getattr(wanted.knobs, name) == getattr(running.knobs, name)]  # on one side only)
    changed += [f"{name} {'pinned' if name in wanted.pinned else 'not pinned'} (running: "
                f"{'pinned' if name in running.pinned else 'not pinned'})" for name in pinned]
    raise UsageError("tunelab is initialized already, with other settings: " + "; ".join(changed)
                     + " (call shutdown() first, or set_knobs() to change knobs while it runs)")


def current() -> Runtime:
    if _current is None:
        raise TunelabError("tunelab is not initialized: call init() first")
    return _current


def shutdown() -> None:
    global _current
    runtime, _current = _current, None
    if runtime is not None:
        runtime.shutdown()


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at the interpreter's exit: an error is said in one line, not as the traceback of
    an exit hook on every rank.  One the job met (a stall the script caught and went on from) leaves the
    exit status as it is, and so does one that ended none of this rank's own work (a peer's collective
    stalled it); one that ended a collective this rank submitted and never waited for (one it left in
    flight, that the other ranks never made) fails this rank, exit status 1: its job did not do what it
    asked for, and a launcher must not read it as success.  (The exit hooks registered before tunelab's,
    MPI's finalize among them, do not run then; the launcher ends the job.)"""
    runtime = _current
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - nothing is left to hand it to
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        lost = [] if runtime is None else [h.name for h in runtime.coordinator.lost if not h.waited]
        if getattr(exc, "tunelab_seen", False) or not lost:
            with contextlib.suppress(Exception):  # (a closed standard error must not make a traceback)
                print(f"tunelab: at exit, after an error: {first}", file=sys.stderr, flush=True)
            return
        from .units import counted

        with contextlib.suppress(Exception):
            print(f"tunelab: error at exit: {first} ({counted(len(lost), 'collective')} this rank submitted "
                  f"never completed, and nothing waited for {'them' if len(lost) > 1 else 'it'}: "
                  f"{', '.join(repr(n) for n in lost[:3])}{' ...' if len(lost) > 3 else ''})", file=sys.stderr)
        for flush in (sys.stdout.flush, sys.stderr.flush):
            with contextlib.suppress(Exception):
                flush()
        with contextlib.suppress(Exception):
            import logging

            logging.shutdown()
        os._exit(1)  # (an exit hook cannot set the status otherwise)


def abandon() -> None:
    """Drop the runtime after an error on this rank, without :func:`shutdown`'s handshake: that waits
    for every rank to shut down, and the others may be blocked where this rank never comes (a rank-0
    decision they wait for).  The coordinator's thread is a daemon; the job is about to be torn down."""
    global _current
    _current = None


@contextlib.contextmanager
def closing() -> Iterator[None]:
    """``with closing():`` around a job's use of the runtime: shut down when the body ends, abandoned
    (:func:`abandon`) when it raises, so this rank's error reaches the launcher instead of a wait for
    ranks that are waiting for this one."""
    try:
        yield
    except BaseException:
        abandon()
        raise
    shutdown()


# ---- the topology/lifecycle half of the adapters' Horovod-shaped API (re-exported by both) ---------
def is_initialized() -> bool:
    return _current is not None


def size() -> int:
    return current().topology.size


def rank() -> int:
    return current().topology.rank


def local_size() -> int:
    return current().topology.local_size


def local_rank() -> int:
    return current().topology.local_rank


def cross_size() -> int:
    return current().topology.cross_size


def cross_rank() -> int:
    return current().topology.cross_rank


def mpi_threads_supported() -> bool:
    """Whether MPI granted MPI_THREAD_MULTIPLE (tunelab's coordinator needs it, so True once initialized)."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    """tunelab's collectives run over MPI (and shared memory): always True."""
    return True


def gloo_built() -> bool:
    """tunelab has no Gloo controller."""
    return False


def mpi_enabled() -> bool:
    """Whether tunelab's collectives run over MPI in this job: True once initialized (they always do)."""
    return is_initialized()


def gloo_enabled() -> bool:
    """tunelab has no Gloo controller: False."""
    return False


def nccl_built() -> bool:
    """tunelab does not use NCCL (GPU tensors go through its own CUDA kernels)."""
    return False


def barrier() -> None:
    """Return once every rank has called barrier()."""
    current().barrier()


def allgather_object(obj: object, name: str | None = None) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    return current().allgather_object(obj, name)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start a Chrome trace of allreduces and knob changes (``mark_cycles`` is accepted for Horovod's
    signature; cycles are not marked)."""
    current().start_timeline(file_path)


def stop_timeline() -> None:
    current().stop_timeline()


def set_knobs(**changes: object) -> None:
    """Change engine knobs while training; rank 0's values are applied by every rank at one cycle."""
    current().coordinator.set_knobs(**changes)
