"""Rank-side entry point: ``python -m tunelab.rankmain JOB PARAMS_JSON RESULT_PATH``.

Runs one job on every rank; rank 0 writes the result.  Any exception prints one
``tunelab: error: ...`` line and aborts the whole job, so other ranks never hang
waiting for a rank that failed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from .errors import TunelabError, UsageError

USAGE_SUFFIX = ".usage"  # on a rank's error file: the error was the user's input (the command exits 2)

JOBS = {
    "bench-allreduce": "tunelab.bench.allreduce:run_rank",
    "bench-fusion": "tunelab.bench.fusion:run_rank",
    "bench-landscape": "tunelab.bench.landscape:run_rank",
    "bench-train": "tunelab.bench.train:run_rank",
    "tune": "tunelab.tuning.run:run_rank",
}


def _resolve(job: str) -> Callable[[dict], dict]:
    if job not in JOBS:
        raise TunelabError(f"unknown job {job!r}")
    module, func = JOBS[job].split(":")
    return getattr(importlib.import_module(module), func)


_REACHED = False  # whether this process reached the job's agreement (run_in_process)
_FAILED = False  # whether this process's job raised after it (run_in_process)


def alone_in_a_job() -> bool:
    """Whether this process is a rank of the user's mpiexec/srun job that the others may be waiting for
    where it will never come: it has not reached the job's agreement, or its job raised after it (its
    peers may be in the job's next collective, which has no timeout everywhere)."""
    from .launch import inside_mpi_job

    return (not _REACHED or _FAILED) and inside_mpi_job()


def end_the_job_if_alone(status: int) -> None:
    """Under the user's mpiexec/srun, a rank that fails before it reaches the job's agreement (a bad
    flag, a scenario file on one host only), or whose job fails on it after (an error on that rank
    alone), leaves the other ranks waiting for ever (the launcher does not end a job for one rank's
    exit, and the failed rank's MPI_Finalize waits for them too): it ends the whole job instead, with
    its status, as a launched job's ranks do."""
    if status == 0 or not alone_in_a_job():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    from mpi4py import MPI

    from .launch import SHM_DIR, mpich_segments

    try:  # MPI_Abort leaves the node's MPICH segment behind: this job's is the one this process maps
        maps = Path("/proc/self/maps").read_text(errors="replace")
    except OSError:
        maps = ""
    for name in mpich_segments():
        if name in maps:
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()  # (its mappings live on until the job's processes end)
    MPI.COMM_WORLD.Abort(status)


def run_in_process(job: str, params: dict) -> dict:
    """Run ``job`` in this process (already one rank of an MPI job); every rank gets rank 0's result.
    Each rank parsed its own command line (``mpiexec -n 1 tunelab ... : -n 1 tunelab ...`` may give
    them different ones), so the ranks first agree on the job: ranks that would run different
    iterations or sizes would otherwise wait on each other's collectives for ever."""
    from mpi4py import MPI

    from .engine.consensus import all_came

    global _REACHED
    _REACHED = True  # (every rank that gets here meets the others in the agreement: see ends_the_job)
    _agree_on_job(MPI.COMM_WORLD, job, params)
    failures = MPI.COMM_WORLD.Dup()  # (every rank is here: one exchange, by the ranks whose job raises)
    try:
        result = _resolve(job)(params)
    except BaseException:
        global _FAILED
        # the command ends the job once it has said why (end_the_job_if_alone), unless every rank's job
        # raised (an error every rank meets alike: a layout the ranks cannot make): then each exits alone
        # (a barrier on ``failures``, which only failing ranks enter: errors every rank meets alike come
        # within milliseconds of each other; a rank whose peers are still at work gives up)
        _FAILED = not all_came(failures, ALIKE_WAIT_S, "the job's end")
        raise
    failures.Free()
    return MPI.COMM_WORLD.bcast(result, root=0)


ALIKE_WAIT_S = 10.0  # how long a rank whose job raised waits to learn that every rank's did


def _agree_on_job(comm: object, job: str, params: dict) -> None:
    """A usage error on every rank, naming the first setting that differs from rank 0's, when the ranks
    were not all given the same job and settings (one allgather)."""
    mine = json.dumps([job, params], sort_keys=True, default=str)
    everyone = comm.allgather(mine)  # type: ignore[attr-defined]
    other = next((r for r, text in enumerate(everyone) if text != everyone[0]), None)
    if other is None:
        return
    (job0, params0), (job1, params1) = json.loads(everyone[0]), json.loads(everyone[other])
    if job0 != job1:
        raise UsageError(f"ranks disagree on the command: rank 0 runs {job0}, rank {other} {job1}")
    key = next(k for k in sorted(set(params0) | set(params1)) if params0.get(k) != params1.get(k))
    raise UsageError(f"ranks disagree on the command's {key}: rank 0 has {params0.get(key)!r}, "
                     f"rank {other} {params1.get(key)!r} (give every rank the same command line)")


def main(argv: list[str]) -> int:
    job, params, result_path = argv
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    from .engine.mpi_ring import on_fatal

    on_fatal(lambda line: _leave_error(result_path, comm.rank, line + "\n"))  # (the ring's watchdog's line)
    try:
        result = _resolve(job)(json.loads(params))
        if comm.rank == 0:
            tmp = result_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, result_path)
        comm.Barrier()
        return 0
    except BaseException as exc:  # noqa: BLE001 - any failure must abort every rank
        if not isinstance(exc, (TunelabError, ValueError, TypeError)):
            traceback.print_exc()
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        line = f"tunelab: error: rank {comm.rank}: {message}\n"
        _leave_error(result_path, comm.rank, line, usage=isinstance(exc, UsageError))
        sys.stderr.write(line)
        sys.stderr.flush()
        comm.Abort(1)
        return 1


def error_file(result_path: str, rank: int) -> str:
    """Where a failing rank leaves its error line for the launcher: ``MPI_Abort`` may tear the job
    down before the launcher has forwarded the rank's stderr, and the line must not be lost."""
    return f"{result_path}.error.{rank}"


def _leave_error(result_path: str, rank: int, line: str, usage: bool = False) -> None:
    try:
        with open(error_file(result_path, rank) + (USAGE_SUFFIX if usage else ""), "w") as f:
            f.write(line)
    except OSError:
        pass  # stderr still carries it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
