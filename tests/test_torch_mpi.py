"""tunelab.torch on 2-3 ranks against single-process training and plain reductions."""

import pytest
from mpi_harness import run_case, run_ok

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
def test_training_matches_single_process_on_concatenated_batches(n):
    results = run_ok("torch_training", n, limit_s=300)
    for res in results:
        for mode in ("plain", "bpps2", "groups2"):
            assert res[mode]["max_abs_diff"] < 1e-5, (mode, res[mode])
        assert res["fp16"]["max_abs_diff"] < 2e-3
    for key in ("plain", "bpps2", "fp16", "groups2"):  # identical weights on every rank
        assert len({res[key]["digest"] for res in results}) == 1
    assert len({res["explicit_groups_digest"] for res in results}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
def test_cuda_training_matches_single_process_through_the_device_path(n):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")
    results = run_ok("torch_training_cuda", n, limit_s=300)
    for res in results:
        for mode in ("plain", "bpps2"):  # GPU kernels sum in another order than the CPU reference
            assert res[mode]["max_abs_diff"] < 1e-4, (mode, res[mode])
    assert len({res["plain"]["digest"] for res in results}) == 1


def test_collectives_match_numpy_semantics():
    n = 3
    results = run_ok("torch_collectives", n, limit_s=200)
    for r, res in enumerate(results):
        assert res["allreduce_avg"] == [i + (n - 1) / 2 for i in range(10)]
        assert res["allreduce_sum_bf16"] == [float(n * i + 3) for i in range(10)]
        assert res["allreduce_inplace_max"] == [float(i + n - 1) for i in range(10)]
        assert res["async"] == [3.0] * 3
        assert res["grouped"] == [[3.0] * 2, [3.0] * 3]
        assert res["allgather"] == [[0, 0], [1, 1], [1, 1], [2, 2], [2, 2], [2, 2]]
        assert res["broadcast"] == [float(n - 1)] * 4
        assert res["broadcast_obj"] == {"rank": 0}
        assert res["noncontig"] == [[3.0 * (j + 4 * i) for i in range(3)] for j in range(4)]
        assert res["topology"] == [n, n, r, 1]
        assert res["mismatch"].startswith("RankMismatchError: ranks disagree on tensor 'bad.shape'")
        assert "float32[3]" in res["mismatch"] and "float32[4]" in res["mismatch"]


@pytest.mark.parametrize("n,rpn", [(2, None), (3, 1)])
def test_knob_churn_gives_bitwise_identical_gradients(n, rpn):
    results = run_ok("knob_churn", n, limit_s=300, steps=200, ranks_per_node=rpn)
    for res in results:
        assert res["changes_True"] >= 150 and res["changes_False"] == 0
        assert res["churn"] == res["fixed"]


def test_a_rank_dying_during_training_ends_the_job():
    run = run_case("torch_dead_rank", 3, limit_s=120)
    assert run.returncode != 0
    assert run.elapsed_s < 60
