"""The per-process state behind the framework adapters' Horovod-shaped API.

``tunelab.torch.init()`` (or ``tunelab.tensorflow.init()``) creates one Runtime: the
engine, its background coordinator, and a separate communicator for synchronous
collectives (broadcast, allgather) issued from the caller's thread.  Module-level
functions of the adapters act on the current runtime; there is at most one.
"""

from __future__ import annotations

import atexit
import itertools
from typing import TYPE_CHECKING

import numpy as np

from .config import EngineConfig, load_engine_config
from .errors import RankMismatchError, TunelabError

if TYPE_CHECKING:
    from mpi4py import MPI

    from .engine.coordinator import Coordinator
    from .engine.engine import Engine

_current: "Runtime | None" = None


class Runtime:
    def __init__(self, comm: "MPI.Comm | None" = None, config: EngineConfig | None = None) -> None:
        from mpi4py import MPI

        from .engine.coordinator import Coordinator
        from .engine.engine import Engine

        self.config = config or load_engine_config()
        self.engine: Engine = Engine(comm or MPI.COMM_WORLD, self.config)
        self.coordinator: Coordinator = Coordinator(self.engine, self.config.timeline)
        self.sync_comm = self.engine.topology.world.Dup()
        self._names = itertools.count()

    @property
    def topology(self):
        return self.engine.topology

    def auto_name(self, kind: str) -> str:
        """Names for unnamed tensors: the same sequence on every rank that makes the same calls."""
        return f"{kind}.noname.{next(self._names)}"

    # ---- synchronous collectives on the caller's thread ----------------------------------------
    def check_same(self, value: object, what: str) -> None:
        """RankMismatchError on every rank unless ``value`` (picklable) is equal on all ranks."""
        values = self.sync_comm.allgather(value)
        if any(v != values[0] for v in values[1:]):
            detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise RankMismatchError(f"ranks disagree on {what}: {detail}")

    def broadcast_(self, array: np.ndarray, root: int, what: str) -> None:
        """In-place broadcast of a C-contiguous array from ``root``; shapes/dtypes checked first."""
        self._check_root(root)
        meta = self.sync_comm.bcast((array.dtype.name, array.shape), root=root)
        self.check_same((array.dtype.name, array.shape) == meta, f"shape/dtype of {what} (vs root {root})")
        from mpi4py import MPI

        self.sync_comm.Bcast([array.reshape(-1).view(np.uint8), MPI.BYTE], root=root)

    def broadcast_object(self, obj: object, root: int) -> object:
        self._check_root(root)
        return self.sync_comm.bcast(obj, root=root)

    def allgather(self, array: np.ndarray, what: str) -> np.ndarray:
        """Concatenate every rank's array along axis 0 (first dims may differ)."""
        from mpi4py import MPI

        metas = self.sync_comm.allgather((array.dtype.name, array.shape[1:], array.shape[0] if array.ndim else 1))
        if len({m[:2] for m in metas}) > 1:
            detail = "; ".join(f"rank {r}: {m[0]}[*, {', '.join(map(str, m[1]))}]" for r, m in enumerate(metas))
            raise RankMismatchError(f"allgather of {what} needs the same dtype and trailing shape: {detail}")
        src = np.ascontiguousarray(array).reshape(-1, *array.shape[1:]) if array.ndim else array.reshape(1)
        rows = [m[2] for m in metas]
        row_bytes = src[:1].nbytes if src.shape[0] else int(np.prod(src.shape[1:], dtype=np.int64)) * src.itemsize
        out = np.empty((sum(rows), *src.shape[1:]), dtype=src.dtype)
        counts = [r * row_bytes for r in rows]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        self.sync_comm.Allgatherv([src.reshape(-1).view(np.uint8), MPI.BYTE],
                                  [out.reshape(-1).view(np.uint8), (counts, displs), MPI.BYTE])
        return out

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.sync_comm.size:
            raise ValueError(f"root_rank {root} is not a rank (world size {self.sync_comm.size})")

    def shutdown(self) -> None:
        self.coordinator.shutdown()
        self.sync_comm.Free()
        self.engine.close()


def init(comm: "MPI.Comm | None" = None, **settings: object) -> Runtime:
    """Create the runtime (idempotent).  ``settings``: knobs and engine settings (ranks_per_node,
    timeout_s, timeline, ...), taking precedence over ``TUNELAB_*`` variables."""
    global _current
    if _current is None:
        _current = Runtime(comm, load_engine_config(**settings))
        atexit.register(shutdown)
    return _current


def current() -> Runtime:
    if _current is None:
        raise TunelabError("tunelab is not initialized: call init() first")
    return _current


def shutdown() -> None:
    global _current
    runtime, _current = _current, None
    if runtime is not None:
        runtime.shutdown()
