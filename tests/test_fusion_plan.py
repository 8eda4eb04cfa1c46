"""The fusion planner: explicit expectations and invariants over random inputs."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tunelab.engine.fusion import Entry, plan_buckets


def idx(buckets):
    return [list(b.indices) for b in buckets]


def test_dtype_look_ahead_fuses_interleaved_dtypes_into_one_buffer_each():
    entries = [Entry(100, "float16"), Entry(100, "float32"), Entry(100, "float16"), Entry(100, "float32")]
    buckets = plan_buckets(entries, 1000, True)
    assert idx(buckets) == [[0, 2], [1, 3]]
    assert [b.dtype for b in buckets] == ["float16", "float32"]


def test_threshold_closes_buffers_and_zero_means_no_fusion():
    entries = [Entry(40, "float32") for _ in range(5)]
    assert idx(plan_buckets(entries, 100, True)) == [[0, 1], [2, 3], [4]]
    assert idx(plan_buckets(entries, 0, True)) == [[0], [1], [2], [3], [4]]
    big = [Entry(10, "float32"), Entry(500, "float32"), Entry(10, "float32")]
    assert idx(plan_buckets(big, 100, True)) == [[0], [1], [2]]


def test_without_group_fusion_groups_never_merge_and_are_whole():
    entries = [Entry(60, "float32", None), Entry(60, "float32", 1), Entry(60, "float32", 1),
               Entry(60, "float32", 2), Entry(60, "float32", None)]
    assert idx(plan_buckets(entries, 100, False)) == [[0], [1, 2], [3], [4]]
    assert idx(plan_buckets(entries, 1000, False)) == [[0, 4], [1, 2], [3]]
    assert idx(plan_buckets(entries, 1000, True)) == [[0, 1, 2, 3, 4]]


entry_st = st.builds(Entry, st.integers(0, 5000), st.sampled_from(["float16", "float32", "int64"]),
                     st.one_of(st.none(), st.integers(0, 3)))


@settings(max_examples=300, deadline=None)
@given(st.lists(entry_st, max_size=40), st.integers(0, 20000), st.booleans())
def test_plan_invariants(entries, threshold, group_fusion):
    buckets = plan_buckets(entries, threshold, group_fusion)
    seen = sorted(i for b in buckets for i in b.indices)
    assert seen == list(range(len(entries)))  # every tensor exactly once
    for b in buckets:
        assert list(b.indices) == sorted(b.indices)  # submission order kept inside a buffer
        assert {entries[i].dtype for i in b.indices} == {b.dtype}
        assert b.nbytes == sum(entries[i].nbytes for i in b.indices)
        groups = {entries[i].group for i in b.indices}
        if not group_fusion:
            assert len(groups) == 1
        whole_group = not group_fusion and entries[b.indices[0]].group is not None
        if len(b.indices) > 1 and not whole_group:
            assert b.nbytes <= threshold
    assert [b.indices[0] for b in buckets] == sorted(b.indices[0] for b in buckets)
