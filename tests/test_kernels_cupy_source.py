"""The CuPy back end's CUDA C, compiled for the host and run thread by thread, against numpy.

CuPy cannot run without a GPU, but its kernels are plain CUDA C: with a small shim
(``data/cuda_host_shim.h``: ``blockIdx``/``threadIdx`` as globals, ``uint4``, the bit casts) g++
builds the very source the back end hands to NVRTC, and a launcher runs every (block, thread) of a
grid in turn.  That checks indexing, the 16-byte vector paths and their tails, aliasing and rounding
here; speed and the device's own compiler are for ``pytest -m gpu``.
"""

from __future__ import annotations

import ctypes
import itertools
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
L = ctypes.c_longlong
_LAUNCHERS = r'''
#define LAUNCH(gx, gy, bx, CALL) \
    for (unsigned by_ = 0; by_ < gy; ++by_) for (unsigned bx_ = 0; bx_ < gx; ++bx_) \
    for (unsigned th_ = 0; th_ < bx; ++th_) { gridDim = {gx, gy, 1}; blockDim = {bx, 1, 1}; \
        blockIdx = {bx_, by_, 0}; threadIdx = {th_, 0, 0}; CALL; }
#define REDUCE(NAME) extern "C" void host_reduce_##NAME(i64 o, const i64* s, int k, i64 n, int op, \
    unsigned gx, unsigned bx) { LAUNCH(gx, 1, bx, reduce_##NAME(o, s, k, n, op)) }
REDUCE(float32) REDUCE(float64) REDUCE(int32) REDUCE(int64)
extern "C" void host_reduce_half(i64 o, const i64* s, int k, i64 n, int op, int kind, unsigned gx, unsigned bx)
    { LAUNCH(gx, 1, bx, reduce_half(o, s, k, n, op, kind)) }
extern "C" void host_reduce_bcast_float32(const i64* t, int rows, int ns, int nd, int op, float f, int sc,
    unsigned gx, unsigned gy, unsigned bx) { LAUNCH(gx, gy, bx, reduce_bcast_float32(t, rows, ns, nd, op, f, sc)) }
extern "C" void host_reduce_bcast_half(const i64* t, int rows, int ns, int nd, int kind, int op, float pre, float f,
    int sc, unsigned gx, unsigned gy, unsigned bx)
    { LAUNCH(gx, gy, bx, reduce_bcast_half(t, rows, ns, nd, kind, op, pre, f, sc)) }
extern "C" void host_copy_rows(const i64* rows, int n, unsigned gx, unsigned gy, unsigned bx)
    { LAUNCH(gx, gy, bx, copy_rows(rows, n)) }
'''


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ to build the CUDA C for the host")
    from tunelab.kernels.cupy_backend import _SOURCE

    build = tmp_path_factory.mktemp("cuda-host")
    src = build / "kernels.cpp"
    src.write_text(f'#include "{HERE / "data" / "cuda_host_shim.h"}"\n{_SOURCE}\n{_LAUNCHERS}')
    so = build / "kernels.so"
    # -ffp-contract=off: like NVRTC's -fmad=false, no fused multiply-adds
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(so), str(src)],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(so))


def _addrs(xs) -> np.ndarray:
    return np.array([x.ctypes.data for x in xs], np.int64)


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def _want(srcs, op: int, half: bool) -> np.ndarray:
    f = (np.add, np.minimum, np.maximum)[op]
    acc = srcs[0].astype(np.float32) if half else srcs[0].copy()
    for s in srcs[1:]:
        acc = f(acc, s.astype(np.float32) if half else s)
    return acc.astype(srcs[0].dtype)


@pytest.mark.parametrize("name", ["float32", "float64", "int32", "int64", "float16", "bfloat16"])
def test_reduce_matches_numpy_on_vector_paths_tails_and_misaligned_buffers(lib, name):
    dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    half = name in ("float16", "bfloat16")
    for k, n, off, op in itertools.product((1, 2, 3), (0, 1, 5, 8, 33, 1000), (0, 1), (0, 1, 2)):
        rng = np.random.default_rng(n + k + off)
        srcs = [rng.integers(-9, 10, n + 8).astype(dt)[off:off + n] for _ in range(k)]  # off 1: unaligned
        out = np.zeros(n + 8, dt)[off:off + n]
        args = [L(out.ctypes.data), _ptr(_addrs(srcs)), k, L(n), op]
        if half:
            lib.host_reduce_half(*args, 1 if name == "float16" else 2, 3, 4)
        else:
            getattr(lib, f"host_reduce_{name}")(*args, 3, 4)
        assert np.array_equal(out.view(np.uint8), _want(srcs, op, half).view(np.uint8)), (k, n, off, op)


def test_reduce_output_may_alias_a_source(lib):
    x = [np.arange(64, dtype=np.float32), np.arange(64, dtype=np.float32) * 2]
    want = x[0] + x[1]
    lib.host_reduce_float32(L(x[1].ctypes.data), _ptr(_addrs(x)), 2, L(64), 0, 2, 4)
    assert np.array_equal(x[1], want)


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_reduce_bcast_writes_every_destination_scaled_like_unpacking(lib, name):
    dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    kind = {"float16": 1, "bfloat16": 2}.get(name)
    factor = 1 / 3
    for scaled, off in itertools.product((0, 1), (0, 1)):
        counts = (5, 40, 0, 17)
        srcs = [[np.random.default_rng(c + j).integers(-9, 10, c + 8).astype(dt)[off:off + c] for j in range(3)]
                for c in counts]
        dsts = [[np.zeros(c + 8, dt)[off:off + c] for _ in range(2)] for c in counts]
        table = np.array([[c, *_addrs(s), *_addrs(d)] for c, s, d in zip(counts, srcs, dsts)], np.int64)
        if kind:
            lib.host_reduce_bcast_half(_ptr(table), 4, 3, 2, kind, 0, ctypes.c_float(1.0), ctypes.c_float(factor),
                                       scaled, 2, 4, 4)
        else:
            lib.host_reduce_bcast_float32(_ptr(table), 4, 3, 2, 0, ctypes.c_float(factor), scaled, 2, 4, 4)
        for s, d in zip(srcs, dsts):
            want = _want(s, 0, bool(kind))
            if scaled:
                want = (want.astype(np.float32) * np.float32(factor)).astype(dt)
            for o in d:
                assert np.array_equal(o.view(np.uint8), want.view(np.uint8)), (name, scaled, off, len(o))


@pytest.mark.parametrize("off", [0, 1])
def test_a_float16_average_whose_sum_passes_65504_is_scaled_before_it_rounds(lib, off):
    """Three sources of multiples of 1024 up to 9216 sum past float16's 65504: each times ``pre`` (1/4),
    rounded to float16 as the staged path packs it, then their sum, then ``factor`` (4/3), so the average
    is numpy's, not inf; sources near float16's smallest normal (6.1e-5) are rounded by that packing
    too (a sum scaled once differs there)."""
    rng = np.random.default_rng(off)
    count = 41
    srcs = [(1024.0 * rng.integers(-9, 10, count + 8)).astype(np.float16)[off:off + count] for _ in range(3)]
    srcs[0][:3] = srcs[1][:3] = srcs[2][:3] = np.float16(60416.0)  # (sum 181248: inf if rounded first)
    for x in srcs:  # (times 1/4: below the smallest normal)
        x[3:9] = rng.uniform(6.2e-5, 2.4e-4, 6).astype(np.float16)
    dsts = [np.zeros(count + 8, np.float16)[off:off + count] for _ in range(2)]
    table = np.array([[count, *_addrs(srcs), *_addrs(dsts)]], np.int64)
    lib.host_reduce_bcast_half(_ptr(table), 1, 3, 2, 1, 0, ctypes.c_float(0.25), ctypes.c_float(4 / 3), 1, 2, 1, 4)
    packed = [(x.astype(np.float32) * np.float32(0.25)).astype(np.float16).astype(np.float32) for x in srcs]
    want = ((packed[0] + packed[1] + packed[2]).astype(np.float16).astype(np.float32)
            * np.float32(4 / 3)).astype(np.float16)
    assert np.isfinite(want).all() and want[0] == np.float16(60416.0)
    once = ((np.sum([x.astype(np.float32) for x in srcs], axis=0) * np.float32(0.25)).astype(np.float16)
            .astype(np.float32) * np.float32(4 / 3)).astype(np.float16)
    assert not np.array_equal(once[3:9], want[3:9])  # (the inputs do tell the two apart)
    for o in dsts:
        assert np.array_equal(o.view(np.uint16), want.view(np.uint16))


def test_copy_rows_with_any_alignment(lib):
    src = np.random.default_rng(3).integers(0, 255, 4096).astype(np.uint8)
    dst = np.zeros(4096, np.uint8)
    rows = np.array([[src.ctypes.data + a, dst.ctypes.data + b, n]
                     for a, b, n in ((0, 0, 1000), (1, 1003, 777), (2000, 1900, 3), (2100, 2101, 1500))], np.int64)
    lib.host_copy_rows(_ptr(rows), 4, 2, 4, 8)
    for a, b, n in ((0, 0, 1000), (1, 1003, 777), (2000, 1900, 3), (2100, 2101, 1500)):
        assert np.array_equal(dst[b:b + n], src[a:a + n])


class _OrderingCupy:
    """Just enough of CuPy to see which stream each copy and launch is queued on: CuPy copies a host
    array asynchronously on its *current* stream, and a launch given a stream runs inside it."""

    def __init__(self) -> None:
        self.current, self.queued = "default", []
        fake = self

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def __enter__(self):
                self.saved, fake.current = fake.current, self.name

            def __exit__(self, *exc):
                fake.current = self.saved

        class Array:
            def __init__(self, host) -> None:
                self.host = host
                self.data = type("Ptr", (), {"ptr": 4096})()

        self.Stream, self.Array = Stream, Array

    def asarray(self, host):
        self.queued.append(("upload", self.current))
        return self.Array(host)

    def function(self, name):
        return lambda grid, block, args: self.queued.append((name, self.current))


def test_a_host_table_is_uploaded_on_the_stream_its_launch_runs_on():
    """A launch on a non-blocking engine stream is not ordered after CuPy's default stream (where the
    framework's backward kernels are queued too): a table copied there may not have arrived when the
    kernel reads it.  Every upload goes to the stream of the launches that read it."""
    from tunelab.kernels.cupy_backend import CupyBackend

    fake = _OrderingCupy()
    backend = object.__new__(CupyBackend)  # no GPU here: the back end over the fake module
    backend._cp, backend._fns, backend._block, backend._max_blocks = fake, {}, 256, 8192
    backend._fn = fake.function
    engine = fake.Stream("engine")
    rows = np.array([[4096, 8192, 16]], np.int64)
    backend.copy_table(rows, engine)
    backend.scale_copy_table(rows, np.float32, 0.5, engine)
    backend.reduce(4096, np.array([8192, 12288], np.int64), 16, np.float32, 0, engine)
    assert fake.queued == [("upload", "engine"), ("copy_rows", "engine"), ("upload", "engine"),
                           ("scale_rows_float32", "engine"), ("upload", "engine"), ("reduce_float32", "engine")]
    table = backend.upload_table(rows, engine)  # the table cache's upload, ahead of its launches
    assert fake.queued[-1] == ("upload", "engine") and table.host is not None  # the source outlives the copy
    fake.queued.clear()
    backend.copy_table(rows)  # no stream: both on CuPy's current stream
    assert fake.queued == [("upload", "default"), ("copy_rows", "default")]
