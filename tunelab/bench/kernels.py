"""``tunelab bench kernels``: GB/s of the kernel back end next to a plain copy (rank-free).

For every size it times pack (a fusion bucket of tensors gathered into one buffer by one
``copy_table`` call), unpack (the reverse), reduce (two float32 sources into a third buffer) and cast
(float32 -> bfloat16), and, in the same run, a plain copy of the same bytes.  On a GPU that copy is
the CUDA driver's own ``cuMemcpyDtoDAsync`` for every back end (one reference, whichever library
launches the kernels), on the CPU ``np.copyto``.  GPU kernels are timed as the engine runs them:
their tables are uploaded once, before timing.

``vs_copy`` is kernel GB/s over copy GB/s, counting ``size`` bytes of payload.  ``vs_bound`` counts
the bytes each kernel must move (pack, unpack: read + write; reduce: two reads and a write; cast: a
float32 read and a bfloat16 write) against the copy's read + write rate: 1.0 is the copy's speed for
that kernel's traffic, whatever the kernel.  On the CPU both run on one thread (the kernels' serial
builds, as a rank that has one core runs them, and numpy's copy): the memory system's speed for one
core, not the whole machine's.  Each result is checked against numpy.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cli.finish import add_output_flags, finish
from ..cli.types import non_negative_int, positive_int, size_list
from ..errors import TunelabError, UsageError
from ..units import format_size

KERNELS = ("pack", "unpack", "reduce", "cast")
BACKENDS = ("auto", "cpu", "numba-cuda", "cupy")
GPU_SIZES = tuple(1 << s for s in range(20, 31, 2))  # 1MiB, 4MiB, ... 1GiB
CPU_SIZES = tuple(1 << s for s in range(20, 29, 2))  # 1MiB ... 256MiB
TENSORS = 32  # tensors per fusion bucket in pack/unpack
TRAFFIC = {"pack": 2.0, "unpack": 2.0, "reduce": 3.0, "cast": 1.5}  # bytes moved per payload byte


class _Memory:
    """Buffers, a plain copy and a timer for one back end's memory (host or device)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._driver: Any = None
        self.xp: Any = np
        if backend == "cupy":
            import cupy

            self.xp = cupy
        elif backend == "numba-cuda":
            from numba import cuda

            self.cuda = cuda

    def upload(self, host: np.ndarray) -> Any:
        if self.backend == "numba-cuda":
            return self.cuda.to_device(host)
        return self.xp.asarray(host) if self.backend == "cupy" else host.copy()

    def empty(self, n: int, dtype: Any) -> Any:
        if self.backend == "numba-cuda":
            return self.cuda.device_array(n, dtype)
        return self.xp.empty(n, dtype)

    def download(self, array: Any) -> np.ndarray:
        if self.backend == "numba-cuda":
            return array.copy_to_host()
        return array.get() if self.backend == "cupy" else array

    def addr(self, array: Any) -> int:
        if isinstance(array, np.ndarray):
            return array.ctypes.data
        return int(array.__cuda_array_interface__["data"][0])

    def copy(self, dst: Any, src: Any) -> None:
        if self.backend == "cpu":
            np.copyto(dst, src)
            return
        from ..engine.device import simulated

        if simulated():  # no driver: the simulator's own copy (its timings mean nothing anyway)
            dst.copy_to_device(src)
            return
        if self._driver is None:
            from ..engine.cuda_driver import CudaDriver

            self._driver = CudaDriver()
        self._driver.copy_async(self.addr(dst), self.addr(src), int(src.nbytes), 0)

    def table(self, kernels: Any, rows: np.ndarray) -> Any:
        """A kernel table as the engine passes it: on a GPU uploaded once, here, outside the timing."""
        return rows if self.backend == "cpu" else kernels.upload_table(rows)

    def seconds(self, op: Callable[[], None], iters: int, warmup: int) -> float:
        """Median seconds of ``op``: CUDA events around each call on a GPU, perf_counter on the CPU."""
        times = []
        for k in range(warmup + iters):
            if self.backend == "cpu":
                t0 = time.perf_counter()
                op()
                dt = time.perf_counter() - t0
            else:
                dt = self._event_seconds(op)
            if k >= warmup:
                times.append(dt)
        return float(np.median(times))

    def _event_seconds(self, op: Callable[[], None]) -> float:
        if self.backend == "cupy":
            start, end = self.xp.cuda.Event(), self.xp.cuda.Event()
            start.record()
            op()
            end.record()
            end.synchronize()
            return self.xp.cuda.get_elapsed_time(start, end) / 1e3
        start, end = self.cuda.event(timing=True), self.cuda.event(timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        return self.cuda.event_elapsed_time(start, end) / 1e3

    def describe(self) -> str:
        if self.backend == "cupy":
            props = self.xp.cuda.runtime.getDeviceProperties(self.xp.cuda.Device().id)
            return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        if self.backend == "numba-cuda":
            name = self.cuda.get_current_device().name
            return name.decode() if isinstance(name, bytes) else str(name)
        from ..hardware import host_info

        return f"{host_info()['cpu_model']} ({host_info()['cpu_cores']} cores)"


def _bucket(size: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of TENSORS tensors filling ``size`` bytes, uneven and 4-byte granular."""
    weights = np.arange(1, TENSORS + 1, dtype=np.float64)
    cuts = np.floor(np.cumsum(weights) / weights.sum() * (size // 4)).astype(np.int64) * 4
    cuts[-1] = size
    starts = np.concatenate([[0], cuts[:-1]])
    return [(int(a), int(b - a)) for a, b in zip(starts, cuts) if b > a]


def _measure(kernels: Any, mem: _Memory, size: int, iters: int, warmup: int) -> list[dict]:
    """Time the four kernels and the copy at ``size`` bytes, then check each kernel's result."""
    import ml_dtypes

    from ..kernels import ReduceOp

    n = size // 4
    host = (np.arange(n, dtype=np.int64) % 251 - 125).astype(np.float32)  # sums are exact
    src, other = mem.upload(host), mem.upload(host[::-1].copy())
    packed, out, half = mem.empty(n, np.float32), mem.empty(n, np.float32), mem.empty(n, np.uint16)
    parts = _bucket(size)
    tensors = [mem.upload(host[o // 4:(o + nb) // 4]) for o, nb in parts]
    pack_rows = mem.table(kernels, np.array([[mem.addr(t), mem.addr(packed) + o, nb]
                                             for (o, nb), t in zip(parts, tensors)]))
    unpack_rows = mem.table(kernels, np.array([[mem.addr(other) + o, mem.addr(t), nb]
                                               for (o, nb), t in zip(parts, tensors)]))
    addrs = mem.table(kernels, np.array([mem.addr(src), mem.addr(other)], np.int64))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    ops: dict[str, Callable[[], None]] = {  # pack runs before unpack overwrites the tensors
        "copy": lambda: mem.copy(out, src),
        "pack": lambda: kernels.copy_table(pack_rows),
        "unpack": lambda: kernels.copy_table(unpack_rows),
        "reduce": lambda: kernels.reduce(mem.addr(out), addrs, n, np.dtype(np.float32), ReduceOp.SUM),
        "cast": lambda: kernels.cast(src, half.view(bf16) if mem.backend == "cpu" else half),
    }
    times = {name: mem.seconds(op, iters, warmup) for name, op in ops.items()}
    results = {"pack": (mem.download(packed), host),
               "unpack": (np.concatenate([mem.download(t) for t in tensors]), host[::-1]),
               "reduce": (mem.download(out), host + host[::-1]),
               "cast": (mem.download(half), host.astype(bf16).view(np.uint16))}
    copy_gbps = size / times["copy"] / 1e9
    rows = []
    for name in KERNELS:
        got, want = results[name]
        if not np.array_equal(got, want):
            raise TunelabError(f"{kernels.name} {name} kernel gave wrong results at {format_size(size)}")
        gbps = size / times[name] / 1e9
        rows.append({"kernel": name, "size": size, "time_us": times[name] * 1e6, "gbps": gbps,
                     "copy_gbps": copy_gbps, "vs_copy": gbps / copy_gbps,
                     "vs_bound": TRAFFIC[name] * gbps / (2 * copy_gbps)})
    return rows


# Host bytes a size's measurement holds at its peak, per byte of the size: the inputs and their reversed
# copy, the packed, reduced and cast outputs, the bucket's tensors and what is read back to check them
HOST_BYTES_PER_BYTE = 12


def _refuse_what_memory_cannot_hold(size: int) -> None:
    """A usage error, before anything is allocated, where the largest size's arrays exceed the memory
    available (an allocation the kernel lets through would get the process killed, not an error)."""
    from ..launch import available_memory_bytes

    available = available_memory_bytes()
    if available is not None and HOST_BYTES_PER_BYTE * size > available:
        raise UsageError(f"{format_size(size)} does not fit in memory here: measuring it holds about "
                         f"{HOST_BYTES_PER_BYTE * size / 2**30:.1f} GiB of host memory and "
                         f"{available / 2**30:.1f} GiB is available; give smaller --sizes")


def run(params: dict) -> dict:
    """Benchmark one back end; ``params``: backend, sizes (bytes, or None for defaults), iters, warmup."""
    from ..kernels import get_backend

    try:
        kernels = get_backend(params.get("backend", "auto"))
    except (ImportError, RuntimeError) as exc:
        raise TunelabError(" ".join(str(exc).split())) from None
    mem = _Memory(kernels.name)
    sizes = params.get("sizes") or (CPU_SIZES if kernels.name == "cpu" else GPU_SIZES)
    for size in sizes:
        if size < 4 * TENSORS or size % 4:
            raise UsageError(f"size {size} must be a multiple of 4 bytes and at least {4 * TENSORS}")
    _refuse_what_memory_cannot_hold(max(sizes))
    rows = []
    for size in sizes:
        try:
            rows += _measure(kernels, mem, int(size), int(params.get("iters", 10)), int(params.get("warmup", 2)))
        except MemoryError as exc:  # (a device's, or a host allocation the estimate let through)
            raise UsageError(f"{format_size(size)} does not fit in memory here "
                             f"({type(exc).__name__}); give smaller --sizes") from None
    return {"rows": rows, "backend": kernels.name, "device": mem.describe(),
            "iters": int(params.get("iters", 10)), "warmup": int(params.get("warmup", 2))}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench kernels`` under the ``bench`` sub-command parsers."""
    p = subparsers.add_parser("kernels", help="kernel GB/s (pack, unpack, reduce, cast) next to a plain copy")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="kernel back end (default auto)")
    p.add_argument("--sizes", type=size_list, default=None,
                   help="comma-separated sizes (default 1MiB..1GiB on a GPU, 1MiB..256MiB on the CPU)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per kernel and size (default 10)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed calls before them (default 2)")
    add_output_flags(p)
    p.set_defaults(func=_cmd)
    return p


def _cmd(args: argparse.Namespace) -> int:
    from .common import format_table

    result = run({"backend": args.backend, "sizes": args.sizes, "iters": args.iters, "warmup": args.warmup})
    print(f"# kernels  backend={result['backend']}  device={result['device']}  "
          f"iters={args.iters}  warmup={args.warmup}  (time: median)")
    rows = [{**r, "size_h": format_size(r["size"])} for r in result["rows"]]
    print(format_table(rows, [("kernel", "kernel", ""), ("size_h", "size", ""), ("time_us", "time_us", ".1f"),
                              ("gbps", "GB/s", ".2f"), ("copy_gbps", "copy_GB/s", ".2f"),
                              ("vs_copy", "vs_copy", ".2f"), ("vs_bound", "vs_bound", ".2f")]))
    return finish(args, result, "kernels", "bench")
