"""Rank-side entry point: ``python -m tunelab.rankmain JOB PARAMS_JSON RESULT_PATH``.

Runs one job on every rank; rank 0 writes the result.  Any exception prints one
``tunelab: error: ...`` line and aborts the whole job, so other ranks never hang
waiting for a rank that failed.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable

from .errors import TunelabError

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


def run_in_process(job: str, params: dict) -> dict:
    """Run ``job`` in this process (already one rank of an MPI job); every rank gets rank 0's result."""
    from mpi4py import MPI

    result = _resolve(job)(params)
    return MPI.COMM_WORLD.bcast(result, root=0)


def main(argv: list[str]) -> int:
    job, params, result_path = argv
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
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
        sys.stderr.write(f"tunelab: error: rank {comm.rank}: {message}\n")
        sys.stderr.flush()
        comm.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
