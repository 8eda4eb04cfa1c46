"""The benchmarks' shared timing: measured things take turns, so a slow stretch of a shared host falls
on all of them alike."""

import numpy as np

from tunelab.bench import common


class OneRank:
    """A communicator of one rank (what timed_iterations asks of MPI)."""

    def Barrier(self):
        pass

    def Allreduce(self, send, recv, op=None):
        recv[...] = send


def test_turns_rotate_and_give_each_op_its_iterations_and_warmup(monkeypatch):
    monkeypatch.setattr(common, "REWARM_MAX_S", 1e9)  # (every op short: each turn re-warms)
    calls, checked = [], []
    ops = [(lambda n=n: calls.append(n), None) for n in "abc"]
    times = common.interleaved_iterations(OneRank(), ops, iters=10, warmup=2, rounds=4,
                                          before=lambda i: calls.append(f"<{i}"), after=checked.append)
    assert [t.size for t in times] == [10, 10, 10]
    ran = [c for c in calls if not c.startswith("<")]
    assert ran[:6] == list("aabbcc")  # each op's own warm-up first
    marks = [c for c in calls if c.startswith("<")]
    turns = [m for k, m in enumerate(marks) if k == 0 or marks[k - 1] != m]
    assert turns == ["<0", "<1", "<2", "<1", "<2", "<0", "<2", "<0", "<1", "<0", "<1", "<2"]  # rotating
    # shares of 3, 3, 2, 2 iterations, each turn with one untimed iteration first
    assert sum(1 for c in ran if c == "a") == 2 + 10 + 4
    # every timed iteration, and only those, is poisoned before and checked after (a re-warm's result,
    # or one call's, stood for the turn's timed calls that wrote nothing)
    assert marks.count("<0") == 10 and checked == [int(m[1]) for m in marks]
    timed_a = [k for k, c in enumerate(calls) if c == "a"][2:]  # (after its warm-up)
    poisoned = [k for k, c in enumerate(calls) if c == "<0"]
    assert all(k - 1 in poisoned for k in timed_a if calls[k - 1] == "<0")
    assert len([k for k in timed_a if calls[k - 1] == "<0"]) == 10  # each timed call right after its poison
    # an op whose iterations are long (a big allreduce behind a slow link) is not re-warmed: its turns
    # would cost half as much again, for caches it does not feel
    monkeypatch.setattr(common, "REWARM_MAX_S", 0.0)
    calls.clear()
    common.interleaved_iterations(OneRank(), ops, iters=10, warmup=2, rounds=4)
    assert calls.count("a") == 2 + 10


def test_a_host_that_slows_for_a_stretch_slows_every_op_alike(monkeypatch):
    """Two ops of equal cost on a host that runs at half speed for the second half of the run: taken in
    turn their mean times come out within a few percent (the stretch starts inside one turn); one after
    the other (as before) the second looked twice as slow."""
    clock = {"t": 0.0, "calls": 0}
    total = 2 * (1 + 40)  # iterations the run will make: (warm-up + timed) x 2 (a 1 s step is not re-warmed)

    def work():
        clock["calls"] += 1
        clock["t"] += 1.0 if clock["calls"] <= total / 2 else 2.0

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["t"])
    a, b = common.interleaved_iterations(OneRank(), [(work, None), (work, None)], iters=40, warmup=1, rounds=4)
    assert abs(np.mean(a) / np.mean(b) - 1.0) < 0.05
    clock.update(t=0.0, calls=0)
    total = 2 * (1 + 40)
    first = common.timed_iterations(OneRank(), work, 40, 1)
    second = common.timed_iterations(OneRank(), work, 40, 1)
    assert np.mean(second) == 2 * np.mean(first)  # (what turns are for)


def test_an_algorithm_that_writes_nothing_is_caught_though_another_wrote_the_shared_output_before():
    """bench allreduce's algorithms share one output a size: it is poisoned before each turn, so one
    that writes nothing does not pass on the result the algorithm before it left there."""
    import pytest

    pytest.importorskip("mpi4py")
    from tunelab.bench.allreduce import _measure_size

    class Comm(OneRank):
        size = 1

        def allreduce(self, value, op=None):
            return value

    class WritesNothing:
        def allreduce(self, src, out=None):
            return out

    src = common.exact_input(256, 0, 1, np.dtype(np.float32))
    expected = common.exact_sum(256, 1, np.dtype(np.float32))
    p = {"iters": 4, "warmup": 1}
    rows = _measure_size(Comm(), p, ["mpi", "ring"], src, expected, {"ring": WritesNothing()}, None, None, 1, True)
    assert [(r["algorithm"], r["wrong"]) for r in rows] == [("mpi", 0), ("ring", 256)]


def test_a_call_that_writes_nothing_is_caught_in_every_timed_iteration(monkeypatch):
    """An op that does its work only on its first call after another op's (a stale cache on repeated
    identical calls): with the output poisoned before each turn and checked after it, the turn's untimed
    re-warm wrote the result and the timed calls that wrote nothing went unseen (0 wrong).  Now every
    timed iteration is poisoned before and checked after."""
    monkeypatch.setattr(common, "REWARM_MAX_S", 1e9)  # (short ops: each turn re-warms)
    out, last, wrong = np.zeros(4), [None], [0]

    def stale():
        if last[0] != "stale":
            out[:] = 1.0
        last[0] = "stale"

    def writes():
        out[:] = 1.0
        last[0] = "writes"

    def poison(i):
        out[:] = np.nan

    def check(i):
        wrong[0] += int(np.isnan(out).any()) if i == 0 else 0

    common.interleaved_iterations(OneRank(), [(stale, None), (writes, None)], iters=8, warmup=1, rounds=2,
                                  before=poison, after=check)
    assert wrong[0] == 8  # every timed iteration of the stale op is caught


def test_the_bound_copy_uses_the_engines_cores_and_copies_every_byte():
    """The bound row was a single-threaded copy, which an engine whose reduce runs on several cores (a
    rank per 8 cores, say) could beat: it now copies with the engine's kernel threads, in pieces."""
    from types import SimpleNamespace

    from tunelab.kernels import get_backend

    from tunelab.bench.common import bound_copy

    kernels = get_backend("cpu")
    tables = []

    class Counting:
        def copy_table(self, rows):
            tables.append(rows.shape[0])
            kernels.copy_table(rows)

    src = np.random.default_rng(0).integers(0, 255, (3 << 20) + 37, dtype=np.uint8)
    for threads in (1, 4):
        out = np.zeros_like(src)
        engine = SimpleNamespace(kernel_threads=threads, kernels=Counting(), use_kernel_threads=lambda: None)
        bound_copy(src, out, engine)()
        assert np.array_equal(out, src)
    assert tables == [16]  # one thread: numpy's copy; four: sixteen pieces for the kernels' parallel copy


def test_a_one_time_first_call_cost_does_not_take_an_ops_rewarm_away(monkeypatch):
    """An op whose first call pays a one-time cost (kernels compiled, a connection made) and then runs
    in a millisecond was judged by its mean warm-up time, and lost the re-warm its short turns need
    while the other ops kept theirs."""
    clock = {"t": 0.0}
    calls = {"a": 0, "b": 0}

    def op(name):
        calls[name] += 1
        clock["t"] += 1.0 if (name == "a" and calls[name] == 1) else 0.001

    monkeypatch.setattr(common.time, "perf_counter", lambda: clock["t"])
    common.interleaved_iterations(OneRank(), [(lambda: op("a"), None), (lambda: op("b"), None)], iters=4,
                                  warmup=3, rounds=2)
    assert calls == {"a": 3 + 4 + 2, "b": 3 + 4 + 2}  # warm-up, timed, and a re-warm in each of 2 turns
