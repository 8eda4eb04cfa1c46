"""tunelab.tensorflow on 2-3 ranks against single-process TensorFlow training."""

import json
import os
import subprocess
import sys

import pytest
from mpi_harness import run_ok

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
def test_tf_training_matches_single_process(n):
    results = run_ok("tf_training", n, limit_s=400)
    for res in results:
        assert res["function"]["max_abs_diff"] < 1e-5   # DistributedGradientTape inside tf.function
        assert res["eager"]["max_abs_diff"] < 1e-5      # ... and eagerly
        assert res["fp16"]["max_abs_diff"] < 2e-3       # fp16 compression
        assert res["fit"]["max_abs_diff"] < 1e-5        # model.fit + DistributedOptimizer + callbacks
        assert res["allreduce_sum"] == [float(n * i + n * (n - 1) / 2) for i in range(6)]
        assert res["allgather"] == [float(r) for r in range(n) for _ in range(r + 1)]
        assert res["broadcast"] == [float(n - 1)] * 3
    for key in ("function", "eager", "fp16"):  # the same weights on every rank
        assert len({res[key]["digest"] for res in results}) == 1
    assert len({tuple(res["fit"]["losses"]) for res in results}) == 1  # MetricAverageCallback


def test_tf_training_loads_the_tuned_profile_and_keeps_pinned_knobs(tmp_path):
    results = run_ok("tf_autoload", 2, limit_s=300, env_home=str(tmp_path / "home"))
    r0, r1 = results
    assert r0["first"].startswith("tunelab: no tuned profile for tiny / tensorflow / 2 ranks")
    assert len(r0["second"].splitlines()) == 1  # once per tape wrapper, not once per step
    assert r0["second"].startswith("tunelab: loaded tuned profile") and "(measured 1.25x default)" in r0["second"]
    assert r0["fit"].startswith("tunelab: loaded tuned profile") and "fitted / tensorflow" in r0["fit"]
    assert r0["knobs"] == r1["knobs"]  # applied by every rank
    assert r0["knobs"]["fusion_threshold_bytes"] == 1 << 20 and r0["knobs"]["segment_bytes"] == 1 << 16
    assert r0["knobs"]["cycle_time_ms"] == 7.0  # pinned by the job: the profile's 3.0 must not win
    assert r1["second"] == "" and r1["fit"] == ""  # only rank 0 logs


TF_SCENARIO = """
name = "tiny-tf"
workload = "train"
model = "resnet50"
framework = "tensorflow"
[run]
np = 2
[data]
image_size = 32
batch_size = 2
[tuning]
budget_samples = 3
warmup_steps = 1
discard_steps = 1
measure_steps = 2
"""


def tunelab(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunelab.cli", *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_tune_trains_a_keras_model_and_stores_its_profile(tmp_path):
    pytest.importorskip("skopt")
    scenario = tmp_path / "tiny-tf.toml"
    scenario.write_text(TF_SCENARIO)
    out = tmp_path / "tune.json"
    env = {**os.environ, "TUNELAB_HOME": str(tmp_path / "home")}
    proc = tunelab("tune", "--scenario", str(scenario), "--json", str(out), "--no-report", env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "resnet50" and result["world_size"] == 2
    assert result["signature"].split("-")[0].endswith("v")  # a Keras variables signature, not torch's
    assert [s["phase"] for s in result["samples"][:3]] == ["default", "explore", "explore"]
    assert result["locked_final"]["score"] > 0 and "stored : profile" in proc.stdout
    listing = tunelab("profiles", "list", env=env, timeout=60)
    assert listing.returncode == 0 and "tensorflow" in listing.stdout, listing.stdout
