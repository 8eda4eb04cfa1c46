"""tunelab.tensorflow on 2-3 ranks against single-process TensorFlow training."""

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
