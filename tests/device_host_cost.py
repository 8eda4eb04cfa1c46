"""The host time of the device path's Python, without a GPU (a diagnostic, not a test).

    python tests/device_host_cost.py [--tensors K] [--calls N] [--top T]

Under Numba's CUDA simulator, with the kernel launches stubbed out (the simulator would run them
thread by thread in Python), one rank reduces K device tensors the way the coordinator hands a fused
call to the engine: each tensor marked where it is submitted (``Engine.mark_ready``, what a gradient
hook does), then one ``allreduce_batch`` of them, in place.  Printed: the median microseconds of the
marks and of the call over N calls, then the functions the call spends its time in (cProfile, own
time per call).  On a GPU the CUDA calls (event records, stream waits, launches) come on top: this
measures the Python the engine adds to every call, which the GPU cannot hide.
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

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def main() -> int:
    from mpi4py import MPI
    from numba import cuda

    from tunelab.config import load_engine_config
    from tunelab.engine.device import device_buffer
    from tunelab.engine.engine import Engine

    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=6, help="tensors a call fuses (ResNet-50: ~6 at a 1 ms cycle)")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=16)
    a = p.parse_args()
    engine = Engine(MPI.COMM_WORLD, load_engine_config({"TUNELAB_KERNEL_BACKEND": "numba-cuda"}))
    sizes = np.random.default_rng(0).integers(64, 4096, a.tensors)
    xs = [device_buffer(cuda.to_device(np.ones(int(n), np.float32))) for n in sizes]
    engine.allreduce_batch(xs, "average", outs=xs, verify=False)  # sets the device path up
    kernels = engine._device.kernels
    for name in ("copy_table", "scale_copy_table", "reduce", "reduce_bcast"):
        setattr(kernels, name, lambda *args, **kwargs: None)

    def call() -> tuple[float, float]:
        t0 = time.perf_counter()
        ins = [engine.mark_ready(x) for x in xs]
        t1 = time.perf_counter()
        engine.allreduce_batch(ins, "average", outs=xs, verify=False)
        return t1 - t0, time.perf_counter() - t1

    for _ in range(100):
        call()
    marks, calls = np.array([call() for _ in range(a.calls)]).T * 1e6
    print(f"{a.tensors} tensors a call: marks {np.median(marks):.1f} us ({np.median(marks) / a.tensors:.1f} each), "
          f"call {np.median(calls):.1f} us (median of {a.calls})")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        call()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(a.top)
    print(f"# own time under cProfile (which slows Python calls ~2-3x), per call of {a.calls}:")
    for line in out.getvalue().splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[1].replace(".", "").isdigit():
            ncalls = int(parts[0].split("/")[0])
            print(f"  {float(parts[1]) * 1e6 / a.calls:7.2f} us  {ncalls / a.calls:4.1f}x  {parts[5][-70:]}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
