"""tunelab.torch on 2-3 ranks against single-process training and plain reductions."""

import pytest
from mpi_harness import run_case, run_ok

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_training_matches_single_process_on_concatenated_batches(n):
    results = run_ok("torch_training", n, limit_s=300)
    for res in results:
        for mode in ("plain", "bpps2", "groups2", "predivide4"):
            assert res[mode]["max_abs_diff"] < 1e-5, (mode, res[mode])
        assert res["fp16"]["max_abs_diff"] < (1e-5 if n == 1 else 2e-3)  # (one rank sends nothing to compress)
        for mode in ("plain", "bpps2", "fp16", "groups2", "predivide4"):
            # one rank in all has nothing to reduce: the optimizer leaves the coordinator alone
            assert (res[mode]["gradients_submitted"] == 0) == (n == 1), (mode, res[mode])
    for key in ("plain", "bpps2", "fp16", "groups2", "predivide4"):  # identical weights on every rank
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_optimizer_state_is_roots_on_every_rank_and_travels_through_the_host(device):
    """Root's moments and step counts reach every rank (they differed before), on that rank's own
    parameters' device; the payload between ranks holds host tensors only (pickled on a GPU, root's
    CUDA tensors would be unpickled on root's device on every rank)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")
    results = run_ok("torch_optimizer_state", 2, limit_s=200, device=device)
    for res in results:
        assert res["states"] == 6 and res["equal_to_root"] and res["moments_on_param_device"], res
    assert results[0]["differed_before"]  # (else the broadcast would have nothing to show)
    assert results[1]["sent_devices"] == ["cpu"]  # root's payload
    assert results[0]["sent_devices"] == []       # the others send nothing


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
        ranks = n * (n - 1) / 2  # sum of the ranks, which each rank adds to its inputs
        assert res["scaled"] == [(n * i + ranks) * 2.0 * 0.25 for i in range(10)]
        assert res["scaled_inplace"] == [3.0 * (i + (n - 1) / 2) for i in range(10)]
        assert res["postscaled_inplace"] == [(n * i + ranks) * 0.5 for i in range(10)]
        assert res["postscaled_grouped_inplace"] == [[2.0 * ranks] * 2, [2.0 * ranks] * 3]
        assert res["int_avg_inplace"] == [(n * i + 1) // n for i in range(5)]  # the sum's mean, truncated
        assert res["scalar_inplace"] == n * (n + 1) / 2
        assert res["inplace_returns_it"] == [True, True]  # (Horovod's allreduce_ returns the tensor it reduced)
        assert res["leaf_inplace"] == [[ranks] * 3, True]
        assert res["scaled_int"] == [int((n * i + ranks) * 0.5) for i in range(5)]
        assert res["scaled_grouped"] == [[2.0 * ranks] * 2, [2.0 * ranks]]
        assert res["positional"] == [[n * 1.0] * 2, [2.0 * n] * 2, [3.0 * n] * 2, [[2.0 * n] * 2]]
        mean = [int(v * (n + 1) / 2) for v in (10, 20, 30)]  # (10, 20, 30) times rank + 1, averaged
        assert res["threads"] == [[mean, mean]] * 5, res["threads"]
        assert res["scaled_grad"] == [2.0 * 3.0 * n] * 3  # d/dw of sum(3 * allreduce_sum(2 w)), as Horovod
        assert res["both_ops"].startswith("pass op or the older average, not both")
        assert res["mismatch"].startswith("RankMismatchError: ranks disagree on tensor 'bad.shape'")
        assert "float32[3]" in res["mismatch"] and "float32[4]" in res["mismatch"]
        assert res["after_mismatch"] == [float(n)] * 2


def test_integer_average_with_postscale_and_reducescatters_gradient_follow_horovod():
    r0, r1 = run_ok("torch_api_edges", 2, limit_s=120)
    # sparse gradients gathered by parameter, whatever order backward reached them in on each rank
    assert r0["sparse_order_diff"] < 1e-6 and r1["sparse_order_diff"] < 1e-6, (r0["sparse_order_diff"], r1)
    # by hand: trunc((7 + 0) * 2.0 / 2) = 7 (truncating the average 3 first, then scaling, gave 6)
    assert r0["int_avg_post"] == r1["int_avg_post"] == [7, -7]
    # rank r holds arange(4) + r; rank 0 keeps rows 0-1, rank 1 rows 2-3; its loss weighs them by r + 1,
    # so every rank's gradient is (1, 1, 2, 2), halved for the average
    assert r0["rs_sum"] == [[1.0, 3.0], [1.0, 1.0, 2.0, 2.0]] and r1["rs_sum"] == [[5.0, 7.0], [1.0, 1.0, 2.0, 2.0]]
    assert r0["rs_avg"] == [[0.5, 1.5], [0.5, 0.5, 1.0, 1.0]] and r1["rs_avg"][1] == [0.5, 0.5, 1.0, 1.0]


def test_one_rank_optimizer_options_match_single_process_without_the_coordinator():
    """One rank in all: sparse gradients (coalesced; the passes add up), sparse_as_dense, predivide,
    groups and clipping give what one process gives, with no gradient sent to the coordinator (the
    training test above checks that part)."""
    (opt,) = run_ok("torch_optimizer_options", 1, limit_s=120)
    for key in ("sparse", "sparse_as_dense", "predivide", "num_groups", "sparse_grouped", "sparse_bpps2", "clip"):
        assert opt[key] < 1e-6, (key, opt[key])
    assert opt["clip_moved"] and opt["predivide_sum"] == "gradient_predivide_factor needs op=Average"


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


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_parity(n):
    """One launch: errors that leave the job usable, autograd through collectives, integer averages,
    optimizer options, join, alltoall/reducescatter, SyncBatchNorm, timeline (tests/mpi_torch_parity_cases.py)."""
    results = run_ok("torch_parity", n, limit_s=240)
    for r, res in enumerate(results):
        err = res["errors"]
        for key in ("shape", "dtype", "op", "grouped", "root", "bshape", "bobject"):  # raised by the call, everywhere
            assert err[key].startswith("RankMismatchError: ranks disagree on"), (key, err[key])
        assert "float32[4]" in err["shape"] and "float64[3]" in err["dtype"] and "op=max" in err["op"]
        assert f"rank {n - 1}: root 1" in err["root"]
        assert err["gather"].startswith("RankMismatchError: allgather of") and f"rank {n - 1}: float32[*, 3]" in err["gather"]
        assert err["broot"].endswith(f": root_rank {n} on rank {n - 1} is not a rank (world size {n})")
        assert err["splits"].startswith("alltoall of ") and f"wrong on ranks [{n - 1}]: splits {[1] * (n + 1)}" in err["splits"]
        assert f"they must be {n} non-negative counts" in err["splits"]
        # without splits, a first dimension that does not divide fails on every rank (the others hung)
        assert f"wrong on ranks [{n - 1}]: {n + 1} rows on rank {n - 1}, not divisible by {n}" in err["equal"], err["equal"]
        assert err["after"] == [float(n * (n - 1) / 2)] * 3  # the next collectives work
        assert err["after_bcast"] == [float(n - 1)] * 2
        ag = res["autograd"]
        for key in ("allreduce_sum", "allreduce_average", "allreduce_max", "grouped", "allgather", "broadcast",
                    "alltoall", "alltoall_values"):
            assert ag[key] < 1e-12, (key, ag[key])
        assert ag["alltoall_counts"] is True
        gc = res["gradcheck"]  # autograd Jacobians vs central differences, float64, rank p's input moving
        for kind in ("allgather", "broadcast"):
            for p in range(n):
                assert gc[f"{kind}_{p}"] < 1e-7 and gc[f"{kind}_{p}_nonzero"], (kind, p, gc)
        ia = res["int_avg"]
        assert ia["int32"] == ia["expected"] and ia["int64_inplace"] == ia["expected"]
        assert ia["synchronized_twice"] == [ia["expected"]] * 2
        assert ia["grouped"] == [ia["expected"], ia["expected"][:3]]
        opt = res["optimizer"]
        for key in ("sparse", "sparse_as_dense", "predivide", "num_groups", "sparse_grouped", "sparse_bpps2", "clip"):
            assert opt[key] < 1e-6, (key, opt[key])
        assert opt["clip_moved"] and opt["predivide_sum"] == "gradient_predivide_factor needs op=Average"
        join = res["join"]
        assert join["last"] == n - 1 and join["after"] == [float(n)] * 2
        assert join["diff"] < 1e-6
        col = res["collectives"]
        assert col["rs_sum"] == 0 and col["rs_avg"] < 1e-5 and col["rs_rows"] and col["grs"] == 0
        assert col["a2a_equal"] and col["objects"] and col["scalar"] == [[], (n - 1) / 2]
        assert col["built"] == [True, True, False, False]
        if r != 0:
            assert col["barrier_waited"] > 0.3  # rank 0 slept 0.4 s before the barrier
        bn = res["syncbn"]
        assert bn["out"] < 1e-5 and bn["in_grad"] < 1e-5 and bn["w_grad"] < 1e-4 and bn["running"] < 1e-5
        assert bn["eval"] < 1e-6
        for name, tol in (("float16", 1e-2), ("bfloat16", 6e-2)):  # the output's own rounding (|y| < 5)
            h = bn["half"][name]
            assert h["dtype"] == f"torch.{name}" and h["finite"] and h["running_finite"] and h["out"] < tol, (name, h)
    assert results[0]["timeline"] == {"spans": 1, "valid": True}  # only the traced allreduce


def test_optimizer_recovers_from_what_training_scripts_meet():
    """An LR scheduler made before wrapping, a step skipped after synchronize(), a reduction that failed
    and a layer skipped in one of 2 accumulated passes: each leaves every rank with the same weights
    after the next step (tests/mpi_torch_cases.py::case_torch_optimizer_recovery)."""
    results = run_ok("torch_optimizer_recovery", 2, limit_s=200)
    for rank, res in enumerate(results):
        assert res["errors"]["failed_wait"] == "injected reduction failure", (rank, res)
        assert res["errors"]["failed_wait_from"] == "backward", (rank, res)  # (op Average: waited for there)
        assert res["errors"]["failed_wait_calls"] > 1, (rank, res)  # the others went out
        assert res["scheduler_lr"] == 0.025 and res["scheduler_warnings"] == [], (rank, res)
        assert all(res["same_after"].values()) and len(res["same_after"]) == 7, (rank, res["same_after"])


def test_parameters_frozen_or_unfrozen_after_wrapping_and_two_optimizers_reduce_as_plain_torch_would():
    """Against autograd's gradients averaged over ranks (tests/mpi_torch_cases.py::
    case_torch_parameters_that_change): a layer frozen after wrapping is left alone (momentum and weight
    decay do not move it), one unfrozen after is reduced from that step on, an encoder's and a decoder's
    optimizer without names both reduce, a failed sparse gather leaves the optimizer usable, and the
    constructor refuses what it cannot use with a line that says what it wants."""
    for rank, res in enumerate(run_ok("torch_parameters_that_change", 2, limit_s=200)):
        err = res["errors"]
        assert err["two_optimizers"] == "" and err["zero_grad_after_failed_gather"] == "", (rank, err)
        assert err["sparse_gather"] == "injected gather failure", (rank, err)
        for key in ("names_not_pairs", "names_of_strings"):
            assert err[key].startswith("named_parameters must be (name, parameter) pairs"), (rank, key, err)
        assert err["wrapped_twice"].startswith("this optimizer is a DistributedOptimizer already"), (rank, err)
        assert all(res["ok"].values()) and len(res["ok"]) == 11, (rank, res["ok"])


def test_gradients_read_between_backward_and_step_are_reduced_as_in_plain_torch_loops():
    """torch.amp's GradScaler, closures (SGD, LBFGS) and a GAN's two optimizers, as their plain torch
    loops are written (tests/mpi_torch_cases.py::case_torch_between_backward_and_step).  Before, the
    scaler checked un-reduced gradients (ranks skipped different steps, then zero_grad() refused and the
    others stalled), a closure stepped on this rank's own gradients, and the GAN's zero_grad() refused.
    And an embedding's sparse gradient that one rank does not compute in a step: it sent dense zeros;
    and two optimizers whose blocks ranks run in different orders (or one rank not at all)."""
    for rank, res in enumerate(run_ok("torch_between_backward_and_step", 2, limit_s=200)):
        assert res["errors"] == {"amp": "", "closure_sgd": "", "closure_lbfgs": "", "gan": "", "sparse": "",
                                 "two_optimizers_crossed": "", "two_optimizers_skipped": ""}, (rank, res)
        assert all(res["ok"].values()) and len(res["ok"]) == 23, (rank, res["ok"])
        assert res["amp_scale"] == 8.0, (rank, res)  # halved once, at the step every rank skipped


def test_optimizer_misuse_is_refused_and_the_optimizer_stays_usable():
    """Each refusal, and a submit that raised (its gradient, or its group's, goes out again at step()),
    leaves an optimizer whose next steps give every rank the same weights."""
    results = run_ok("torch_optimizer_misuse", 2, limit_s=200)
    for rank, res in enumerate(results):
        err = res["errors"]
        assert "computed more than backward_passes_per_step=1 times before step()" in err["twice"], (rank, err)
        assert "computed more than backward_passes_per_step=1" in err["twice_grouped"], (rank, err)
        assert err["zero_grad"].startswith("zero_grad() called after backward() but before step()"), (rank, err)
        # an average: the second pass adds to the reduced gradients, and the step gets both passes' average
        assert err["twice_average"] == "" and res["twice_average_reduced"], (rank, err)
        assert err["partial"] == "" and res["partial_reduced"], (rank, err)  # as Horovod: what was accumulated
        for key in ("submit_fails", "group_submit_fails", "predivided_submit_fails", "accumulated_submit_fails"):
            assert err[key] == "injected submit failure", (rank, key, err)
        # a submit that failed in the last of 2 passes left the others at 1 pass: step() reduces what they have
        assert err["accumulated_submit_fails_step"] == "", (rank, err)
        # the failed gradient went out again at step(), scaled once (divided by the predivide factor once)
        assert res["grads_averaged"] == {k: True for k in ("submit_fails", "group_submit_fails",
                                                          "predivided_submit_fails")}, (rank, res)
        assert all(res["same_after"].values()) and len(res["same_after"]) == 13, (rank, res["same_after"])


def test_the_wrapped_optimizer_across_its_life_matches_plain_torch():
    """Step hooks, an LR scheduler made before wrapping, a second synchronize(), passes adding up,
    add_param_group, wrapping again, list broadcasts and an unpicklable object (mpi_torch_parity_cases)."""
    for res in run_ok("torch_optimizer_lifecycle", 2, limit_s=120):
        assert res["hook_calls"] == 1 and res["hook_saw_mean"] and res["w_after_one_step"], res
        assert res["rates"] == pytest.approx([1.0, 0.1, 0.01]) and res["w_scheduled"], res
        assert res["passes_add_up"] and res["second_sync_same"], res
        assert res["added_group_reduced"] and res["rewrapped"], res
        assert "a newer one was made over the same parameters" in res["old_refused"], res
        assert res["list_broadcast"], res
        assert res["unpicklable"] in ("PicklingError", "AttributeError", "RankMismatchError"), res
        assert res["unpicklable_s"] < 5 and res["next_object"] == {"x": 0}, res


def _two_ranks_run(tmp_path, text: str):
    """``text`` as a script, run on 2 ranks by mpiexec with a store of its own (the completed process)."""
    import os
    import subprocess
    import sys

    from tunelab.launch import mpiexec_command

    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([*mpiexec_command(), "-n", "2", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home")})


def test_an_error_the_script_caught_is_one_line_at_exit_and_the_rank_exits_cleanly(tmp_path):
    """A stall the script caught and went on from: at exit the runtime's shutdown meets the coordinator's
    error again; it is said in one line per rank (it was an exit hook's traceback of ~15 lines on every
    rank), and the process exits 0 (its resources freed on the way)."""
    proc = _two_ranks_run(tmp_path, "import torch\nimport tunelab.torch as hvd\nhvd.init(timeout_s=3)\n"
                          "try:\n    hvd.allreduce(torch.ones(2), name='only0') if hvd.rank() == 0 else None\n"
                          "    hvd.allreduce(torch.ones(2), name='everyone')\nexcept Exception as exc:\n"
                          "    print('caught', type(exc).__name__, flush=True)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("StallError") == 2, proc.stdout  # (the ranks' lines may interleave)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("tunelab: at exit, after an error: stalled for more than 3 s") == 2, proc.stderr


def test_an_error_the_job_never_met_fails_the_process_at_exit(tmp_path):
    """Rank 0 leaves an allreduce in flight that rank 1 never makes, and neither rank waits for anything
    that fails: it is found only by the shutdown at exit (rank 1 left while it was pending: a stall
    after the timeout, until ranks that leave were seen), said in one line, and rank 0, whose own
    collective never completed, exits 1, so the job does (it exited 0: a launcher read the failed job
    as a success); rank 1 lost nothing of its own and exits as its script did, without a word."""
    proc = _two_ranks_run(tmp_path, "import torch\nimport tunelab.torch as hvd\nhvd.init(timeout_s=3)\n"
                          "hvd.allreduce(torch.ones(2), name='warm')\n"
                          "h = hvd.allreduce_async(torch.ones(3), name='orphan') if hvd.rank() == 0 else None\n"
                          "print('body done', flush=True)\n")
    assert proc.returncode != 0, (proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.count("body done") == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    said = "tunelab: error at exit: rank 1 shut down (a script that ended or raised) while tensor 'orphan' waited"
    assert proc.stderr.count(said) == 1, proc.stderr[-2000:]
    assert "(1 collective this rank submitted never completed, and nothing waited for it: 'orphan')" in proc.stderr
    assert "at exit, after an error" not in proc.stderr, proc.stderr


_TRAIN = """import sys, time
import torch
import tunelab.torch as hvd
hvd.init({init})
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
{before}
start = time.monotonic()
try:
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(3):
        opt.zero_grad()
        {in_step}
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    {after}
except Exception as exc:
    print(f"rank {{hvd.rank()}} failed after {{time.monotonic() - start:.1f}} s: {{type(exc).__name__}}: {{exc}}", flush=True)
    raise
print(f"rank {{hvd.rank()}} done: {{float(sum(p.sum() for p in model.parameters())):.6f}}", flush=True)
"""


# each layer's backward 0.3 s slower on rank 1: its gradients are submitted over several cycles
_SLOW_BACKWARD = """for layer in (model[0], model[2]):
    layer.register_full_backward_hook(lambda *a: time.sleep(0.3) if hvd.rank() == 1 else None)"""


@pytest.mark.parametrize("where", ["step", "broadcast"])
def test_a_rank_that_raises_ends_its_peers_waits_at_once_naming_it(tmp_path, where):
    """Rank 1's script raises (in the training loop, or before the parameters' broadcast) while rank 0
    waits for it: rank 0 fails at once, naming rank 1, where it waited for the timeout (60 s here) and
    then blamed a stall.  (mpiexec ends the job when a rank dies of a signal, not when it exits 1.)"""
    fail = "raise RuntimeError('rank 1 failed')"
    script = _TRAIN.format(init="timeout_s=60", before=f"if hvd.rank() == 1 and {where == 'broadcast'}: {fail}",
                           in_step=f"if hvd.rank() == 1 and step == 1 and {where == 'step'}: {fail}", after="pass")
    proc = _two_ranks_run(tmp_path, script)
    assert proc.returncode != 0, proc.stdout
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("rank 0 failed after")), None)
    assert line is not None, (proc.stdout, proc.stderr[-3000:])
    assert "RankExitedError" in line and "rank 1 shut down (a script that ended or raised)" in line, line
    assert float(line.split()[4]) < 20, line  # (the start of a 60 s timeout, not its end)
    assert "RuntimeError: rank 1 failed" in proc.stderr, proc.stderr[-3000:]


def test_a_rank_that_is_slow_is_warned_of_and_waited_for(tmp_path):
    """Rank 0 evaluates alone (3 s) while rank 1 waits for its gradients, and rank 1 saves alone while
    rank 0 waits in a broadcast: each wait is said once, on standard error, after the warning's 1 s
    (naming what is missing where; rank 1's gradients come over several cycles, 0.3 s apart, and the
    stall is still one line), and both complete: the job trains on, the ranks' models equal."""
    script = _TRAIN.format(init="timeout_s=30, stall_warning_s=1", before=_SLOW_BACKWARD,
                           in_step="time.sleep(3) if hvd.rank() == 0 and step == 1 else None",
                           after="time.sleep(3) if hvd.rank() == 1 else None\n    hvd.broadcast_object(1, name='saved')")
    proc = _two_ranks_run(tmp_path, script)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    done = sorted(ln for ln in proc.stdout.splitlines() if " done: " in ln)
    assert len(done) == 2 and done[0].split()[-1] == done[1].split()[-1], proc.stdout
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("tunelab: warning: ")]
    assert len(warnings) == 2, proc.stderr[-3000:]
    assert any(ln.startswith("tunelab: warning: waited 1 s so far for every rank to submit tensor ")
               and "(submitted by ranks [1], missing on ranks [0])" in ln and ln.endswith(
                   "it fails after 30 s (see TUNELAB_TIMEOUT_S)") for ln in warnings), warnings
    assert any(ln.startswith("tunelab: warning: rank 0: waited 1 s so far for the other ranks to reach ")
               and "saved" in ln for ln in warnings), warnings


def test_in_place_collectives_on_tensors_a_backward_saved_raise_as_torch_in_place_ops_do():
    """The engine writes through views torch does not see; autograd's version counter moves anyway, so
    a backward that saved the tensor raises torch's own error (it computed with the reduced values)."""
    for res in run_ok("torch_inplace_autograd", 2, limit_s=120):
        torch_says = res["torch_mul_"]
        assert torch_says.startswith("one of the variables needed for gradient computation"), res
        for call in ("allreduce_", "grouped_allreduce_", "allreduce_scaled", "broadcast_"):
            assert res[call] == torch_says, (call, res)
        # broadcast_parameters writes .data, as Horovod users' loops expect; a gradient reduced in place
        # is autograd's: d/dw (w . x)^2 = 2 (w . x) x with rank 0's w = [1, 1], x = [1, 1]
        assert res["parameters_after_broadcast"] == [[1.0, 1.0]], res
        assert res["grad_after_allreduce_"] == [[4.0, 4.0]], res
