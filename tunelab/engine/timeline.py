"""Chrome-trace timeline of what the engine does (open in chrome://tracing or Perfetto).

Events stream to the file as they happen (a JSON array the viewers accept even when
a job dies before closing it): negotiation, fusion plans, each allreduce, knob changes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO


class Timeline:
    def __init__(self, path: str, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._file: IO[str] | None = open(path, "w")  # noqa: SIM115 (open for the timeline's life; close() ends it)
        self._file.write("[\n")
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})

    @classmethod
    def for_rank(cls, path: str | None, rank: int) -> Timeline | None:
        """A timeline for this rank: ``path`` as given on rank 0, or with ``{rank}`` filled in on every
        rank when it contains that placeholder (any other brace is part of the name); other ranks record
        nothing."""
        if not path:
            return None
        if "{rank}" in path:
            return cls(path.replace("{rank}", str(rank)), rank)
        return cls(path, rank) if rank == 0 else None

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(event) + ",\n")

    @contextmanager
    def span(self, name: str, category: str, **args: object) -> Iterator[None]:
        start = self._now_us()
        try:
            yield
        finally:
            self._emit({"name": name, "cat": category, "ph": "X", "ts": start, "dur": self._now_us() - start,
                        "pid": self.rank, "tid": threading.get_ident() % 100000, "args": args})

    def instant(self, name: str, category: str, **args: object) -> None:
        self._emit({"name": name, "cat": category, "ph": "i", "s": "p", "ts": self._now_us(),
                    "pid": self.rank, "tid": 0, "args": args})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps({"name": "end", "ph": "i", "s": "g", "ts": self._now_us(),
                                             "pid": self.rank, "tid": 0}) + "\n]\n")
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None
