"""Both GPU back ends (numba-cuda, cupy) against the CPU back end, on a real CUDA device.

Every run uses fresh random inputs and outputs poisoned with 0xFF bytes beforehand, so a kernel that
skips elements cannot pass on leftovers.  Random floats (not only exact integers) are fine here: the
GPU kernels combine sources in the same order and round the same way as the CPU, so results must be
bit-identical.  Each back end skips with its reason when CuPy, numba.cuda or a device is missing.
"""

from __future__ import annotations

import itertools
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from tunelab.kernels import ReduceOp, get_backend

from tunelab.dtypes import dtype_from_name, supported_names

pytestmark = pytest.mark.gpu


class _Device:
    """Device buffers for one back end: CuPy arrays for ``cupy``, numba device arrays for ``numba-cuda``."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "cupy":
            import cupy

            self.cp = cupy

    def upload(self, host: np.ndarray) -> Any:
        host = host.view(np.uint16) if host.dtype == ml_dtypes.bfloat16 else host  # no bf16 on device
        if self.name == "cupy":
            return self.cp.asarray(host)
        from numba import cuda

        return cuda.to_device(host)

    def poisoned(self, n: int, dtype: np.dtype) -> Any:
        return self.upload(np.full(n * np.dtype(dtype).itemsize, 0xFF, np.uint8).view(dtype))

    def download(self, array: Any, dtype: np.dtype) -> np.ndarray:
        host = array.get() if self.name == "cupy" else array.copy_to_host()
        return host.view(dtype)

    @staticmethod
    def addr(array: Any) -> int:
        return int(array.__cuda_array_interface__["data"][0])


@pytest.fixture(params=["numba-cuda", "cupy"])
def gpu(request: pytest.FixtureRequest) -> tuple[Any, _Device]:
    try:
        backend = get_backend(request.param)
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"{request.param}: {exc}")
    return backend, _Device(request.param)


@pytest.fixture(scope="module")
def cpu() -> Any:
    return get_backend("cpu")


def _random(rng: np.random.Generator, n: int, dt: np.dtype) -> np.ndarray:
    if np.issubdtype(dt, np.integer):
        return rng.integers(-(2**20), 2**20, n).astype(dt)
    return (rng.standard_normal(n) * 100).astype(dt)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("name", supported_names())
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("nsrc,count", [(1, 1), (2, 1000), (3, 4097), (4, 100_003)])
def test_reduce_matches_cpu(gpu, cpu, name, op, nsrc, count):
    backend, dev = gpu
    dt = dtype_from_name(name)
    rng = np.random.default_rng()
    host = [_random(rng, count, dt) for _ in range(nsrc)]
    srcs = [dev.upload(h) for h in host]
    out = dev.poisoned(count, np.uint16 if dt.itemsize == 2 else dt)
    backend.reduce(dev.addr(out), np.array([dev.addr(s) for s in srcs]), count, dt, op)
    backend.synchronize()
    ref = np.empty(count, dt)
    cpu.reduce(ref.ctypes.data, np.array([h.ctypes.data for h in host]), count, dt, op)
    assert _same_bits(dev.download(out, dt), ref)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int32"])
@pytest.mark.parametrize("alias", [0, 2])
def test_reduce_output_aliasing_a_source(gpu, cpu, name, alias):
    backend, dev = gpu
    dt = dtype_from_name(name)
    rng = np.random.default_rng()
    host = [_random(rng, 50_001, dt) for _ in range(3)]
    srcs = [dev.upload(h) for h in host]
    ref = np.empty(50_001, dt)
    cpu.reduce(ref.ctypes.data, np.array([h.ctypes.data for h in host]), 50_001, dt, ReduceOp.SUM)
    backend.reduce(dev.addr(srcs[alias]), np.array([dev.addr(s) for s in srcs]), 50_001, dt, ReduceOp.SUM)
    backend.synchronize()
    assert _same_bits(dev.download(srcs[alias], dt), ref)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_sum_accumulates_in_float32_like_cpu(gpu, cpu, half):
    backend, dev = gpu
    dt = dtype_from_name(half)
    rng = np.random.default_rng()
    # magnitudes 2**-14 .. 2**11: float32 partial sums round, so the accumulator type and order show
    host = [(rng.choice([-1, 1], 100_000) * 2.0 ** rng.integers(-14, 12, 100_000)).astype(dt) for _ in range(5)]
    srcs, out, ref = [dev.upload(h) for h in host], dev.poisoned(100_000, np.uint16), np.empty(100_000, dt)
    backend.reduce(dev.addr(out), np.array([dev.addr(s) for s in srcs]), 100_000, dt, ReduceOp.SUM)
    cpu.reduce(ref.ctypes.data, np.array([h.ctypes.data for h in host]), 100_000, dt, ReduceOp.SUM)
    backend.synchronize()
    assert _same_bits(dev.download(out, dt), ref)


def test_min_max_propagate_nan(gpu):
    backend, dev = gpu
    a = np.array([1.0, np.nan, 3.0, np.nan], np.float32)
    b = np.array([np.nan, 2.0, 1.0, np.nan], np.float32)
    for op, fn in ((ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum)):
        da, db, out = dev.upload(a), dev.upload(b), dev.poisoned(4, np.float32)
        backend.reduce(dev.addr(out), np.array([dev.addr(da), dev.addr(db)]), 4, np.float32, op)
        backend.synchronize()
        assert np.array_equal(dev.download(out, np.float32), fn(a, b), equal_nan=True)


def test_copy_table_packs_and_unpacks_like_cpu(gpu, cpu):
    backend, dev = gpu
    rng = np.random.default_rng()
    sizes = [int(s) for s in rng.integers(0, 70_000, 40)] + [1, 3, 16, 4 << 20]
    src = rng.integers(0, 256, sum(sizes) + 4096, dtype=np.uint8)
    d_src, d_packed = dev.upload(src), dev.poisoned(sum(sizes) + 4096, np.uint8)
    s_off = np.cumsum([0] + sizes[:-1]) + rng.integers(0, 64, len(sizes)).cumsum()  # unaligned, disjoint
    s_off = np.minimum(s_off, src.size - np.array(sizes))
    d_off = np.cumsum([0] + sizes[:-1]) + 7  # odd destination alignment
    host_packed = np.full(d_packed.shape, 0xFF, np.uint8)
    rows = np.array([[dev.addr(d_src) + s, dev.addr(d_packed) + d, n] for s, d, n in zip(s_off, d_off, sizes)])
    host_rows = np.array([[src.ctypes.data + s, host_packed.ctypes.data + d, n]
                          for s, d, n in zip(s_off, d_off, sizes)])
    backend.copy_table(rows)
    cpu.copy_table(host_rows)
    backend.synchronize()
    assert _same_bits(dev.download(d_packed, np.uint8), host_packed)
    d_back = dev.poisoned(src.size, np.uint8)  # unpack to 16-byte aligned offsets
    back_off = np.cumsum([0] + [-(-n // 16) * 16 for n in sizes[:-1]])
    backend.copy_table(np.array([[dev.addr(d_packed) + d, dev.addr(d_back) + b, n]
                                 for d, b, n in zip(d_off, back_off, sizes)]))
    backend.synchronize()
    back = dev.download(d_back, np.uint8)
    for b, s, n in zip(back_off, s_off, sizes):
        assert _same_bits(back[b:b + n], src[s:s + n])


@pytest.mark.parametrize("name", supported_names())
def test_scale_copy_table_and_scale_match_cpu(gpu, cpu, name):
    backend, dev = gpu
    dt = dtype_from_name(name)
    rng = np.random.default_rng()
    host = _random(rng, 300_001, dt)
    factor = 3 if np.issubdtype(dt, np.integer) else float(rng.uniform(0.1, 2.0))
    d_src, d_dst = dev.upload(host), dev.poisoned(host.size, np.uint16 if dt.itemsize == 2 else dt)
    splits = [0, 1, 77_777, 300_001]
    rows = np.array([[dev.addr(d_src) + a * dt.itemsize, dev.addr(d_dst) + a * dt.itemsize, b - a]
                     for a, b in itertools.pairwise(splits)])
    ref = np.empty_like(host)
    backend.scale_copy_table(rows, dt, factor)
    cpu.scale_copy_table(np.array([[host.ctypes.data, ref.ctypes.data, host.size]]), dt, factor)
    backend.synchronize()
    assert _same_bits(dev.download(d_dst, dt), ref)
    backend.scale(d_src, factor)
    cpu.scale(host, factor)
    backend.synchronize()
    assert _same_bits(dev.download(d_src, dt), host)


@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16])
def test_casts_match_cpu(gpu, cpu, half):
    backend, dev = gpu
    rng = np.random.default_rng()
    bits = rng.integers(0, 2**32, 500_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([bits, (rng.standard_normal(100_000) * 1e3).astype(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 5.96e-8, 2.98e-8], np.float32)])
    d_x, d_h = dev.upload(x), dev.poisoned(x.size, np.uint16 if half is ml_dtypes.bfloat16 else half)
    ref = np.empty(x.size, half)
    backend.cast(d_x, d_h)
    cpu.cast(x, ref)
    backend.synchronize()
    assert _same_bits(dev.download(d_h, half), ref)  # nan payloads included: same conversion code
    d_back, back_ref = dev.poisoned(x.size, np.float32), np.empty(x.size, np.float32)
    backend.cast(d_h, d_back)
    cpu.cast(ref, back_ref)
    backend.synchronize()
    assert _same_bits(dev.download(d_back, np.float32), back_ref)
