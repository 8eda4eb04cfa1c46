"""The background coordinator: stalls, timelines (engine level, no framework)."""

import json

import pytest
from mpi_harness import run_case, run_ok

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
def test_stalled_tensor_is_named_on_every_rank(n):
    results = run_ok("coordinator_stall", n, limit_s=90, stall_s=3.0)
    for rank, res in enumerate(results):
        assert "stalled for more than 3 s" in res["message"], (rank, res)
        assert "'lonely' (submitted by ranks [0], missing on ranks " in res["message"]
        # and what only each other rank submitted (its probes, named by the time), each set of ranks once
        for other in range(1, n):
            assert res["message"].count(f"(submitted by ranks [{other}], missing on ranks ") == 1, res["message"]
        assert res["message"].index("'lonely'") < res["message"].index("'probe")  # (fewest submitters first)
        assert res["elapsed_s"] < 30


def test_timeline_is_chrome_trace_json_with_allreduces_and_knob_changes(tmp_path):
    path = tmp_path / "timeline.json"
    results = run_ok("coordinator_timeline", 2, path=str(path))
    assert results[0]["changes"] == results[1]["changes"]  # applied at the same cycle everywhere
    assert [c[1] for c in results[0]["changes"]] == [1024, 2048, 3072]
    events = json.loads(path.read_text())
    names = [e["name"] for e in events]
    assert names.count("knobs") == 3 and "allreduce" in names
    spans = [e for e in events if e["name"] == "allreduce"]
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["args"]["tensors"] >= 1 for e in spans)
    assert sum(e["args"]["tensors"] for e in spans) == 12


@pytest.mark.parametrize("n", [1, 2])
def test_a_coordinator_stays_on_its_cycle_while_tensors_keep_coming(n):
    """Gradients 5 ms apart within 20 ms cycles: the coordinator keeps cycling through the pass instead
    of going idle after each cycle that emptied its queue (then every cycle's first submit had to wake
    it: a cost on the framework's thread, about 15 times in this pass); after a pause it does go idle,
    and the next submit wakes it once."""
    results = run_ok("coordinator_stays_awake_through_a_backward_pass", n, limit_s=90)
    for rank, res in enumerate(results):
        assert res["wrong"] == 0, (rank, res)
        assert res["cycles_pass"] >= 10, (rank, res)  # (0.3 s of 20 ms cycles)
        assert res["wakes_pass"] <= 2, (rank, res)  # the pass's first submit, and slack for a slow host
        assert res["wakes_after"] == 1, (rank, res)


@pytest.mark.parametrize("n", [1, 2])
def test_tensors_submitted_within_a_cycle_share_one_engine_call(n):
    """A submit wakes an idle coordinator, but the cycle still starts on the cycle grid: 8 tensors
    submitted 2 ms apart within a 40 ms cycle are fused into one call, or two where a cycle boundary
    falls among them (cycling at once reduced each of them alone: 8 calls a burst).  A blocking call
    (submit, then wait) is not held back by the grid, nor by a rank that submits it later."""
    results = run_ok("coordinator_fuses_a_cycle", n, limit_s=90)
    for rank, res in enumerate(results):
        assert res["wrong"] == 0, (rank, res)
        assert all(1 <= c <= 3 for c in res["calls"]), (rank, res["calls"])
        # ... while a thread waiting on a handle starts the cycle at once: blocking calls one after another
        # take far less than the 40 ms cycle each (without the hurry, about one cycle each)
        assert sorted(res["blocking_s"])[3] < 0.015, (rank, res["blocking_s"])
        # the last rank submits 10 ms after the others: they are done about then, not a 40 ms cycle later
        assert sorted(res["staggered_s"])[1] < 0.030, (rank, res["staggered_s"])
        # 0.5 s with every rank blocked on a tensor only it submitted: about 0.5 s / 40 ms cycles, not a spin
        assert res["stuck_cycles"] <= 30, (rank, res["stuck_cycles"])


@pytest.mark.parametrize("n", [2])
def test_a_name_reused_with_another_call_is_negotiated_again(n):
    """The name cache keeps a name's shape, dtype and op: a request that no longer matches them is
    negotiated in full, so ranks that changed it alike get the sum at its new shape (a joined rank
    contributes zeros of that shape), and ranks that disagree get RankMismatchError instead of a hang
    or a reduction of different lengths.  Calls the engine cannot reduce, or that name a tensor twice,
    are refused at submit, and the coordinator serves the next call."""
    results = run_ok("coordinator_changed_call", n, limit_s=120)
    for rank, res in enumerate(results):
        assert res["wrong"] == 0, (rank, res)
        assert res["first"] == [4] and res["grown"] == [6] and res["after_mismatch"] == [3], (rank, res)
        assert res["mismatch"].startswith("RankMismatchError: ranks disagree on tensor 'm'"), (rank, res)
        first, *rest = res["group_size"]
        assert first.startswith("RankMismatchError: ranks disagree on tensor 'g.0'") and "g (3 tensors)" in first
        assert "g (2 tensors)" in first and res["after_group"] == [2] and res["group_size_s"] < 10, (rank, res)
        assert all(e.startswith("RankMismatchError: ranks disagree on tensor 'g.") for e in rest), (rank, rest)
        if rank < n - 1:  # g.2, which only these ranks hold, fails with its group instead of stalling
            assert rest[-1].endswith("so tensor 'g.2' of its group is not reduced either"), rest
        assert res["int_average"].startswith("TypeError: average needs a floating dtype, got int32"), res
        assert res["int8"].startswith("TypeError: tunelab cannot reduce dtype int8"), res
        assert res["twice"].startswith("ValueError: tensor 'a' is named twice in one call"), res
        assert res["after_refusals"] == [2] and res["wait0"] == n and res["wait_inf"] == n, (rank, res)
        # (read from the calling thread: a cycle may have added its name and not yet forgotten; 33 without)
        assert res["largest_cache"] <= 10 and res["often_kept"], (rank, res)
        assert res["capacity"] >= 16 and all(f"w{j}" in res["names"] for j in range(10)), (rank, res)
        assert res["names"] == results[0]["names"], (rank, res["names"])  # the same ids on every rank
        if rank < n - 1:
            assert res["joined_shape"] == [7], (rank, res)
        else:
            assert 0 <= res["last"] < n - 1, (rank, res)  # one of the ranks that joined after it


def test_a_peer_whose_coordinator_stopped_mid_cycle_fails_the_others_with_a_timeout():
    """Rank 1's coordinator fails applying a knob change; rank 0, with a new name to negotiate in the
    same cycle, fails after the engine's timeout (3 s) instead of blocking in the exchange of names for
    ever (the exchanges after a cycle's first one had no timeout)."""
    run = run_case("coordinator_peer_stops", 2, 60, timeout_s=3.0)
    first = run.results[0]  # (rank 1, its coordinator failed, waits until rank 0 has ended the job)
    assert first is not None, run.stderr[-2000:]
    assert first["message"].startswith("CollectiveTimeoutError: rank 0: other ranks did not reach the "
                                       "exchange of new names"), first
    assert first["elapsed_s"] < 15, first
    assert run.returncode != 0  # the job is ended, not left hanging


def test_a_rank_that_timed_out_shuts_down_without_waiting_for_the_rank_it_timed_out_on():
    """After a timeout the runtime's shutdown (the exit hook's) freed the engine's windows, which waits
    for every rank of the node without a timeout: the rank that reported the error could never exit."""
    run = run_case("shutdown_after_a_timeout", 2, 60, timeout_s=2.0, stuck_s=8)
    first = run.results[0]
    assert first is not None, run.stderr[-2000:]  # (killed with the job while it waited, it wrote nothing)
    assert first["waited"] in ("CollectiveTimeoutError", "StallError"), first
    assert first["shutdown"] == first["waited"] and first["shutdown_s"] < 2.0, first


@pytest.mark.parametrize("n", [2, 3])
def test_a_coordinator_error_on_one_rank_alone_lets_every_rank_shut_down_and_init_again(n):
    """Rank 1's coordinator failed on its own (out of memory applying knobs) and the others timed out:
    rank 1's shutdown freed the engine's windows, which waits for every rank of the node, and the others
    (having timed out) never came: it could never exit.  Now the ranks agree at shutdown on whether to
    free, nobody waits past the timeout, and the next init() works; shutting the same runtime down again
    returns (it raised an MPI error on the freed communicator)."""
    results = run_ok("runtime_one_rank_fails", n, limit_s=90, timeout_s=3.0)
    for rank, res in enumerate(results):
        want = "MemoryError" if rank == 1 else "CollectiveTimeoutError"
        assert res["coordinator"] == want and res["shutdown"] == want, (rank, res)
        assert res["shutdown_s"] < 8 and res["closed"] is False, (rank, res)
        assert res["total"] == [n * (n + 1) / 2] * 3, (rank, res)
        # a second shutdown of the same runtime, after the failed one or a clean one, does nothing
        assert res["again"] == "ok" and res["healthy_again"] == "ok", (rank, res)


@pytest.mark.parametrize("n", [2, 3])
def test_submits_that_share_memory_knob_requests_groups_and_scalars(n):
    """Against the sum over ranks: separate submits of one cycle that share memory each reduce what
    they held when submitted (one fused call read them after writing them: 4 for 2, q = 4 for 200);
    a second knob request before a cycle keeps the first (it was dropped); a cached group one member of
    which changed on one rank only fails whole (its other member was reduced alone); 0-d stays 0-d."""
    results = run_ok("coordinator_shared_memory_and_requests", n, limit_s=120)
    total = n * (n + 1) / 2
    for rank, res in enumerate(results):
        assert res["want"] == [total, 100 * total]
        assert res["twice"] == [[total], [total]] and res["in_and_out"] == [[total], [total]], (rank, res)
        assert res["swapped"] == [[total], [100 * total]], (rank, res)  # each handle: its own sum
        assert "overlaps its input without being in its place" in res["shifted"], (rank, res["shifted"])
        # the max reads what the tensor held, not the sum another op's call wrote in place first
        assert res["two_ops"] == [[total], [float(n)], [float(n)], [total]], (rank, res)
        assert res["knobs"] == [5.0, 1 << 20], (rank, res)
        assert res["group_first"] == [str([float(n)] * 4)] * 2, (rank, res)
        assert res["group_changed"] == ["RankMismatchError"] * 2, (rank, res)
        assert res["scalar"] == [[], total] and res["second_shutdown"] == "ok", (rank, res)


@pytest.mark.parametrize("n", [2, 3])
def test_a_timeline_rank_0_cannot_write_fails_init_on_every_rank_and_the_next_init_works(tmp_path, n):
    """Rank 0 alone opens the timeline: a path it cannot write left the other ranks waiting in the
    runtime's next collective for good (the job ended only when the launcher's timeout did)."""
    (tmp_path / "a-file").write_text("not a folder")
    results = run_ok("runtime_unwritable_timeline", n, limit_s=90, folder=str(tmp_path))
    for rank, res in enumerate(results):
        assert res["error"].startswith("TunelabError: " + ("" if rank == 0 else "rank 0: ")
                                       + f"cannot write the timeline {tmp_path}/a-file/timeline.json"), (rank, res)
        assert res["after"] == [n * (n + 1) / 2], (rank, res)


def test_a_second_init_with_other_settings_is_refused_naming_them():
    for res in run_ok("init_twice", 2, limit_s=60):
        assert res["same"] and res["sum"] == [3.0, 3.0], res
        assert res["other"].startswith("UsageError: tunelab is initialized already, with other settings: "), res
        assert "cycle_time_ms=7.0 (running: 5.0)" in res["other"] and "timeout_s=30.0 (running: 20.0)" in res["other"]
        assert "segment_bytes pinned (running: not pinned)" in res["pinned"], res
