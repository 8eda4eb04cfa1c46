"""The allreduce engine on 1-4 ranks (real host and emulated nodes), against numpy references."""

import pytest
from mpi_harness import run_case, run_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_dtype_op_size_layout_is_bit_exact(n):
    results = run_ok("engine_sweep", n, limit_s=400)
    for rank, res in enumerate(results):
        assert res["checks"] > 300
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_random_batches_groups_and_knobs(n):
    for rank, res in enumerate(run_ok("random_batches", n, seed=100 + n, rounds=20)):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


def test_random_batches_with_a_fenced_node_barrier():
    """The node barrier as it runs on CPUs without x86's store order (aarch64): a memory barrier
    (MPI_Win_sync in a passive epoch) around every flag.  The engine stays exact through it, and the
    epoch is opened and closed with the window (this host is x86: what it checks is that the fenced
    protocol works, not that unfenced code would fail on aarch64)."""
    for rank, res in enumerate(run_ok("random_batches", 3, seed=7, rounds=12, fenced=True)):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.parametrize("n", [2, 4])
def test_grouped_results_do_not_depend_on_companions_or_threshold(n):
    assert all(r["all_identical"] for r in run_ok("grouped_determinism", n))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_recursive_doubling_leaves_every_rank_the_same_bits(n):
    for rank, res in enumerate(run_ok("doubling_same_bits", n, limit_s=120)):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_small_call_takes_a_short_route_to_the_same_bits(n):
    for rank, res in enumerate(run_ok("short_route_same_bits", n, limit_s=120)):
        assert res["checks"] >= 18
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_float16_average_does_not_overflow_where_only_its_sum_would(n):
    """Two ranks averaging 40000 and 30000 get 35000, not inf: a float16 average is scaled before the
    sum by the smallest power of two at least the rank count (exact), the rest after."""
    for rank, res in enumerate(run_ok("half_average_near_the_top", n, limit_s=300)):
        assert res["checks"] >= 36
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_ring_keeps_stream_order_when_reductions_run_late(n):
    """A CUDA-aware MPI reads device memory at once while reductions run on a stream; the ring syncs
    wherever MPI reads what a reduction wrote (tests/mpi_cases.py::case_ring_on_a_stream)."""
    for rank, res in enumerate(run_ok("ring_on_a_stream", n, limit_s=120)):
        assert res["checks"] == 24
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.parametrize("n,ranks_per_node", [(2, None), (3, None), (2, 1), (3, 1), (4, 2)])
def test_disagreeing_ranks_get_one_clear_error_everywhere(n, ranks_per_node):
    """On one node and between (emulated) nodes, where small calls take a shorter route than large ones."""
    results = run_ok("mismatch", n, limit_s=120, ranks_per_node=ranks_per_node)
    expect = {"shape": "float32[100]", "dtype": "float64", "count": "number of tensors differs",
              "op": "op differs", "route": "float32[262144]", "fusion": "knobs in force",
              "oneshot": "knobs in force", "segment": "knobs in force"}
    for kind, fragment in expect.items():
        messages = {res[kind]["message"] for res in results}
        assert len(messages) == 1, f"{kind}: ranks report different messages {messages}"
        (message,) = messages
        assert message.startswith("ranks disagree on allreduce"), message
        assert fragment in message and "\n" not in message
        if kind == "op":
            assert "sum" in message and "max" in message
        for res in results:
            assert res[kind]["elapsed_s"] < 10
            assert res[kind]["recovered"]


@pytest.mark.parametrize("n,ranks_per_node", [(2, None), (3, 1)])
def test_one_ranks_invalid_arguments_fail_that_call_everywhere_and_leave_the_next_calls_right(n, ranks_per_node):
    results = run_ok("one_rank_invalid", n, limit_s=120, ranks_per_node=ranks_per_node)
    own = {"op": "ValueError: unknown reduction 'product'", "out": "ValueError: output 0 must be",
           "outs": "ValueError: 1 outputs for 2 tensors", "order": ": float32[", "object": ": float32[",
           "alias": "ValueError: output 1 overlaps input 0 of the same call",
           "group": "ValueError: a group id is None or an integer >= 0, got -1"}
    for key in results[0]:
        kind = key.split("-")[0]
        assert own[kind] in results[-1][key]["message"], (key, results[-1][key])
        if kind in ("order", "object"):  # (a type the engine does not reduce is agreed as such: a mismatch everywhere)
            for res in results:
                assert f"rank {n - 1}: an unsupported dtype" in res[key]["message"], res[key]
                assert res[key]["after"] == [10.0 * n + sum(range(n)), 20.0 * n + sum(range(n))], (key, res[key])
            continue
        for res in results[:-1]:
            assert res[key]["message"].startswith("RankMismatchError: ranks disagree on allreduce call"), res[key]
            assert (f"rank {n - 1}: not an op" if kind == "op" else f"rank {n - 1}: invalid") in res[key]["message"]
        for res in results:
            # (by hand: ranks 0..n-1 pass 10k + rank)
            assert res[key]["after"] == [10.0 * n + sum(range(n)), 20.0 * n + sum(range(n))], (key, res[key])
            assert res[key]["elapsed_s"] < 10


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_skips_a_runtime_collective_and_shuts_down_is_seen_leaving_and_shutdown_still_ends(n):
    results = run_ok("skipped_collectives", n, limit_s=120)
    names = {"broadcast": "broadcast weights", "allgather": "allgather_object", "barrier": "barrier"}
    for rank, res in enumerate(results[:-1]):
        for kind, what in names.items():  # (within the 1 s grace once the coordinator saw it leave; the 3 s timeout before)
            said = f"RankExitedError: rank {rank}: rank {n - 1} shut down (a script that ended or raised) while this rank "
            assert res[kind]["message"] == said + f"waited for it in {what}", (kind, res[kind])
            assert res[kind]["elapsed_s"] < 2.9, (kind, res[kind])
        # a rank shutting down counts as joined: the others' join returns, and every shutdown finishes
        assert res["join"]["message"] == "" and res["join"]["elapsed_s"] < 10, res["join"]
    assert all(v["message"] == "" for v in results[-1].values())


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_skips_a_collective_and_goes_on_never_gets_another_calls_data(n):
    """Every call of the runtime's first exchange carries the call's kind and name: the last rank's
    second broadcast meets rank 0's first one and both fail (RankMismatchError naming both calls); no
    call returns another call's data; the engine's allreduce is unaffected."""
    results = run_ok("skipped_then_next", n, limit_s=120)
    for rank, res in enumerate(results):
        for kind, got in res.items():
            assert got["after"] == [float(n)] * 4, (rank, kind, got)
            for name, how, value in got["calls"]:
                if how == "ok":  # (a call that returned returned its own, right result)
                    assert name == "second" and value == [1.0, 1.0, 1.0], (rank, kind, got)
                else:
                    assert how in ("RankMismatchError", "CollectiveTimeoutError", "TunelabError"), (rank, kind, got)
            if rank == n - 1:  # (it skipped the first call: its second met the others' first)
                assert got["calls"][0][1] == "RankMismatchError", (rank, kind, got)
                assert "ranks are in different collectives" in got["calls"][0][2], (rank, kind, got)
                assert f"rank {n - 1}: broadcast B" in got["calls"][0][2], (rank, kind, got)


def test_invalid_requests_fail_on_every_rank_with_a_reason():
    results = run_ok("bad_requests", 2, limit_s=120)
    for res in results:
        assert "average needs a floating dtype" in res["average-int"]
        assert "complex64" in res["dtype"]
        assert "unknown reduction 'product'" in res["op"]
        assert "ranks_per_node=3" in res["rpn"]
        assert "non-native byte order" in res["byteorder"]
        assert "output 1 overlaps input 0 of the same call" in res["alias"]
        assert "output 0 overlaps input 1 of the same call" in res["twice"]
        assert "output 0 overlaps its input without being in its place" in res["shifted"]
        assert "output 0 overlaps input 1 of the same call" in res["views_in_place"], res["views_in_place"]
        assert "must be C-contiguous and writeable" in res["readonly_one"]
        assert "must be a C-contiguous, writeable" in res["readonly_group"]
        assert res["after_readonly"] == [3.0] * 4  # (1 + 2, by hand: the coordinator still works)


def test_a_rank_that_skips_a_call_gives_a_timeout_not_a_hang():
    run = run_case("skipped_call", 2, 60, timeout_s=3.0)
    waiting = run.results[0]
    assert waiting is not None, run.stderr[-2000:]
    assert "did not reach allreduce call #1 within 3 s" in waiting["message"]
    assert 2.5 < waiting["elapsed_s"] < 15
    assert run.returncode != 0  # the job is ended, not left hanging


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_makes_its_engine_late_gives_a_timeout_not_a_hang_and_the_next_engine_sums(n):
    """The engine's setup was collective without a timeout: a rank that never made its engine (dead, or
    never calling init()) left the others waiting there for ever."""
    results = run_ok("late_engine", n, limit_s=90, timeout_s=3.0)
    for res in results[:-1]:
        assert "other ranks did not reach the engine's setup (init) within 3 s" in res["message"], res
        assert res["elapsed_s"] < 10, res
    assert "did not reach the engine's settings (init) within 3 s" in results[-1]["message"], results[-1]
    assert all(res["total"] == [n * (n + 1) / 2] * 3 for res in results), results


def test_an_error_on_one_rank_stops_its_engine_and_a_growing_staging_times_out_instead_of_hanging():
    results = run_ok("error_on_one_rank_before_the_staging_grows", 2, limit_s=90, timeout_s=3.0)
    waiting, failed = results
    assert waiting["call"].startswith("CollectiveTimeoutError: rank 0 of its node: peers did not reach "
                                      "growing the node's shared staging within 3 s"), waiting
    assert waiting["call_s"] < 10, waiting
    assert failed["call"] == "RuntimeError: injected: the copy-out failed on rank 1", failed
    for res, why in ((waiting, "CollectiveTimeoutError"), (failed, "RuntimeError: injected")):
        assert res["next"].startswith(f"this engine stopped after an error in allreduce call #2 ({why}"), res
        assert "takes no more calls" in res["next"], res
        assert res["total"] == [3.0] * 3 and res["small"] == [3.0] * 4, res
        # a knob change that lost the one-shot staging stops the engine: no call reads the freed slots
        assert res["knobs"] == "injected: no shared memory for the one-shot staging", res
        assert res["after_knobs"].startswith("this engine stopped after an error in a knob change"), res


def test_closing_after_an_error_on_one_rank_frees_where_every_rank_closes_and_never_hangs():
    results = run_ok("close_after_an_error_on_one_rank", 2, limit_s=90, timeout_s=3.0)
    healthy, failed = results
    assert healthy["call"] == [2.0, 2.0] and failed["call"] == "injected: the copy-out failed on rank 1"
    for res in results:
        assert res["freed"] is True and res["close_s"] < 2, res  # every rank closing: agreed, and freed
        assert res["late_freed"] is False and res["late_close_s"] < 10, res  # a peer that did not come
        assert res["total"] == [3.0] * 3, res


@pytest.mark.parametrize("doubling", [False, True])
def test_a_rank_stalled_inside_a_transfer_between_nodes_ends_the_job_after_the_timeout(doubling):
    """MPI's blocking transfers between nodes cannot be interrupted: a peer that stalls inside one hung
    the job for ever (TUNELAB_TIMEOUT_S did not apply there); now the waiting rank says so in one line
    and ends the job, within the timeout and the watchdog's quarter second."""
    run = run_case("ring_stall", 2, 60, timeout_s=3.0, doubling=doubling)
    assert run.returncode != 0 and run.elapsed_s < 25, (run.returncode, run.elapsed_s, run.stderr[-2000:])
    what = "recursive doubling" if doubling else "a step of the ring's reduce-scatter"
    # (the line is on stderr too, but MPI_Abort may end the job before mpiexec has forwarded it)
    assert run.results[0] is not None, run.stderr[-2000:]
    assert f"rank 0: nothing came within 3 s in {what} between nodes" in run.results[0]["line"], run.results[0]


def test_a_dead_rank_ends_the_job_with_an_error():
    run = run_case("dead_rank", 3, limit_s=90)
    assert run.returncode != 0
    assert run.elapsed_s < 90


@pytest.mark.parametrize("n", [1, 4])
def test_topology_splits(n):
    results = run_ok("topology", n)
    for rank, res in enumerate(results):
        for k_text, (lrank, lsize, crank, csize, sizes, host_rank) in res.items():
            k = n if k_text == "None" else int(k_text)
            assert host_rank == rank  # one real host: emulated nodes do not renumber it (it picks the GPU)
            assert lsize == min(k, n - (rank // k) * k)
            assert lrank == rank % k
            assert crank == rank // k
            assert sizes == [min(k, n - i * k) for i in range(-(-n // k))]
            assert csize == sum(1 for s in sizes if s > lrank)


def test_knobs_the_topology_refuses_allocate_nothing_and_the_next_engine_works():
    """4 ranks as nodes of 3 and 1 with hierarchical on: refused on every rank before any shared memory
    is allocated, the split communicators freed (a process that retries with other knobs does not pile
    up windows); an engine made next sums 1 + 2 + 3 + 4."""
    for res in run_ok("refused_knobs_allocate_nothing", 4, ranks_per_node=3):
        assert "same number of ranks on every node" in res["error"] and "[3, 1]" in res["error"], res
        assert res["barriers"] == 0 and res["freed"] == [True, True, True], res
        assert res["total"] == [10.0] * 3


def test_ranks_made_with_other_knobs_refuse_on_every_rank_instead_of_mixing_their_data():
    """Buckets are planned from each rank's own knobs: a fusion threshold set on one rank alone paired one
    rank's bucket with another's and summed the wrong elements without a word (and timed out on the
    other rank)."""
    for res in run_ok("settings_that_differ", 2):
        assert res["knob"].startswith("ranks disagree on the engine's settings (fusion_threshold_bytes: "
                                      "rank 0: off, rank 1: 64MiB)"), res["knob"]
        assert "TUNELAB_* environment" in res["knob"]
        assert "ranks_per_node: rank 0: None, rank 1: 1" in res["layout"], res["layout"]
        assert res["total"] == [3.0] * 3


def test_emulated_link_carries_the_cross_node_bytes_at_its_bandwidth():
    gbps, nbytes = 0.5, 4 * (1 << 20)  # 62.5 MB/s; 1Mi float32 on 4 ranks = 2 nodes of 2
    results = run_ok("emulated_link", 4, gbps=gbps, count=1 << 20, limit_s=120)
    for res in results:
        assert res["failures"] == [] and res["unlinked"]
    # Flat ring 0-1-2-3: ranks 0 and 2 receive from the other node, 2*(N-1)/N of the data each.
    assert [r["flat"]["bytes"] for r in results] == [nbytes * 3 // 2, 0, nbytes * 3 // 2, 0]
    # Hierarchical: every rank sends its half shard across, 2 nodes -> it receives half a shard
    # twice (reduce-scatter and allgather); both ranks of a node share the node's one link.
    assert [r["hierarchical"]["bytes"] for r in results] == [nbytes // 2] * 4

    def seconds(nbytes_through: int) -> float:
        return nbytes_through * 8 / (gbps * 1e9)

    # A rank that receives through the link waits for it; two sharing one link wait for both.
    assert min(results[r]["flat"]["elapsed_s"] for r in (0, 2)) >= seconds(nbytes * 3 // 2)
    assert max(r["hierarchical"]["elapsed_s"] for r in results) >= seconds(nbytes)
