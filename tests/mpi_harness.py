"""Run test bodies under mpiexec.

A *case* is a plain function ``case(comm, **params) -> dict`` in ``tests/mpi_cases.py`` that
works at any world size.  ``run_case`` launches it on N ranks in a subprocess with a
timeout, and returns each rank's dict (written as JSON).  One launch should run many
checks: every launch costs seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class CaseRun:
    returncode: int
    results: list[dict | None]
    stderr: str
    elapsed_s: float


def run_case(case: str, n: int, limit_s: float = 180, env: dict | None = None,
             launcher: tuple[str, ...] = (), prefix: tuple[str, ...] = (), **params: object) -> CaseRun:
    """``launcher``: arguments for mpiexec itself (``("-bind-to", "core")``); ``prefix``: a command that
    runs mpiexec (``("taskset", "-c", "0")``)."""
    import time

    from tunelab.launch import mpich_segments, mpiexec_command, remove_orphaned_segments

    segments = mpich_segments()  # a case whose ranks abort or die leaves MPICH's segment: removed below
    with tempfile.TemporaryDirectory(prefix="tunelab-test-") as out:
        cmd = [*prefix, *mpiexec_command(), *launcher, "-n", str(n), sys.executable, str(HERE / "mpi_cases.py"),
               case, json.dumps(params), out]
        # Each launch gets its own profile store unless the test passes one: tests never touch ~.
        full_env = {**os.environ, "TUNELAB_HOME": str(Path(out) / "home"), **(env or {})}
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=full_env, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            raise AssertionError(f"case {case} on {n} ranks hung for {limit_s} s:\n{stderr[-3000:]}") from None
        finally:
            remove_orphaned_segments(segments)
        elapsed = time.monotonic() - t0
        results = []
        for r in range(n):
            path = Path(out) / f"rank{r}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
        return CaseRun(proc.returncode, results, stderr, elapsed)


def run_ok(case: str, n: int, limit_s: float = 180, **params: object) -> list[dict]:
    """Run a case that must succeed on every rank; returns the per-rank results."""
    run = run_case(case, n, limit_s, **params)
    assert run.returncode == 0, f"case {case} on {n} ranks exited {run.returncode}:\n{run.stderr[-3000:]}"
    assert all(r is not None for r in run.results), f"missing rank results:\n{run.stderr[-3000:]}"
    return run.results  # type: ignore[return-value]
