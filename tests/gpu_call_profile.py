"""Where one engine allreduce's time goes on a GPU (a diagnostic for GPU machines, not a test).

    python tests/gpu_call_profile.py [--sizes 4KiB,1MiB] [--iters 400] [--kind cupy|torch|numba] [--out DIR]
    mpiexec -n 2 python tests/gpu_call_profile.py ...

For each size: the median of a warmed-up ``engine.allreduce`` of one device tensor plus a wait for
the caller's stream (what ``bench allreduce --device cuda`` times), the median of the call alone
(host time until it returns), and a plain device copy of the same bytes as the floor.  Then, for the
first size, the functions the call spends its host time in (cProfile of this process's main thread,
per call, sorted by own time), written to DIR/profile-rank<r>.txt and the top lines printed by rank 0.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np


def main() -> int:
    from mpi4py import MPI

    from tunelab.config import load_engine_config
    from tunelab.engine.engine import Engine
    from tunelab.units import parse_size

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4KiB,1MiB")
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--kind", choices=("cupy", "torch", "numba"), default="cupy")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--top", type=int, default=22)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.rank
    if a.kind == "torch":
        import torch

        torch.cuda.set_device(0)

        def make(n: int):
            return torch.rand(n, device="cuda")

        def empty(x):
            return torch.empty_like(x)

        def sync() -> None:
            torch.cuda.current_stream().synchronize()

        def copy(dst, src) -> None:
            dst.copy_(src)
    elif a.kind == "numba":
        from numba import cuda

        def make(n: int):
            return cuda.to_device(np.random.default_rng(0).random(n, dtype=np.float32))

        def empty(x):
            return cuda.device_array_like(x)

        def sync() -> None:
            cuda.synchronize()

        def copy(dst, src) -> None:
            dst.copy_to_device(src)
    else:
        import cupy

        def make(n: int):
            return cupy.random.random(n, dtype=np.float32)

        def empty(x):
            return cupy.empty_like(x)

        def sync() -> None:
            cupy.cuda.get_current_stream().synchronize()

        def copy(dst, src) -> None:
            dst[...] = src

    engine = Engine(comm, load_engine_config())
    rows = []
    for i, size in enumerate(parse_size(s) for s in a.sizes.split(",")):
        x = make(size // 4)
        out = empty(x)
        for _ in range(30):
            engine.allreduce(x, out=out)
            sync()
        full, call, floor = [], [], []
        for _ in range(a.iters):
            comm.Barrier()
            t0 = time.perf_counter()
            engine.allreduce(x, out=out)
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            full.append(t2 - t0)
            call.append(t1 - t0)
        for _ in range(a.iters):
            t0 = time.perf_counter()
            copy(out, x)
            sync()
            floor.append(time.perf_counter() - t0)
        rows.append((size, np.median(full) * 1e6, np.median(call) * 1e6, np.median(floor) * 1e6))
        if i == 0:
            prof = cProfile.Profile()
            comm.Barrier()
            prof.enable()
            for _ in range(a.iters):
                engine.allreduce(x, out=out)
                sync()
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(60)
            stats.sort_stats("cumulative").print_stats(60)
            with open(os.path.join(a.out, f"profile-{a.kind}-np{comm.size}-rank{rank}.txt"), "w") as f:
                f.write(text.getvalue())
            if rank == 0:
                st = stats.stats  # type: ignore[attr-defined]
                top = sorted(st.items(), key=lambda kv: -kv[1][2])[:a.top]
                print(f"# np={comm.size} kind={a.kind} size={size}: own time per call (µs), calls per call")
                for (fn, line, name), (_cc, nc, tt, _ct, _callers) in top:
                    print(f"{tt / a.iters * 1e6:8.2f} {nc / a.iters:6.1f}  {os.path.basename(fn)}:{line}({name})")
    engine.close()
    if rank == 0:
        print(f"# np={comm.size} kind={a.kind}: median µs")
        print(" size   call+wait   call-only   copy+wait")
        for size, full_us, call_us, floor_us in rows:
            print(f"{size:>9d} {full_us:10.1f} {call_us:10.1f} {floor_us:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
