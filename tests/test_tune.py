"""tunelab tune end to end (gradient replay, 2 ranks) and auto-loaded profiles in training jobs."""

import json
import subprocess
import sys

import pytest
from mpi_harness import run_ok

pytest.importorskip("skopt")

SCENARIO = """
name = "tiny-replay"
workload = "replay"
model = "resnet50"
[run]
np = 2
[tuning]
budget_samples = 5
warmup_steps = 1
discard_steps = 1
measure_steps = 2
[replay]
forward_ms = 20
backward_ms = 40
"""


def tunelab(*args, env=None, timeout=600, cwd=None):
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


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
    assert samples[0]["phase"] == "default" and samples[0]["knobs"]["fusion_threshold_bytes"] == 64 << 20
    assert [s["phase"] for s in samples[:5]] == ["default"] + ["explore"] * 4
    assert {s["phase"] for s in samples[5:]} == {"remeasure"}
    assert result["default"]["knobs"] in [s["knobs"] for s in samples[5:]]  # default re-measured too
    assert result["gain"] == pytest.approx(result["best"]["score"] / result["default"]["score"])
    assert "[  1/5] default" in proc.stdout and "gain   :" in proc.stdout and "stored : profile" in proc.stdout
    listing = tunelab("profiles", "list")
    assert listing.returncode == 0 and "resnet50" in listing.stdout
    again = tunelab("tune", "--scenario", str(scenario), "--budget", "2", "--no-store", "--no-report")
    assert again.returncode == 0, again.stderr
    assert "warm start: 5 stored trials" in again.stdout


@pytest.mark.parametrize("args,fragment", [
    (["tune", "--budget", "3", "--time-budget", "5"], "not allowed with argument"),
    (["tune", "--model", "no-such-model"], "no-such-model"),
    (["tune", "--budget", "0"], "expected a positive integer"),
    (["tune", "--knob", "cycle_time_ms=0"], "out of range"),
])
def test_bad_tune_input_is_one_line(args, fragment):
    proc = tunelab(*args, timeout=60)
    assert proc.returncode in (1, 2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_broken_scenario_file_names_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(SCENARIO.replace("measure_steps = 2", "measure_steps = \"two\""))
    proc = tunelab("tune", "--scenario", str(bad), timeout=60)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "bad.toml" in line and "measure_steps" in line


@pytest.mark.mpi
def test_training_jobs_load_the_tuned_profile_and_keep_pinned_knobs(tmp_path):
    results = run_ok("torch_autoload", 2, limit_s=200, env_home=str(tmp_path / "home"))
    r0, r1 = results
    assert r0["first"].startswith("tunelab: no tuned profile for tiny / torch / 2 ranks")
    assert r0["second"].startswith("tunelab: loaded tuned profile")
    assert "(measured 1.25x default)" in r0["second"]
    assert r0["knobs"] == r1["knobs"]  # applied by every rank
    assert r0["knobs"]["fusion_threshold_bytes"] == 1 << 20 and r0["knobs"]["segment_bytes"] == 1 << 16
    assert r0["knobs"]["cycle_time_ms"] == 7.0  # pinned by the job: the profile's 3.0 must not win
    assert r1["second"] == ""  # only rank 0 logs
    assert r0["repeat"] == ""  # one lookup per model and job


def test_bench_train_rotates_the_order_of_systems_each_round():
    from tunelab.bench.train import rotated

    systems = ["tunelab-tuned", "tunelab", "ddp"]
    orders = [rotated(systems, r) for r in range(3)]
    assert orders == [systems, ["tunelab", "ddp", "tunelab-tuned"], ["ddp", "tunelab-tuned", "tunelab"]]
    for position in range(3):  # over three rounds every system runs once in every position
        assert {order[position] for order in orders} == set(systems)
    assert rotated(systems, 3) == systems and rotated([], 1) == []
