"""CPU kernels against numpy / ml_dtypes references."""

import ml_dtypes
import numpy as np
import pytest
from tunelab.kernels import ReduceOp, get_backend

from tunelab.dtypes import dtype_from_name, supported_names

K = get_backend("cpu")
NP_OPS = {ReduceOp.SUM: None, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def addrs(arrays):
    return np.array([a.ctypes.data for a in arrays], dtype=np.intp)


@pytest.mark.parametrize("name", supported_names())
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("nsrc", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [1, 4095, 4097, 10_001])
def test_reduce_matches_numpy(name, op, nsrc, count):
    dt = dtype_from_name(name)
    rng = np.random.default_rng(count * 10 + nsrc)
    srcs = [rng.integers(-9, 10, count).astype(dt) for _ in range(nsrc)]
    out = np.full(count, 99, dt)
    K.reduce(out.ctypes.data, addrs(srcs), count, dt, op)
    if op is ReduceOp.SUM:
        ref = np.sum([s.astype(np.float64) for s in srcs], axis=0).astype(dt)
    else:
        ref = NP_OPS[op].reduce(srcs)
    assert np.array_equal(out.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("alias", [0, 1, 2])
def test_reduce_output_may_alias_any_source(alias):
    srcs = [np.arange(9000, dtype=np.float32) * (j + 1) for j in range(3)]
    ref = srcs[0] + srcs[1] + srcs[2]
    K.reduce(srcs[alias].ctypes.data, addrs(srcs), 9000, srcs[0].dtype, ReduceOp.SUM)
    assert np.array_equal(srcs[alias], ref)


def test_half_sum_accumulates_in_float32_and_rounds_once():
    # 2048 + 1 + 1 in float16: pairwise rounding gives 2048, one rounding of the float32 sum gives 2050
    srcs = [np.array([2048.0], np.float16), np.array([1.0], np.float16), np.array([1.0], np.float16)]
    out = np.empty(1, np.float16)
    K.reduce(out.ctypes.data, addrs(srcs), 1, out.dtype, ReduceOp.SUM)
    assert out[0] == np.float16(2050.0)


def test_min_max_propagate_nan_like_numpy():
    a = np.array([1.0, np.nan, 3.0], np.float32)
    b = np.array([np.nan, 2.0, 1.0], np.float32)
    for op, ref in ((ReduceOp.MIN, np.minimum(a, b)), (ReduceOp.MAX, np.maximum(a, b))):
        out = np.empty(3, np.float32)
        K.reduce(out.ctypes.data, addrs([a, b]), 3, out.dtype, op)
        assert np.array_equal(out, ref, equal_nan=True)


def _interesting_floats() -> np.ndarray:
    rng = np.random.default_rng(7)
    special = [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 1e-8, -3e-6, 6.1e-5,
               5.96e-8, 2.98e-8, 2.99e-8, 1.0009765625, 1.00048828125, 3.4e38]
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = bits[np.isfinite(bits)]
    return np.concatenate([np.array(special, np.float32), rng.standard_normal(100_000).astype(np.float32),
                           bits]).astype(np.float32)


@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16])
def test_casts_round_to_nearest_even_like_numpy(half):
    x = _interesting_floats()
    h = np.empty(x.size, half)
    K.cast(x, h)
    with np.errstate(over="ignore"):  # numpy warns when it rounds to inf, as it should
        ref = x.astype(half)
    assert np.array_equal(h.view(np.uint16), ref.view(np.uint16))
    back = np.empty_like(x)
    K.cast(h, back)
    assert np.array_equal(back.view(np.uint32), h.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16])
def test_cast_keeps_nan(half):
    x = np.array([np.nan, -np.nan], np.float32)
    h = np.empty(2, half)
    K.cast(x, h)
    assert np.isnan(h.astype(np.float32)).all()


def test_copy_table_packs_and_unpacks_many_tensors_in_one_call():
    rng = np.random.default_rng(3)
    tensors = [rng.standard_normal(n).astype(np.float32) for n in (1, 7, 1000, 3, 65536)]
    buf = np.zeros(sum(t.size for t in tensors) * 4 + 3, np.uint8)  # +3: unaligned destinations too
    base = buf.ctypes.data + 3
    offsets = np.cumsum([0] + [t.nbytes for t in tensors])
    rows = np.array([[t.ctypes.data, base + o, t.nbytes] for t, o in zip(tensors, offsets)])
    K.copy_table(rows)
    packed = buf[3:].view(np.uint8)
    assert np.array_equal(packed, np.concatenate(tensors).view(np.uint8))
    outs = [np.empty_like(t) for t in tensors]
    K.copy_table(np.array([[base + o, t.ctypes.data, t.nbytes] for t, o in zip(outs, offsets)]))
    for t, o in zip(tensors, outs):
        assert np.array_equal(t, o)


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64"])
def test_scale_copy_table_multiplies_while_copying(name):
    dt = dtype_from_name(name)
    src = np.arange(-50, 50).astype(dt)
    dst = np.empty_like(src)
    K.scale_copy_table(np.array([[src.ctypes.data, dst.ctypes.data, src.size]]), dt, 0.25)
    work = np.float64 if name == "float64" else np.float32
    assert np.array_equal(dst, (src.astype(work) * work(0.25)).astype(dt))
    K.scale(src, 0.5)
    assert np.array_equal(src, (np.arange(-50, 50).astype(work) * work(0.5)).astype(dt))


def test_scale_and_cast_refuse_what_they_cannot_write_as_asked():
    """Each of these was silent: int32 * 0.5 gave zeros, a read-only array (here a view of immutable
    bytes) was written through its address, and a cast into a transposed view filled a reshaped copy."""
    ints = np.array([3, 5, -7], np.int32)
    with pytest.raises(ValueError, match="cannot scale int32 by 0.5"):
        K.scale(ints, 0.5)
    K.scale(ints, 2)
    assert ints.tolist() == [6, 10, -14]
    frozen = np.float32([1, 2]).tobytes()
    with pytest.raises(ValueError, match="writeable"):
        K.scale(np.frombuffer(frozen, np.float32), 2.0)
    assert np.frombuffer(frozen, np.float32).tolist() == [1.0, 2.0]
    src = np.arange(8, dtype=np.float32).reshape(4, 2)
    for dst in (np.zeros((2, 4), np.float16).T, np.zeros((4, 2), np.float16)[::-1]):
        with pytest.raises(ValueError, match="C-contiguous, writeable destination"):
            K.cast(src, dst)
    readonly = np.zeros((4, 2), np.float16)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="C-contiguous, writeable destination"):
        K.cast(src, readonly)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="shape"):
        K.copy_table(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="cast"):
        K.cast(np.zeros(3, np.float64), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="unknown kernel backend"):
        from tunelab.kernels import get_backend as gb

        gb("fpga")


def test_a_thread_budget_goes_parallel_only_for_calls_big_enough_to_pay_for_the_pool():
    """A parallel kernel wakes the thread pool (tens of microseconds with passive waiting): calls that
    move little stay serial whatever the budget, and both builds give numpy's bits."""
    from tunelab.kernels.cpu import _KERNELS, CpuBackend

    backend = CpuBackend()
    backend.set_threads(2)
    threads = getattr(backend._threads, "n", 1)
    if threads < 2:
        pytest.skip("Numba allows one thread here (NUMBA_NUM_THREADS=1)")
    small = 1000
    large = threads * backend.parallel_min_bytes // 12 + 1  # a 2-source float32 reduce moves 12 B an element
    assert backend._k("_reduce", small * 12) is _KERNELS["_reduce"][0]
    assert backend._k("_reduce", large * 12) is _KERNELS["_reduce"][1]
    assert backend._k("_copy_table", lambda: 2 * small * 4) is _KERNELS["_copy_table"][0]
    backend.set_threads(1)
    assert backend._k("_reduce", large * 12) is _KERNELS["_reduce"][0]  # a budget of one is serial
    rng = np.random.default_rng(5)
    for count in (small, large):
        backend.set_threads(2)
        a, b = (rng.integers(-9, 10, count).astype(np.float32) for _ in range(2))
        out = np.empty(count, np.float32)
        backend.reduce(out.ctypes.data, addrs([a, b]), count, out.dtype, ReduceOp.SUM)
        assert np.array_equal(out, a + b)
        copy = np.empty_like(a)
        backend.copy_table(np.array([[a.ctypes.data, copy.ctypes.data, a.nbytes]]))
        assert np.array_equal(copy, a)
