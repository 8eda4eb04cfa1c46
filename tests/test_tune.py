"""tunelab tune end to end (gradient replay, 2 ranks) and auto-loaded profiles in training jobs."""

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_harness import run_ok
from scenario_text import tiny_replay

pytest.importorskip("skopt")

SCENARIO = tiny_replay()


def tunelab(*args, env=None, timeout=600, cwd=None):
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


@pytest.mark.mpi
def test_a_knob_a_tunelab_variable_sets_is_pinned_not_searched(tmp_path):
    """TUNELAB_SEGMENT_BYTES runs the engine on 16 KiB segments: tune searched segments anyway, and
    its first reference block ran on 16 KiB under the default's 4 MiB label.  (The scenario's time
    budget, far too short for 3 blocks, gives way to the --budget asked for.)"""
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO.replace("[tuning]\n", "[tuning]\ntime_budget_s = 0.5\n"))
    out = tmp_path / "tune.json"
    proc = tunelab("tune", "--scenario", str(scenario), "--budget", "3", "--no-store", "--no-report", "--json", str(out),
                   cwd=tmp_path, env={**os.environ, "TUNELAB_SEGMENT_BYTES": "16384", "TUNELAB_HOME": str(tmp_path / "h")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert "segment_bytes" not in result["searched"], result["searched"]
    assert {s["knobs"]["segment_bytes"] for s in result["samples"]} == {16384}
    assert "budget 3 exploration blocks (the default's included)" in proc.stdout and "s of tuning" not in proc.stdout
    assert sum(s["phase"] == "explore" for s in result["samples"]) >= 3, result["samples"]


@pytest.mark.mpi
def test_tune_measures_default_first_stores_trials_and_warm_starts(tmp_path):
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "tune.json"
    proc = tunelab("tune", "--scenario", str(scenario), "--seed", "3", "--json", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    reports = list((tmp_path / "reports").glob("tune-*.html"))  # written by default, path printed
    assert len(reports) == 1 and f"# report: reports/{reports[0].name}" in proc.stdout
    assert "tiny" in reports[0].read_text() or "resnet50" in reports[0].read_text()
    result = json.loads(out.read_text())
    samples = result["samples"]
    assert samples[0]["role"] == "reference" and samples[0]["knobs"]["fusion_threshold_bytes"] == 64 << 20
    phases = [s["phase"] for s in samples]
    explored = phases.count("explore")
    assert phases[:explored] == ["explore"] * explored and set(phases[explored:]) <= {"remeasure"}
    assert explored in (5, 6) and samples[explored - 1]["role"] == "reference"  # budget 5, then closing the bracket
    refs = [i for i, s in enumerate(samples) if s["role"] == "reference"]
    from tunelab.tuning.plan import Plan

    gap = Plan().reference_every + 1  # the default between every reference_every candidates
    assert max(b - a for a, b in itertools.pairwise(refs)) <= gap
    if result["adopted"]:
        iv = result["gain_interval"]
        assert iv["low"] >= 1.01 and result["gain"] == pytest.approx(iv["gain"])
    else:
        assert result["best"]["knobs"] == result["default"]["knobs"] and result["gain"] == 1.0
    assert result["samples_to_lock"] == len(samples) and result["steps_to_lock"] >= 2 * len(samples)  # measure_steps = 2
    assert "[   1/5] explore   reference" in proc.stdout and "gain   :" in proc.stdout
    assert "stored : profile" in proc.stdout and "locked after" in proc.stdout
    told = sum(1 for s in samples if s["phase"] == "explore" and s["role"] == "candidate")
    listing = tunelab("profiles", "list")
    assert listing.returncode == 0 and "resnet50" in listing.stdout
    again = tunelab("tune", "--scenario", str(scenario), "--budget", "2", "--no-store", "--no-report")
    assert again.returncode == 0, again.stderr
    assert f"warm start: {told} stored trials" in again.stdout
    # A damaged trial in the store stops every rank at once with rank 0's error, rather than leaving the
    # other rank training alone until it times out waiting for rank 0 (and naming a tensor instead).
    import sqlite3

    store = tmp_path / "tunelab-home" / "profiles.sqlite"
    with sqlite3.connect(store) as conn:
        conn.execute("UPDATE trials SET score = 'abc' WHERE id = (SELECT MAX(id) FROM trials)")
    # (the ranks hung for good before: a hang fails on the timeout, not on a clock in the assertion)
    damaged = tunelab("tune", "--scenario", str(scenario), "--budget", "2", "--no-store", "--no-report",
                      timeout=120)
    assert damaged.returncode == 1, damaged.stderr[-2000:]
    assert "is damaged (the score of its trial" in damaged.stderr and "stalled" not in damaged.stderr


@pytest.mark.mpi
def test_a_store_that_fails_while_the_run_measures_leaves_the_result_written_and_exits_1(tmp_path):
    """The store refuses the run's trials (a trigger raises, as a full disk or a profile deleted
    meanwhile would): the run tunes on, says so once, writes its result as JSON, says it is not
    stored, and exits 1 with one line; the ranks are not stopped by rank 0's store."""
    import os
    import sqlite3

    from tunelab.profiles import FILE_NAME, ProfileStore

    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    store = Path(os.environ["TUNELAB_HOME"]) / FILE_NAME
    ProfileStore(store)
    with sqlite3.connect(store) as conn:
        conn.execute("CREATE TRIGGER full BEFORE INSERT ON trials BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    out = tmp_path / "tune.json"
    proc = tunelab("tune", "--scenario", str(scenario), "--seed", "3", "--json", str(out), "--no-report",
                   timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "the result was not stored in the profile store:" in lines[0] \
        and "disk full" in lines[0], proc.stderr
    assert proc.stdout.count("the profile store took no more of this run (") == 1
    assert "stored : not stored: " in proc.stdout and "locked after" in proc.stdout
    result = json.loads(out.read_text())
    assert "disk full" in result["store_error"] and "profile_id" not in result and result["samples"]
    assert ProfileStore(store).best(ProfileStore(store).profiles()[0].key) is None  # (no best stored after it)


@pytest.mark.parametrize("args,fragment", [
    (["tune", "--budget", "3", "--time-budget", "5"], "not allowed with argument"),
    (["tune", "--model", "no-such-model"], "no-such-model"),
    (["tune", "--budget", "0"], "expected a positive integer"),
    (["tune", "--knob", "cycle_time_ms=0"], "out of range"),
])
def test_bad_tune_input_is_one_line(args, fragment):
    proc = tunelab(*args, timeout=60)
    assert proc.returncode == 2  # usage errors, argparse's and the scenario loader's alike
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_broken_scenario_file_names_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(SCENARIO.replace("measure_steps = 2", "measure_steps = \"two\""))
    proc = tunelab("tune", "--scenario", str(bad), timeout=60)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "bad.toml" in line and "measure_steps" in line


@pytest.mark.mpi
def test_training_jobs_load_the_tuned_profile_and_keep_pinned_knobs(tmp_path):
    results = run_ok("torch_autoload", 2, limit_s=200, env_home=str(tmp_path / "home"))
    r0, r1 = results
    assert r0["first"].startswith("tunelab: no tuned profile for tiny / torch / 2 ranks")
    assert r0["second"].startswith("tunelab: loaded tuned profile")
    assert "(measured 1.250x the default)" in r0["second"]
    assert r0["knobs"] == r1["knobs"]  # applied by every rank
    assert r0["knobs"]["fusion_threshold_bytes"] == 1 << 20 and r0["knobs"]["segment_bytes"] == 1 << 16
    assert r0["knobs"]["cycle_time_ms"] == 7.0  # pinned by the job: the profile's 3.0 must not win
    assert r1["second"] == ""  # only rank 0 logs
    assert r0["repeat"] == ""  # one lookup per model and job


@pytest.mark.mpi
def test_a_job_finds_its_profile_whatever_its_parameter_groups_and_one_rank_failing_fails_every_rank(tmp_path):
    """A profile is keyed by the model's parameter shapes as ``tune`` sees them (``parameters()``); a job
    whose optimizer groups them otherwise (weight decay apart from the biases) got another key and never
    loaded it.  A profile stored under tunelab's earlier, ordered key still loads; a best with a damaged
    interval is one warning line on a job that trains on; and a lookup that raised on rank 0 left the
    other ranks waiting out their timeout: now every rank raises it, at once, and the job stays usable."""
    import time

    start = time.monotonic()
    r0, r1 = run_ok("torch_profile_keys", 2, limit_s=200, env_home=str(tmp_path / "home"))
    assert time.monotonic() - start < 100  # (a rank waiting out its timeout would take minutes)
    grouped, old, bad = r0["logs"]
    assert r0["groups_reorder"] and r0["old_keys_differ"]  # (the cases do test what they say)
    assert grouped.startswith("tunelab: loaded tuned profile") and "for grouped / torch" in grouped, grouped
    assert old.startswith("tunelab: loaded tuned profile") and "for old / torch" in old, old
    assert bad.startswith("tunelab: warning:") and "profile 3 is damaged" in bad and "gain_low" in bad, bad
    assert bad.endswith("keeping the knobs of old / torch's profile"), bad  # not "using default knobs"
    assert r0["knobs"] == r1["knobs"] == {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0,
                                          "segment_bytes": 1 << 16}
    for res in (r0, r1):
        assert res["raised"] is not None and "profile lookup failed on rank 0" in res["raised"], res["raised"]
        assert "a fault in the store's reader" in res["raised"]
        assert res["after"] == [3.0, 3.0]
    assert r1["logs"] == ["", "", ""]


@pytest.mark.mpi
def test_a_job_with_the_retune_setting_retunes_and_saves_what_it_found(tmp_path):
    r0, r1 = run_ok("torch_retune", 2, limit_s=240, env_home=str(tmp_path / "home"))
    assert "retune on: watching" in r0["log"] and "re-opening the search" in r0["log"], r0["log"]
    # checked first against the gain the stored profile claims (1.25x)
    assert "a check measured it at" in r0["log"] and "where 1.250x was claimed" in r0["log"], r0["log"]
    assert r0["decisions"] >= 2 and "saved to profile" in r0["log"]
    loaded = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    assert {k: r0["best"][k] for k in loaded} != loaded  # the next job does not load the slow knobs
    assert r0["outcome"].startswith("retuned") and r0["run_id"].startswith("retune-") and r0["trials"] >= 3
    # stored as samples/s, as the profile's tune run measured them (4 a step), not as steps/s
    assert "(4 samples a step, as the profile's trials were measured)" in r0["log"], r0["log"]
    # (a block's geometric mean rate times its mean step time: 4 at least, more the more its steps differ)
    per_step = sorted(r0["per_step"])
    assert per_step[0] > 3.99 and 4.0 <= per_step[len(per_step) // 2] < 4.6, per_step
    assert r1["log"] == ""  # only rank 0 watches and speaks


@pytest.mark.mpi
def test_the_retune_watch_never_stops_training_and_times_only_its_own_model(tmp_path):
    r0, r1 = run_ok("torch_retune_edges", 2, limit_s=240, env_home=str(tmp_path / "home"))
    damaged, two, broken = r0["logs"]
    # trials that cannot be read: one line, no watch, and every rank trained (no hang, no error)
    assert "retune off: the profile's trials could not be read" in damaged and "is damaged" in damaged, damaged
    assert not r0["watched_damaged"]
    # two models, one of them with a profile: the watch timed that one's 12 steps, not b's as well
    assert "retune on: watching" in two and r0["counted"][0] == 12, (two, r0["counted"])
    # b has no profile of its own, and a's knobs stay in force: its line says so, not "default knobs"
    assert "no tuned profile for b / torch / 2 ranks on this hardware: keeping the knobs of a / torch's profile" \
        in two, two
    # another model's profile changed the knobs: the watch ends, saying why
    assert r0["counted"][1] is True and "retune off: c's profile changed the knobs" in two, two
    # an error inside the watch: said once, the watch ends, training went on
    assert r0["counted"][2] is True and broken.count("retune off after an error in the watch") == 1, broken
    assert "a fault inside the watch" in broken
    assert r1["logs"] == ["", "", ""]  # only rank 0 watches and speaks


def test_bench_train_step_times_are_the_slowest_ranks_as_its_samples_per_second_are():
    """A row's step time and samples/s are both the slowest rank's: without communication ranks do not
    wait for each other, and a slower peer (here 50 ms a step, against this rank's ~0) sets both."""
    from types import SimpleNamespace

    from tunelab.bench.train import _timed

    peer = np.full(4, 0.05)
    comm = SimpleNamespace(Barrier=lambda: None, allreduce=lambda v, op: max(v, 0.2),
                           Allreduce=lambda mine, out, op: np.copyto(out, np.maximum(mine, peer)))
    total, per_step = _timed(comm, lambda: None, 4, 1)
    assert total == 0.2 and per_step == [0.05] * 4


def test_bench_train_rotates_the_order_of_systems_each_round():
    from collections import Counter

    from tunelab.bench.train import rotated

    for systems in (["tunelab-tuned", "tunelab", "ddp", "no-comm"], ["tunelab-tuned", "tunelab", "ddp"]):
        n = len(systems)
        rounds = n if n % 2 == 0 else 2 * n
        orders = [rotated(systems, r) for r in range(rounds)]
        assert all(sorted(o) == sorted(systems) for o in orders)
        positions = Counter((o[k], k) for o in orders for k in range(n))
        assert set(positions.values()) == {rounds // n}  # every system in every position, equally often
        after = Counter((o[k], o[k + 1]) for o in orders for k in range(n - 1))
        assert len(after) == n * (n - 1) and set(after.values()) == {rounds // n}  # after every other one
        assert rotated(systems, rounds) == orders[0]
    # the default 2 rounds of 4 systems: no system follows the same one twice (rotating by one did)
    two = [rotated(["a", "b", "c", "d"], r) for r in range(2)]
    pairs = [(o[k], o[k + 1]) for o in two for k in range(3)]
    assert len(set(pairs)) == len(pairs) and two[0][0] != two[1][0]
    assert rotated([], 1) == []


def _replayed_result(speed, drift=0.05, strategy="tunelab", budget=None):
    """A tune result as ``tunelab tune`` builds it, from the driver run on a synthetic landscape."""
    from types import SimpleNamespace

    from tunelab.knobs import Knobs, MiB
    from tunelab.tuning.driver import Driver
    from tunelab.tuning.plan import Plan
    from tunelab.tuning.replay import Drift, Objective, simulate, synthetic
    from tunelab.tuning.result import summarise
    from tunelab.tuning.space import search_space
    from tunelab.tuning.strategies import make_strategy

    space = search_space({"segment_bytes": 4 * MiB}, 1, base=Knobs(cycle_time_ms=1.0))  # the default: slow here
    grid = {"fusion_threshold_bytes": [0, MiB, 16 * MiB, 64 * MiB], "cycle_time_ms": [0.5, 1.0, 8.0, 32.0]}
    land = synthetic("t", space, grid, speed, noise=0.02, seed=1)
    plan = Plan() if budget is None else Plan(budget_samples=budget)
    driver = simulate(Driver(space, lambda e: make_strategy(strategy, space, e), plan),
                      Objective(land, 0, Drift(drift, 60.0, 0)))
    workload = SimpleNamespace(name="tiny", signature="sig")
    return summarise(driver, [10.0, 11.0], workload, space, 12.0, SimpleNamespace(size=2, num_nodes=1))


def test_a_lock_from_exploration_reports_and_stores_the_blocks_it_rests_on(tmp_path):
    """Locked without re-measuring (random search's pick is a measured configuration, and the gain is
    far above the noise): the locked score is the mean of its exploration blocks, and the store takes it."""
    from tunelab.profiles import ProfileKey, ProfileStore

    result = _replayed_result(lambda k: 2.0 if k.cycle_time_ms >= 8.0 else 1.0, drift=0.01, strategy="random")
    assert result["adopted"] and "simultaneous" in result["decision"]
    assert not [s for s in result["samples"] if s["phase"] == "remeasure"]
    mine = [s["score"] for s in result["samples"] if s["knobs"] == result["best"]["knobs"] and s["role"] == "candidate"]
    assert mine and result["best"]["score"] == pytest.approx(sum(mine) / len(mine))
    assert result["best"]["score"] / result["default"]["score"] == pytest.approx(2.0, rel=0.1)
    store = ProfileStore(tmp_path / "p.db")
    pid = store.upsert_profile(ProfileKey("hw", "sig", "torch", 2), "host", {}, "tiny")
    iv = result["gain_interval"]
    store.set_best(pid, result["best"]["knobs"], result["best"]["score"], result["default"]["score"], 0.01, "run",
                   gain_interval=(iv["gain"], iv["low"], iv["high"]), steps=result["steps_to_lock"], outcome=result["outcome"])
    assert store.best(ProfileKey("hw", "sig", "torch", 2)).gain == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize("fast", [True, False])
def test_result_and_report_state_the_gain_with_its_interval_cost_and_drift(fast, tmp_path, capsys):
    from tunelab.report.build import build_html
    from tunelab.tuning.report_text import print_tune_summary

    result = _replayed_result((lambda k: 2.0 if k.cycle_time_ms >= 8.0 else 1.0) if fast else (lambda k: 1.0))
    assert result["adopted"] is fast and result["samples_to_lock"] == len(result["samples"])
    print_tune_summary(result)
    out = capsys.readouterr().out
    if fast:
        iv = result["gain_interval"]
        assert 1.01 <= iv["low"] <= iv["gain"] <= iv["high"] and iv["gain"] == pytest.approx(2.0, rel=0.1)
        assert f"{iv['gain']:.3f}x [{iv['low']:.3f}, {iv['high']:.3f}]" in out
    else:
        assert result["gain"] == 1.0 and "default kept" in out and result["best"] == result["default"]
    assert ("exploration ended: converged" in out) or ("exploration ended: budget of" in out)
    assert "drift  : the default's blocks ranged over" in out
    ratio = 10.5 / result["default"]["score"]  # the replay's final steps: 10 and 11 samples/s
    # ... and against the default's last two reference blocks, the nearest in time (their geometric mean)
    last = [s["score"] for s in result["samples"] if s["role"] == "reference"][-2:]
    recent = math.sqrt(last[0] * last[1])
    final = next(line for line in out.splitlines() if line.startswith("final  :"))
    assert final.startswith(f"final  : 10.50 samples/s, the median of 2 steps of the locked configuration after "
                            f"tuning: {10.5 / recent:.2f}x the default's last 2 reference blocks ({recent:.2f}), "
                            f"{ratio:.2f}x its mean while tuning")
    assert final.endswith("so the difference is the host's") is (not fast)
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(result))
    html = build_html("r", [], [], [path])
    top = html.index("Locked a tuned configuration" if fast else "Kept the default configuration")
    assert top < html.index("Drift seen") < html.index("trials")
    row = html.index("default (its last 2 reference blocks, just before the final run)</td>")
    assert f"<td>{recent:.4g}</td>" in html[row:row + 200]
    # a flat landscape ends with its best finalist's interval, or without a finalist (nothing expected to
    # reach the minimum gain): the report says which
    if fast or (result.get("runner_up") or {}).get("interval"):
        assert "90 % interval" in html
    else:
        assert f"Kept the default configuration ({result['decision']})" in html
    assert "% of its mean" in html and "{&#39;" not in html


def test_a_budget_of_one_block_is_summarised_in_the_singular_and_claims_no_drift(capsys):
    from tunelab.tuning.report_text import print_tune_summary

    result = _replayed_result(lambda k: 2.0 if k.cycle_time_ms >= 8.0 else 1.0, budget=1)
    print_tune_summary(result)
    out = capsys.readouterr().out
    assert "# 1 block in " in out and "locked after 1 block, " in out and "budget of 1 exploration block spent" in out
    assert "(mean of its 1 reference block)" in out
    assert "drift  : one reference block: no drift can be seen; " in out and "ranged over" not in out
    assert "default kept (no candidate was measured" in out


def test_bench_train_notes_say_which_knobs_the_tuned_system_ran():
    from tunelab.bench.train import _knob_notes
    from tunelab.knobs import Knobs

    default = Knobs().as_dict()
    tuned = {**default, "cycle_time_ms": 8.0}
    same = _knob_notes({"tunelab": default, "tunelab-tuned": dict(default)}, {"rounds": 1})
    assert same[0].endswith("the same knobs as tunelab (no stored tuning changed them)")
    assert "one round" in same[1]
    other = _knob_notes({"tunelab": default, "tunelab-tuned": tuned}, {"rounds": 3})
    assert other == ["tunelab-tuned ran fusion=64MiB cycle=8ms segment=4MiB"]
    assert _knob_notes({"tunelab": default}, {"rounds": 2}) == []  # no tuned system: nothing to say


def test_bench_train_says_a_loaded_profile_once_per_run_not_once_per_round(capsys):
    """The tuned system loads its profile in every round (each round starts tunelab afresh): its line is
    printed in the first round only."""
    from tunelab.bench.train import _said_once

    seen: dict = {}
    for _ in range(3):
        with _said_once(seen):
            print("tunelab: loaded tuned profile 1")
        seen["cycle_time_ms"] = 100.0  # what a phase records of the knobs it ran
    assert capsys.readouterr().out.count("loaded tuned profile") == 1


def test_tune_progress_counts_each_search_against_its_own_budget(capsys):
    """A retune re-opens the search with a fresh budget: its blocks are numbered from 1 again, not all
    shown as the 'close' past the first search's budget."""
    import dataclasses

    from tunelab.knobs import Knobs
    from tunelab.tuning.plan import Sample
    from tunelab.tuning.run import _progress

    show = _progress(2, None)
    block = Sample(0, "explore", "reference", Knobs(), 10.0, 0.01, 3, 0.3, 0.3)
    for epoch in (0, 1):
        for _ in range(3):  # two blocks of budget, then the closing reference
            show(dataclasses.replace(block, epoch=epoch))
    show(dataclasses.replace(block, epoch=1, phase="remeasure"))
    labels = [line.split("]")[0] + "]" for line in capsys.readouterr().out.splitlines()]
    assert labels == ["[   1/2]", "[   2/2]", "[ close]"] * 2 + ["[     r]"]  # one column wide
    show = _progress(100, None)
    show(block)
    out = capsys.readouterr().out
    # hierarchical is a knob of a job of several nodes: said there, on or off; on one node only if on
    assert out.startswith("[  1/100] explore") and "hier" not in out, out
    _progress(100, None, hier=True)(block)
    _progress(100, None)(dataclasses.replace(block, knobs=Knobs(hierarchical=True)))
    lines = capsys.readouterr().out.splitlines()
    assert " segment=4MiB hier=off " in lines[0] and " segment=4MiB hier=on " in lines[1], lines


def test_knob_sizes_that_are_not_round_are_not_printed_as_round():
    from tunelab.knobs import Knobs
    from tunelab.tuning.run import describe

    assert describe(Knobs(fusion_threshold_bytes=1025 * 1024, cycle_time_ms=2.5, segment_bytes=4 << 20)).startswith(
        "fusion=1.00MiB cycle=2.5ms segment=4MiB")
    assert "fusion=68.1MiB" in describe(Knobs(fusion_threshold_bytes=69712 * 1024))
    assert "fusion=516KiB" in describe(Knobs(fusion_threshold_bytes=516 * 1024))
    # three integer digits: no bare decimal point ("228.MiB"), and still not a round size's spelling
    assert "fusion=228.3MiB cycle" in describe(Knobs(fusion_threshold_bytes=(228 << 20) + 300_000))
    assert "fusion=1000.0MiB cycle" in describe(Knobs(fusion_threshold_bytes=(1000 << 20) + 4096))
    assert "fusion=100.0MiB cycle" in describe(Knobs(fusion_threshold_bytes=int(99.96 * (1 << 20))))
    assert "segment=12.0MiB" in describe(Knobs(segment_bytes=(12 << 20) + 4096))


def test_a_loaded_profile_whose_tuning_kept_the_default_names_the_knobs_it_applies(tmp_path, monkeypatch):
    """The knobs pinned while that run tuned are its default: loading it says which ones it applies."""
    from types import SimpleNamespace

    from tunelab.knobs import Knobs
    from tunelab.profiles import ProfileKey, ProfileStore
    from tunelab.runtime import Runtime

    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path))
    key = ProfileKey("h" * 16, "m", "torch", 2)
    store = ProfileStore()
    pid = store.upsert_profile(key, "host", {"nodes": 1}, "tiny")
    job = SimpleNamespace(topology=SimpleNamespace(size=2), config=SimpleNamespace(pinned=set(), knobs=Knobs()),
                          profile_keys=lambda signature, framework, legacy=None: [key], _knobs_from="")
    store.set_best(pid, Knobs(segment_bytes=1 << 20).as_dict(), 99.0, 99.0, 0.02, "r", steps=30,
                   outcome="retuned: budget exhausted, default kept")
    line, knobs, _ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert line == (f"tunelab: loaded profile {pid} for tiny / torch / 2 ranks: its tuning kept the default knobs "
                    "(no configuration cleared the minimum gain; budget exhausted); that run's default had "
                    "segment_bytes=1MiB (pinned then), applied here")
    assert knobs["segment_bytes"] == 1 << 20
    store.set_best(pid, Knobs().as_dict(), 99.0, 99.0, 0.02, "r", steps=3, outcome="every knob is pinned")
    line, *_ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert line.endswith("its tuning kept the default knobs (every knob was pinned)")
    # stored before the cycle's default went from 1 to 10 ms: that run's default cycle gives way to today's
    kept = Knobs(cycle_time_ms=1.0, segment_bytes=1 << 20).as_dict()
    monkeypatch.setattr("tunelab.profiles._now", lambda: "2026-11-27T10:00:00.000+00:00")
    store.set_best(pid, kept, 99.0, 99.0, 0.02, "r", steps=30, outcome="budget exhausted, default kept")
    line, knobs, _ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert line.endswith("that run's default had segment_bytes=1MiB (pinned then), applied here; its "
                         "cycle_time_ms=1, tunelab's default then, is 10 now, and that applies"), line
    # today's value is in what the job applies, not left out (an earlier profile's cycle would stay)
    assert knobs["cycle_time_ms"] == 10.0 and knobs["segment_bytes"] == 1 << 20
    # a time with another offset is read as the instant it names: 03:00 at +01:00 is before 02:01:20 UTC
    monkeypatch.setattr("tunelab.profiles._now", lambda: "2026-11-28T03:00:00+01:00")
    store.set_best(pid, kept, 99.0, 99.0, 0.02, "r", steps=30, outcome="budget exhausted, default kept")
    assert Runtime._lookup_profile(job, "m", "torch", "tiny")[1]["cycle_time_ms"] == 10.0
    monkeypatch.setattr("tunelab.profiles._now", lambda: "2026-11-28T04:00:00+01:00")  # 03:00 UTC: after
    store.set_best(pid, kept, 99.0, 99.0, 0.02, "r", steps=30, outcome="budget exhausted, default kept")
    assert Runtime._lookup_profile(job, "m", "torch", "tiny")[1]["cycle_time_ms"] == 1.0
    # a store from before outcomes were recorded (schema 1: no outcome, no interval): a best that is its
    # run's default blocks' knobs kept the default, and is read so; one that is not is a tuned choice
    monkeypatch.setattr("tunelab.profiles._now", lambda: "2026-11-23T10:00:00.000+00:00")
    store.record_trial(pid, kept, 99.0, 0.02, 3, 1.0, "schema-1-run", "default")
    store.set_best(pid, kept, 99.0, 99.0, 0.02, "schema-1-run")
    line, knobs, _ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert "its tuning kept the default knobs (stored before tunelab recorded why)" in line, line
    assert knobs["cycle_time_ms"] == 10.0 and "tunelab's default then, is 10 now" in line
    store.set_best(pid, Knobs(cycle_time_ms=1.0, fusion_threshold_bytes=0).as_dict(), 99.0, 90.0, 0.02,
                   "schema-1-run")
    line, knobs, _ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert line.startswith(f"tunelab: loaded tuned profile {pid}") and knobs["cycle_time_ms"] == 1.0
    # the one-shot's default was 256 KiB for the first 42 minutes of that knob (1 MiB since)
    from tunelab.knobs import former_default

    assert former_default("oneshot_max_bytes", 256 << 10, "2026-11-23T08:30:00.000+00:00")
    assert not former_default("oneshot_max_bytes", 256 << 10, "2026-11-23T09:00:00.000+00:00")
    assert not former_default("oneshot_max_bytes", 256 << 10, "not a time")
    # stored since: a 1 ms cycle in it was pinned, and applies
    monkeypatch.setattr("tunelab.profiles._now", lambda: "2026-11-29T10:00:00.000+00:00")
    store.set_best(pid, kept, 99.0, 99.0, 0.02, "r", steps=30, outcome="budget exhausted, default kept")
    line, knobs, _ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert line.endswith("that run's default had cycle_time_ms=1, segment_bytes=1MiB (pinned then), applied here")
    assert knobs["cycle_time_ms"] == 1.0
    # a tuned configuration is applied as it was locked, whatever the defaults did since
    store.set_best(pid, Knobs(cycle_time_ms=1.0, fusion_threshold_bytes=0).as_dict(), 99.0, 90.0, 0.02, "r",
                   gain_interval=(1.1, 1.05, 1.15), steps=30, outcome="converged")
    line, knobs, _ = Runtime._lookup_profile(job, "m", "torch", "tiny")
    assert knobs["cycle_time_ms"] == 1.0 and "cycle_time_ms=1" in line


def test_a_warm_start_leaves_out_runs_measured_against_another_default(capsys):
    """Stored trials are ratios to their run's own default blocks: a run whose default was the 1 ms cycle
    (before the default changed) is left out, said aloud; a run against today's default is told, each
    candidate's log samples/s over the mean of that run's default blocks (by hand: 11 over 10)."""
    from types import SimpleNamespace

    from tunelab.knobs import SPECS, Knobs
    from tunelab.tuning import run

    every = tuple(SPECS)  # (every knob searched: none pinned)

    old, today = Knobs(cycle_time_ms=1.0), Knobs()
    fast = Knobs(fusion_threshold_bytes=0)

    def trial(run_id, phase, knobs, score):
        return SimpleNamespace(run_id=run_id, phase=phase, knobs=knobs.as_dict(), score=score)

    trials = [trial("a", "default", old, 8.0), trial("a", "explore", fast, 11.0), trial("a", "default", old, 8.0),
              trial("b", "default", today, 9.0), trial("b", "explore", fast, 11.0), trial("b", "default", today, 11.0)]
    store = SimpleNamespace(trials=lambda pid: trials)
    recorder = run._Recorder(store, 7, "r", None, None)
    told = recorder.warm_start_observations(today, every)
    assert [o.knobs for o in told] == [fast] and told[0].value == pytest.approx(math.log(11.0 / 10.0))
    out = capsys.readouterr().out
    assert "earlier runs of profile 7 whose default differs from this run's (cycle_time_ms=1) are left out" in out
    assert "# warm start: 1 stored trial from profile 7" in out
    assert len(recorder.warm_start_observations(old, every)) == 1 and "(cycle_time_ms=10)" in capsys.readouterr().out
    # a run stored before the one-shot and doubling knobs existed ran without those routes (as 0), not
    # with today's defaults of them: measured against another configuration, it is left out too
    before = {k: v for k, v in today.as_dict().items() if k not in ("oneshot_max_bytes", "doubling_max_bytes")}
    trials[:] = [SimpleNamespace(run_id="c", phase="default", knobs=before, score=10.0),
                 SimpleNamespace(run_id="c", phase="explore", knobs={**before, "fusion_threshold_bytes": 0}, score=11.0)]
    assert recorder.warm_start_observations(today, every) == []
    assert "(oneshot_max_bytes=off, doubling_max_bytes=off) are left out" in capsys.readouterr().out
    ran = today.replace(oneshot_max_bytes=0, doubling_max_bytes=0)
    assert [o.knobs for o in recorder.warm_start_observations(ran, every)] == [ran.replace(fusion_threshold_bytes=0)]
    # this run pins the fusion threshold: the stored candidate that varied it is left out, said aloud
    trials[:] = [trial("d", "default", today, 10.0), trial("d", "explore", fast, 11.0),
                 trial("d", "explore", today.replace(cycle_time_ms=2.0), 12.0)]
    told = recorder.warm_start_observations(today, ("cycle_time_ms", "segment_bytes"))
    assert [o.knobs for o in told] == [today.replace(cycle_time_ms=2.0)]
    assert "1 stored trial of profile 7 varied knobs this run pins: left out" in capsys.readouterr().out


def test_a_lock_after_a_retune_is_stored_as_retuned():
    """tune --retune stores the run's last lock; its outcome says it came from a re-opened search, so a
    profile's report counts that search's blocks, not the first one's."""
    from tunelab.knobs import Knobs
    from tunelab.tuning.plan import Decision
    from tunelab.tuning.result import outcome

    def decision(epoch, adopted, converged, stop):
        return Decision(epoch, Knobs(), adopted, None, None, "", stop, converged, 3, 9, 1.0)

    assert outcome(decision(0, True, True, "converged (x)")) == "converged"
    assert outcome(decision(0, False, False, "budget of 20 exploration blocks spent")) == "budget exhausted"
    assert outcome(decision(1, True, True, "converged (x)")) == "retuned: converged"
    assert outcome(decision(2, False, False, "budget of 8 exploration blocks spent")) == \
        "retuned: budget exhausted, default kept"


def test_gpu_jobs_show_search_and_retune_the_device_knob_and_are_not_seeded_by_the_host_model(monkeypatch, tmp_path):
    """On a GPU the search covers ``oneshot_max_bytes`` too: the printed and locked lines show it where
    it left its default, a job that auto-loads a GPU profile (signature ``cuda-...``) and re-opens its
    search with the retune setting searches it again (rather than putting it back to its default), and
    a GPU tune takes no first proposals from the scale model, which is fitted on the host path."""
    from types import SimpleNamespace

    from tunelab import runtime
    from tunelab.knobs import Knobs
    from tunelab.tuning import run, watch

    assert "oneshot=64KiB" in run.describe(Knobs(oneshot_max_bytes=64 << 10), exact=True)
    assert "oneshot" not in run.describe(Knobs())

    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(watch, "ProfileWatch", lambda coordinator, space, loaded, stored, writer=None, key=None,
                        interval=None, samples_per_step=1.0: space)
    key = SimpleNamespace()  # the store has no profile under it: nothing to warm-start from
    rt = SimpleNamespace(engine=SimpleNamespace(knobs=Knobs()), config=SimpleNamespace(pinned=(), knobs=Knobs(), timeout_s=60.0, stall_warning_s=60.0),
                         topology=SimpleNamespace(num_nodes=1, homogeneous=True), coordinator=None,
                         profile_keys=lambda signature, framework, legacy=None: [key])
    monkeypatch.setattr("tunelab.profiles.ProfileStore.best", lambda self, k: None)
    spaces = {sig: runtime.Runtime._watch_profile(rt, Knobs(), sig, "torch", sig) for sig in ("cuda-161p-x", "161p-x")}
    assert "oneshot_max_bytes" in spaces["cuda-161p-x"].names
    assert "oneshot_max_bytes" not in spaces["161p-x"].names

    monkeypatch.setattr(run._Recorder, "create",
                        lambda *a, **k: SimpleNamespace(warm_start_observations=lambda reference, searched: []))
    monkeypatch.setattr(run, "_model_proposals", lambda p, rt, space: ([Knobs(cycle_time_ms=9.0)], "m.json"))
    comm = SimpleNamespace(rank=0, bcast=lambda value, root=0: value)
    space = SimpleNamespace(base=Knobs(), names=())
    first = {device: run._prepare_on_rank0({"device": device}, None, None, space, comm)[2] for device in ("cuda", "cpu")}
    assert first == {"cuda": ([], None), "cpu": ([Knobs(cycle_time_ms=9.0)], "m.json")}



def test_a_workload_that_one_rank_cannot_build_fails_on_every_rank_at_once():
    """tune's ranks when the last one cannot build its workload (no GPU for it, out of memory): every
    rank raises at once, the others naming it (they used to wait in the run's first collective while
    it waited for them in the runtime's shutdown, for good), and the next run works
    (tests/mpi_replay_cases.py::case_replay_build_fails)."""
    results = run_ok("replay_build_fails", 3, limit_s=120)
    for r, res in enumerate(results):
        fails, works = res["fails"], res["works"]
        if r == 2:
            assert fails["error"] == "MemoryError: out of memory building the model (injected)", fails
        else:
            assert fails["error"] == ("TunelabError: the workload could not be built on rank 2: out of memory "
                                      "building the model (injected)"), fails
        assert fails["seconds"] < 30 and works["gathered"] == [0, 1, 2], res


def test_tune_stores_a_retuned_best_under_the_run_id_of_the_search_that_set_it():
    """``tune --retune``: the first search's trials carry the run's id, a re-opened one's ``<id>.rN``, and
    the best names the search it came from (a later warm start reads each run id as one search)."""
    from types import SimpleNamespace

    from tunelab.knobs import Knobs
    from tunelab.tuning.run import _Recorder

    calls = []

    class Store:
        def record_trial(self, *a):
            calls.append(("trial", a[6]))

        def set_best(self, *a, **k):
            calls.append(("best", a[5]))

    recorder = _Recorder(Store(), 1, "run", None, None)
    for epoch in (0, 0, 1, 2):
        recorder.record(SimpleNamespace(role="candidate", phase="explore", knobs=Knobs(), score=1.0, spread=0.0,
                                        steps=3, seconds=1.0, epoch=epoch))
    recorder.finish({"gain_interval": None, "best": {"knobs": {}, "score": 2.0}, "default": {"score": 1.0},
                     "samples": [], "steps_to_lock": 4, "outcome": "retuned: converged",
                     "decisions": [{"epoch": 0}, {"epoch": 2}]})
    assert calls == [("trial", "run"), ("trial", "run"), ("trial", "run.r1"), ("trial", "run.r2"), ("best", "run.r2")]


def test_a_defect_in_storing_a_run_is_raised_not_reported_as_a_store_failure():
    """Only the store's own errors (and the file system's) turn into "not stored": a defect in the code
    that stores (here a store without set_best) is raised as it is."""
    from tunelab.errors import StoreError
    from tunelab.tuning.run import _Recorder

    result = {"gain_interval": None, "best": {"knobs": {}, "score": 2.0}, "default": {"score": 1.0},
              "samples": [], "steps_to_lock": 4, "outcome": "converged",
              "decisions": [{"epoch": 0}]}
    with pytest.raises(AttributeError):
        _Recorder(object(), 1, "r", None, None).finish(result)

    class Full:
        def set_best(self, *a, **k):
            raise StoreError("disk full")

    recorder = _Recorder(Full(), 1, "r", None, None)
    recorder.finish(result)
    assert recorder.failed == "disk full"


def test_a_loaded_profile_is_held_to_its_claimed_gain_only_where_the_job_runs_its_knobs(monkeypatch, tmp_path):
    """The retune watch checks the loaded knobs against the gain their profile claims before it re-opens
    a search; a job that pins a knob the profile tuned runs other knobs than those measured, so the
    claim is not theirs: that watch goes unchecked (it re-opens on the wider interval)."""
    from types import SimpleNamespace

    from tunelab import runtime
    from tunelab.knobs import Knobs, stored_knobs
    from tunelab.profile_records import Best
    from tunelab.tuning import watch

    claims = []
    monkeypatch.setattr(watch, "ProfileWatch", lambda *a, interval=None, **k: claims.append(interval))
    monkeypatch.setenv("TUNELAB_HOME", str(tmp_path / "home"))
    stored = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    best = Best(1, stored, 125.0, 100.0, 1.25, 0.01, "tune-run", "2026-11-28T00:00:00+00:00", 1.1, 1.4)
    monkeypatch.setattr("tunelab.profiles.ProfileStore.best", lambda self, k: best)
    monkeypatch.setattr("tunelab.profiles.ProfileStore.trials", lambda self, pid: [])
    same = stored_knobs(stored)  # (knobs the stored best does not name: those it ran with)
    for pinned, loaded in (((), same), (("cycle_time_ms",), same.replace(cycle_time_ms=7.0)),
                           (("doubling_max_bytes",), same.replace(doubling_max_bytes=same.doubling_max_bytes + 4096))):
        rt = SimpleNamespace(engine=SimpleNamespace(knobs=loaded), config=SimpleNamespace(pinned=pinned, knobs=Knobs(), timeout_s=60.0, stall_warning_s=60.0),
                             topology=SimpleNamespace(num_nodes=1, homogeneous=True), coordinator=None,
                             profile_key=lambda signature, framework: None)
        runtime.Runtime._watch_profile(rt, loaded, "sig", "torch", "sig")
    # (a knob the profile does not name runs alike in the check's default and loaded blocks: claim kept)
    assert [(c.gain, c.low, c.high) if c else None for c in claims] == [(1.25, 1.1, 1.4), None, (1.25, 1.1, 1.4)]
