"""numba-cuda kernels under the CUDA simulator (no GPU needed), bit for bit against the CPU back end.

The simulator must be on before ``numba.cuda`` is first imported, and this pytest process imports
numba without it.  So every check runs in one child process (this file run as a script with
``NUMBA_ENABLE_CUDASIM=1``), which reports each check as "ok" or its failure; one test per check
asserts the verdict.  Under the simulator device pointers are host addresses, so the very same
pointer-table API is exercised on numpy buffers.  Inputs are tiny and grids small (block 32, at most
3 blocks), so grid-stride loops run several passes: the simulator runs each thread as a Python thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from tunelab.kernels import ReduceOp

from tunelab.dtypes import dtype_from_name, supported_names

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


# ---- the checks (run in the child process) ------------------------------------------------------

def _backends():
    from tunelab.kernels import get_backend
    from tunelab.kernels.numba_cuda import NumbaCudaBackend

    return NumbaCudaBackend(block=32, max_blocks=3), get_backend("cpu")


def _addrs(arrays) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.int64)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@check
def reduce_matches_cpu_and_numpy_for_every_dtype_and_op() -> None:
    gpu, cpu = _backends()
    for name in supported_names():
        dt = dtype_from_name(name)
        for op in ReduceOp:
            for nsrc, count in ((1, 5), (2, 257), (3, 1), (3, 390)):  # 390 > 3 blocks x 32 threads x 4
                rng = np.random.default_rng(count + nsrc)
                srcs = [rng.integers(-9, 10, count).astype(dt) for _ in range(nsrc)]
                out, ref = np.full(count, 99, dt), np.full(count, 77, dt)
                gpu.reduce(out.ctypes.data, _addrs(srcs), count, dt, op)
                cpu.reduce(ref.ctypes.data, _addrs(srcs), count, dt, op)
                stack = np.stack([s.astype(np.float64) for s in srcs])
                exact = {ReduceOp.SUM: stack.sum(0), ReduceOp.MIN: stack.min(0), ReduceOp.MAX: stack.max(0)}[op]
                where = f"{name} {op.name} nsrc={nsrc} count={count}"
                assert _same_bits(out, ref), f"differs from cpu: {where}"
                assert _same_bits(out, exact.astype(dt)), f"differs from numpy: {where}"


@check
def random_floats_match_cpu_bit_for_bit() -> None:
    # Not exact: catches any difference in accumulation type, order or rounding from the CPU kernels.
    gpu, cpu = _backends()
    rng = np.random.default_rng(2)
    for name in ("float16", "bfloat16", "float32", "float64"):
        dt = dtype_from_name(name)
        srcs = [(rng.standard_normal(200) * 100).astype(dt) for _ in range(3)]
        outs = [np.empty(200, dt) for _ in range(4)]
        for backend, out, scaled in ((gpu, outs[0], outs[1]), (cpu, outs[2], outs[3])):
            backend.reduce(out.ctypes.data, _addrs(srcs), 200, dt, ReduceOp.SUM)
            backend.scale_copy_table(np.array([[srcs[0].ctypes.data, scaled.ctypes.data, 200]]), dt, 0.1)
        assert _same_bits(outs[0], outs[2]) and _same_bits(outs[1], outs[3]), name


@check
def reduce_output_may_alias_any_source() -> None:
    gpu, _ = _backends()
    for name in ("float32", "bfloat16", "int64"):
        dt = dtype_from_name(name)
        for alias in range(3):
            srcs = [((np.arange(301) % 11) * (j + 1)).astype(dt) for j in range(3)]
            ref = (sum(s.astype(np.float64) for s in srcs)).astype(dt)
            gpu.reduce(srcs[alias].ctypes.data, _addrs(srcs), 301, dt, ReduceOp.SUM)
            assert _same_bits(srcs[alias], ref), f"{name} alias={alias}"


@check
def half_sum_accumulates_in_float32_and_rounds_once() -> None:
    gpu, cpu = _backends()
    # 2048 + 1 + 1: pairwise fp16 rounding would give 2048, one rounding of the float32 sum gives 2050.
    # 2048 + 1 + 2**-13 + 2**-13: float32 steps each round back to 2049 (a tie -> 2048 in fp16); a wider
    # accumulator would keep 2049 + 2**-12 and give 2050.  Both results must match the CPU.
    for values, want in (([2048.0, 1.0, 1.0], 2050.0), ([2048.0, 1.0, 2.0**-13, 2.0**-13], 2048.0)):
        srcs = [np.array([v], np.float16) for v in values]
        out, ref = np.empty(1, np.float16), np.empty(1, np.float16)
        gpu.reduce(out.ctypes.data, _addrs(srcs), 1, out.dtype, ReduceOp.SUM)
        cpu.reduce(ref.ctypes.data, _addrs(srcs), 1, out.dtype, ReduceOp.SUM)
        assert out[0] == np.float16(want) and _same_bits(out, ref), (values, out, ref)


@check
def min_max_propagate_nan_like_numpy() -> None:
    gpu, _ = _backends()
    for dt in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        a = np.array([1.0, np.nan, 3.0, np.nan], dt)
        b = np.array([np.nan, 2.0, 1.0, np.nan], dt)
        for op, fn in ((ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum)):
            out = np.zeros(4, dt)
            gpu.reduce(out.ctypes.data, _addrs([a, b]), 4, out.dtype, op)
            ref = fn(a.astype(np.float32), b.astype(np.float32)).astype(dt)
            assert np.array_equal(out.astype(np.float32), ref.astype(np.float32), equal_nan=True), (dt, op)


def _cast_inputs() -> np.ndarray:
    rng = np.random.default_rng(11)
    special = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 1e-8, -3e-6, 6.1e-5, 5.96e-8,
               2.98e-8, 2.99e-8, 1.0009765625, 1.00048828125, 3.4e38, -1.5, 2.0**-24, 2.0**-25, 1e-45]
    bits = rng.integers(0, 2**32, 400, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([np.array(special, np.float32), bits[np.isfinite(bits)],
                           rng.standard_normal(100).astype(np.float32)])


@check
def casts_round_to_nearest_even_like_numpy_and_cpu() -> None:
    gpu, cpu = _backends()
    x = _cast_inputs()
    for half in (np.float16, ml_dtypes.bfloat16):
        h, h_cpu = np.full(x.size, 7, half), np.empty(x.size, half)
        gpu.cast(x, h)
        cpu.cast(x, h_cpu)
        with np.errstate(over="ignore"):
            ref = x.astype(half)
        assert _same_bits(h, ref) and _same_bits(h, h_cpu), half
        back, back_cpu = np.full(x.size, 7, np.float32), np.empty(x.size, np.float32)
        gpu.cast(h, back)
        cpu.cast(h, back_cpu)
        assert _same_bits(back, h.astype(np.float32)) and _same_bits(back, back_cpu), half
        nan = np.array([np.nan, -np.nan], np.float32)
        hn = np.zeros(2, half)
        gpu.cast(nan, hn)
        assert np.isnan(hn.astype(np.float32)).all(), half
    bf_bits = np.empty(x.size, np.uint16)  # device arrays carry bfloat16 as uint16 bits
    gpu.cast(x, bf_bits)
    assert _same_bits(bf_bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))


@check
def copy_table_packs_and_unpacks_with_any_alignment() -> None:
    gpu, cpu = _backends()
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    base = src.ctypes.data
    # (src offset, dst offset, nbytes), disjoint destinations: common 16/8/4/1-byte alignment, unaligned
    # heads and tails, an empty row, rows shorter than one word
    shapes = [(0, 0, 1000), (3, 1027, 301), (8, 1360, 77), (4, 1448, 130), (1, 1582, 97), (5, 1700, 0),
              (7, 1700, 3), (16, 1712, 16), (33, 1745, 2001), (2, 3750, 15), (12, 3780, 50)]
    assert {(s - d) % 16 == 0 for s, d, _ in shapes} == {True, False}
    assert {next(w for w in (16, 8, 4, 1) if (s - d) % w == 0) for s, d, _ in shapes} == {16, 8, 4, 1}
    dst_gpu = np.full(4096, 0xAB, np.uint8)
    dst_cpu = dst_gpu.copy()
    for dst in (dst_gpu, dst_cpu):
        rows = np.array([[base + s, dst.ctypes.data + d, n] for s, d, n in shapes], np.int64)
        (gpu if dst is dst_gpu else cpu).copy_table(rows)
    assert _same_bits(dst_gpu, dst_cpu)
    for s, d, n in shapes:
        assert _same_bits(dst_gpu[d:d + n], src[s:s + n]), (s, d, n)
    back = np.zeros(4096, np.uint8)  # unpack: the packed rows back to their own offsets
    gpu.copy_table(np.array([[dst_gpu.ctypes.data + d, back.ctypes.data + s, n] for s, d, n in shapes]))
    for s, _, n in shapes:
        assert _same_bits(back[s:s + n], src[s:s + n])
    gpu.copy_table(np.zeros((0, 3), np.int64))  # an empty table is a no-op


@check
def scale_copy_table_and_scale_match_cpu() -> None:
    gpu, cpu = _backends()
    for name in supported_names():
        dt = dtype_from_name(name)
        src = np.arange(-150, 150).astype(dt)
        outs = {}
        for k, backend in (("gpu", gpu), ("cpu", cpu)):
            dst = np.full(src.size, 3, dt)
            rows = np.array([[src.ctypes.data, dst.ctypes.data, 170],
                             [src[170:].ctypes.data, dst[170:].ctypes.data, 130]], np.int64)
            backend.scale_copy_table(rows, dt, 0.25 if name not in ("int32", "int64") else 3)
            outs[k] = dst
        assert _same_bits(outs["gpu"], outs["cpu"]), name
        inplace_gpu, inplace_cpu = src.copy(), src.copy()
        factor = -2 if name in ("int32", "int64") else 0.5
        gpu.scale(inplace_gpu, factor)
        cpu.scale(inplace_cpu, factor)
        assert _same_bits(inplace_gpu, inplace_cpu), name
        if name in ("int32", "int64"):  # a fraction of an integer: refused by both (it multiplied by 0)
            for backend in (gpu, cpu):
                try:
                    backend.scale(inplace_cpu, 0.5)
                    raise AssertionError(f"{name} * 0.5 was not refused")
                except ValueError as exc:
                    assert "integer types take whole factors only" in str(exc), exc
            assert np.array_equal(inplace_cpu, src.astype(np.int64) * -2), name
    work = np.arange(-150, 150).astype(np.float32)
    bf_bits = work.astype(dtype_from_name("bfloat16")).view(np.uint16).copy()
    gpu.scale(bf_bits, 0.375)  # uint16 device arrays are bfloat16 bits
    assert _same_bits(bf_bits, (work * np.float32(0.375)).astype(dtype_from_name("bfloat16")).view(np.uint16))


@check
def reduce_bcast_writes_the_reduction_to_every_destination_like_the_cpu_path() -> None:
    """The shared-GPU kernel: each row's sources combined in order, scaled like unpacking (the sum
    rounded to the dtype first; a factor of 0 too), written to every destination; the reference is the CPU reduce
    followed by the CPU scale-copy, i.e. the staged path's own steps."""
    gpu, cpu = _backends()
    for name in supported_names():
        dt = dtype_from_name(name)
        for op in ReduceOp:
            for factor in (None, 1 / 3, 0.0) if name not in ("int32", "int64") and op == ReduceOp.SUM else (None,):
                rng = np.random.default_rng(len(name) + int(op))
                counts = (5, 390, 0, 1)
                srcs = [[rng.integers(-9, 10, c).astype(dt) for _ in range(3)] for c in counts]
                dsts = [[np.full(c, 7, dt) for _ in range(2)] for c in counts]
                table = np.array([[c, *_addrs(s), *_addrs(d)] for c, s, d in zip(counts, srcs, dsts)], np.int64)
                gpu.reduce_bcast(gpu.upload_table(table), 3, 2, max(counts), dt, op, factor)
                for c, s, d in zip(counts, srcs, dsts):
                    want = np.empty(c, dt)
                    cpu.reduce(want.ctypes.data, _addrs(s), c, dt, op)
                    if factor is not None and c:
                        cpu.scale_copy_table(np.array([[want.ctypes.data] * 2 + [c]], np.int64), dt, factor)
                    for out in d:
                        assert _same_bits(out, want), (name, op, factor, c)


@check
def reduce_bcast_scales_a_float16_average_before_its_sum_rounds() -> None:
    """``pre`` (1/4 for three ranks) scales each source, rounded to float16 as the staged path packs it,
    then their sum rounds, then ``factor`` (4/3) scales it as unpacking does: sums past 65504 give numpy's
    average, not inf, and sources near the smallest normal round as packing rounds them.  A ``pre`` that
    is not a power of two, or one for a type that is not half, is refused."""
    gpu, _ = _backends()
    rng = np.random.default_rng(11)
    srcs = [(1024.0 * rng.integers(-9, 10, 37)).astype(np.float16) for _ in range(3)]
    for s in srcs:
        s[:2] = 60416.0
        s[2:8] = rng.uniform(6.2e-5, 2.4e-4, 6).astype(np.float16)
    dsts = [np.zeros(37, np.float16) for _ in range(2)]
    table = np.array([[37, *_addrs(srcs), *_addrs(dsts)]], np.int64)
    gpu.reduce_bcast(gpu.upload_table(table), 3, 2, 37, np.dtype(np.float16), ReduceOp.SUM, 4 / 3, pre=0.25)
    packed = [(x.astype(np.float32) * np.float32(0.25)).astype(np.float16).astype(np.float32) for x in srcs]
    want = ((packed[0] + packed[1] + packed[2]).astype(np.float16).astype(np.float32)
            * np.float32(4 / 3)).astype(np.float16)
    assert want[0] == 60416.0
    for out in dsts:
        assert _same_bits(out, want)
    for dt, pre in ((np.float16, 0.3), (np.float32, 0.25)):
        try:
            gpu.reduce_bcast(gpu.upload_table(table), 3, 2, 37, np.dtype(dt), ReduceOp.SUM, None, pre=pre)
            raise AssertionError(f"pre {pre} for {dt} was not refused")
        except ValueError as exc:
            assert "pre-scale must be 1, or a power of two for a half type" in str(exc), exc


@check
def bad_arguments_are_rejected() -> None:
    gpu, _ = _backends()
    for call, exc in ((lambda: gpu.copy_table(np.zeros((2, 2), np.int64)), ValueError),
                      (lambda: gpu.cast(np.zeros(3, np.float64), np.zeros(3, np.float32)), ValueError),
                      (lambda: gpu.cast(np.zeros(3, np.float32), np.zeros(4, np.float16)), ValueError),
                      (lambda: gpu.scale([1.0, 2.0], 2.0), TypeError),
                      (lambda: gpu.reduce(0, np.zeros(0, np.int64), 4, np.float32, 0), ValueError)):
        try:
            call()
        except exc:
            continue
        raise AssertionError(f"expected {exc.__name__}")


# ---- the pytest side (after the checks, so that the parameter list is complete) ----------------

@pytest.fixture(scope="module")
def sim_verdicts() -> dict[str, str]:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_numba_cuda_kernels_under_simulator(sim_verdicts: dict[str, str], name: str) -> None:
    assert sim_verdicts.get(name) == "ok", sim_verdicts.get(name, "check did not run")


def _run_all() -> dict[str, str]:
    verdicts = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            verdicts[name] = "ok"
        except Exception:  # noqa: BLE001 (each check's failure is collected and reported)
            verdicts[name] = traceback.format_exc(limit=3)
    return verdicts


if __name__ == "__main__":
    import numba

    assert numba.config.ENABLE_CUDASIM, "run with NUMBA_ENABLE_CUDASIM=1"
    print(json.dumps(_run_all()))
