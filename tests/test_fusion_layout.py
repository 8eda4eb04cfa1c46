"""A bucket's row tables (what the copy kernels execute), carried out with numpy on real arrays and
compared with the tensors themselves: packing any range of a bucket into a buffer, unpacking it back,
and the direct copies of a call that reduces nothing (one rank)."""

import ctypes

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tunelab.engine.fusion import Layout


def run_rows(rows: np.ndarray, itemsize: int = 1) -> None:
    """Execute (src, dst, count) rows as the kernels do: ``count`` items of ``itemsize`` bytes each."""
    for src, dst, count in rows.tolist():
        ctypes.memmove(dst, src, count * itemsize)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=7), st.data())
def test_pack_and_unpack_any_range_match_the_concatenated_tensors(sizes, data):
    rng = np.random.default_rng(len(sizes))
    srcs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    dsts = [np.full(n, np.nan, np.float32) for n in sizes]
    layout = Layout(srcs, dsts)
    whole = np.concatenate(srcs)
    assert layout.count == whole.size
    lo = data.draw(st.integers(0, whole.size))
    hi = data.draw(st.integers(lo, whole.size))
    buf = np.full(max(hi - lo, 1), np.nan, np.float32)
    run_rows(layout.pack_rows(lo, hi, buf.ctypes.data), 4)  # (rows count elements: the kernels' unit)
    np.testing.assert_array_equal(buf[:hi - lo], whole[lo:hi])
    run_rows(layout.unpack_rows(lo, hi, buf.ctypes.data), 4)
    got = np.concatenate(dsts)
    np.testing.assert_array_equal(got[lo:hi], whole[lo:hi])
    assert np.isnan(got[:lo]).all() and np.isnan(got[hi:]).all()  # nothing outside the range written


def test_copy_rows_copy_each_output_that_is_not_its_input_and_nothing_else():
    rng = np.random.default_rng(3)
    srcs = [rng.standard_normal(n) for n in (5, 0, 9, 4)]
    dsts = [np.full(5, np.nan), np.empty(0), srcs[2], np.full(4, np.nan)]  # the third is in place
    rows = Layout(srcs, dsts).copy_rows()
    assert rows.dtype == np.int64 and rows.shape == (2, 3)  # (copy rows count bytes)
    run_rows(rows)
    for s, d in zip(srcs, dsts):
        np.testing.assert_array_equal(d, s)
    assert Layout([srcs[2]], [srcs[2]]).copy_rows().shape == (0, 3)
