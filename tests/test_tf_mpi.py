"""tunelab.tensorflow on 2-3 ranks against single-process TensorFlow training."""

import json
import os
import subprocess
import sys

import pytest
from mpi_harness import run_case, run_ok

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tf_training_matches_single_process(n):
    results = run_ok("tf_training", n, limit_s=400)
    for res in results:
        assert res["function"]["max_abs_diff"] < 1e-5   # DistributedGradientTape inside tf.function
        assert res["eager"]["max_abs_diff"] < 1e-5      # ... and eagerly
        assert res["fp16"]["max_abs_diff"] < (1e-5 if n == 1 else 2e-3)  # fp16 compression (one rank sends nothing)
        assert res["fit"]["max_abs_diff"] < 1e-5        # model.fit + DistributedOptimizer + callbacks
        for key in ("function", "eager", "fp16", "fit"):  # one rank in all: no gradient goes to the coordinator
            assert (res[key]["gradients_submitted"] == 0) == (n == 1), (key, res[key])
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
    assert r0["second"].startswith("tunelab: loaded tuned profile") and "(measured 1.250x the default)" in r0["second"]
    assert r0["fit"].startswith("tunelab: loaded tuned profile") and "fitted / tensorflow" in r0["fit"]
    assert r0["knobs"] == r1["knobs"]  # applied by every rank
    assert r0["knobs"]["fusion_threshold_bytes"] == 1 << 20 and r0["knobs"]["segment_bytes"] == 1 << 16
    assert r0["knobs"]["cycle_time_ms"] == 7.0  # pinned by the job: the profile's 3.0 must not win
    assert r1["second"] == "" and r1["fit"] == ""  # only rank 0 logs


def test_tf_job_with_the_retune_setting_reports_steps_from_its_graph_and_retunes(tmp_path):
    r0, r1 = run_ok("tf_retune", 2, limit_s=300, env_home=str(tmp_path / "home"))
    assert "retune on: watching" in r0["log"] and "re-opening the search" in r0["log"], r0["log"]
    assert r0["decisions"] >= 2 and "saved to profile" in r0["log"] and r0["outcome"].startswith("retuned")
    loaded = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    assert {k: r0["best"][k] for k in loaded} != loaded
    assert r1["log"] == ""


def test_a_keras_optimizer_built_inside_its_first_traced_step_reports_every_step(tmp_path):
    r0, r1 = run_ok("tf_keras_watch", 2, limit_s=300, env_home=str(tmp_path / "home"))
    assert "retune on: watching" in r0["log"] and r0["steps"] == 12, r0
    assert r1["log"] == "" and r1["steps"] is None


def test_tf_integer_average_with_postscale_and_a_mixed_groups_gradient_follow_horovod():
    r0, r1 = run_ok("tf_api_edges", 2, limit_s=300)
    assert r0["int_avg_post"] == r1["int_avg_post"] == [7, -7]  # trunc(7 * 2.0 / 2), not 2 * trunc(7 / 2)
    assert r0["ints"] == r1["ints"] == [6, 8]
    # d/dv of the summed group's float part: the allreduce's gradient (2, the ranks' ones summed) times
    # this rank's factor r + 1 (it was None: the integer tensor turned the group's gradient off)
    assert r0["grad"] == [2.0, 2.0] and r1["grad"] == [4.0, 4.0]
    assert r0["int_scalar"] == r1["int_scalar"] == [3, 3, [3, [1, 2]]]
    # Horovod's sparse allreduce: every rank's rows gathered (averaged: divided by the size)
    assert r0["slices"] == r1["slices"] == ["IndexedSlices", [[0.5, 0.5], [1.0, 1.0]], [0, 1], [[2.0, 2.0], [4.0, 4.0]]]
    assert r0["retraced"] == r1["retraced"] == [3.0, 2.85, 2.7]  # (the loss of the mean gradient's steps)
    for res in (r0, r1):  # XLA: refused in one line where traced, and the job goes on
        said = ("UsageError: an allreduce cannot run in a function XLA compiles: tunelab's collectives are Python "
                "ops (tf.py_function). Compile the Keras model with jit_compile=False (on a host with a GPU, "
                "Keras's default jit_compile=\"auto\" turns XLA on), or leave jit_compile=True off the "
                "tf.function that calls them")
        assert res["xla"] == [said] * 2, res
        assert res["after_xla"] == [3.0]


def test_a_gradient_none_on_one_rank_only_leaves_the_others_their_own_peers():
    r0, r1 = run_case("tf_gradient_gaps", 2, 120).results
    assert r0 is not None and r1 is not None
    # the tape's unconnected_gradients=ZERO (through the wrapper as a context manager): b's average is
    # rank 1's 2 over 2 ranks, and nothing stalls
    assert r0["zero_grads"] == r1["zero_grads"] == [[1.0, 1.0], [1.0, 1.0], [3.0, 3.0]], (r0, r1)
    if "grads" in r0:  # (rank 0 gives none for b: it may finish before the stall is seen)
        assert r0["grads"] == [[1.0, 1.0], None, [3.0, 3.0]], r0  # c: its own 3, not (3 + 2) / 2
    else:
        assert "StallError" in r0["error"] and ".1'" in r0["error"], r0
    if r1["error"].startswith("RankExitedError"):  # rank 0 finished and shut down first: rank 1 is told at once
        assert "grads" in r0 and r1["error"].startswith("RankExitedError: rank 0 shut down"), (r0, r1)
        assert ".1' waited for it" in r1["error"], r1
    else:
        assert "StallError" in r1["error"] and ".1' (submitted by ranks [1], missing on ranks [0])" in r1["error"], r1


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
    first = result["samples"][0]  # the default is measured first, as the reference
    assert first["phase"] == "explore" and first["role"] == "reference"
    assert first["knobs"]["fusion_threshold_bytes"] == 64 << 20
    assert result["locked_final"]["score"] > 0 and "stored : profile" in proc.stdout
    listing = tunelab("profiles", "list", env=env, timeout=60)
    assert listing.returncode == 0 and "tensorflow" in listing.stdout, listing.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_parity(n):
    """One launch (tests/mpi_tf_parity_cases.py): errors that leave the job usable, gradients through
    hvd.allreduce, integer average, broadcast_variables(opt.variables) in tf.function, IndexedSlices,
    Keras backward_passes_per_step, learning-rate callbacks, SyncBatchNormalization, join, through tunelab.tensorflow.keras."""
    results = run_ok("tf_parity", n, limit_s=400)
    for res in results:
        err = res["errors"]
        assert err["shape"].startswith("RankMismatchError: ranks disagree on tensor 'e.shape.0'")
        assert err["root"].startswith("RankMismatchError: ranks disagree on the root of broadcast")
        assert "RankMismatchError: ranks disagree on tensor 'e.graph.0'" in err["graph"]  # tf.errors-wrapped
        assert err["after"] == [float(n * (n - 1) / 2)] * 2
        assert err["scalar"] == [[], (n - 1) / 2]
        ranks1 = n * (n + 1) / 2  # the sum of rank + 1 over ranks
        assert err["scaled"] == err["scaled_fn"] == [ranks1 * 2.0 * 0.25, 2 * ranks1 * 2.0 * 0.25], err
        assert err["scaled_grad"] == [2.0 * 3.0 * n] * 3, err  # as torch's and Horovod's
        assert err["both_ops"].startswith("ValueError: pass op or the older average, not both"), err
        assert err["mixed_int_avg"] == "TypeError: a grouped integer average cannot mix integer and floating tensors"
        assert all(v < 1e-6 for v in res["gradients"].values()), res["gradients"]
        assert len(res["gradients"]) == 8
        a2a = res["a2a_rs"]
        for mode in ("eager", "function"):
            values, counts, grad = a2a[f"a2a_{mode}"]
            assert values < 1e-12 and counts and grad < 1e-12, (mode, a2a[f"a2a_{mode}"])
            for op in ("sum", "average"):
                assert max(a2a[f"rs_{op}_{mode}"]) < 1e-12, (op, mode, a2a[f"rs_{op}_{mode}"])
        assert a2a["a2a_int"]
        assert f"wrong on ranks [{n - 1}]: splits {[1] * (n + 1)}" in a2a["a2a_bad"], a2a["a2a_bad"]
        assert f"wrong on ranks [{n - 1}]: {n + 1} rows on rank {n - 1}, not divisible" in a2a["a2a_bad_graph"]
        assert "reducescatter supports Sum and Average" in a2a["rs_max"]
        assert a2a["after"] == [float(q) for q in range(n)]  # the job goes on
        syncbn = res["syncbn"]
        for key in ("plain_eager", "plain_function", "masked_eager", "masked_function"):
            *diffs, moved = syncbn[key]
            assert max(diffs) < 1e-5 and moved > 0.01, (key, syncbn[key])
        assert syncbn["fit"] < 1e-5 and syncbn["inference"] < 1e-5, syncbn
        join = res["join"]
        assert join["last"] == n - 1 and join["graph_last"] == 0 and join["after"] == [float(n)] * 2, join
        assert join["diff"] < 1e-6, join
        assert res["int_avg"]["int32"] == res["int_avg"]["expected"]
        assert res["bcast_opt"] == {"iterations": 5, "dtype": "int64", "others": [1.0] * len(res["bcast_opt"]["others"])}
        assert res["bcast_opt"]["others"]
        assert res["sparse"]["kinds"] == ["IndexedSlices"] and res["sparse"]["diff"] < 1e-6
        assert res["sparse_as_dense"]["kinds"] != ["IndexedSlices"] and res["sparse_as_dense"]["diff"] < 1e-6
        assert res["bpps_avg"] < 1e-6 and res["bpps_sum"] < 1e-6
        lr = res["lr"]
        steps = 3  # batches per epoch on every rank
        warm = [0.1 / n * ((e + b / steps + 1 / steps) * (n - 1) / 2 + 1) for e in range(2) for b in range(steps)]
        assert lr["warmup"] == pytest.approx(warm + [warm[-1]] * steps, rel=1e-6)
        # multiplier 0.5 from epoch 1: Horovod's 0.1 * 0.5 ** (epoch - 1) from epoch 1 on, the rate as it was before
        assert lr["schedule"] == pytest.approx([0.1] * steps + [0.1] * steps + [0.05] * steps, rel=1e-6)
        assert lr["schedule_logged"] == pytest.approx([0.1, 0.1, 0.05], rel=1e-6)
        assert res["built"] == [True, False, False]
        order = res["horovod_order"]
        assert order["predivide_tape"] < 1e-5 and order["keras_order"] < 1e-5, order
        assert order["keras_allreduce"] == n * (n + 1) / 2 and order["reducescatter"] == [1.0], order
        assert order["reducescatter_scaled"] == [6.0 * n] and order["grouped_reducescatter"] == [[float(n)]], order
        assert order["local_kept"], order
        for key in ("adasum_tape", "adasum_keras"):
            assert order[key].startswith("ValueError: op=Adasum (adaptive summation) is not supported by tunelab"), order
        # built inside the first step: broadcast after it (every rank root's weights and optimizer state);
        # a numpy integer metric averaged, a flag left alone
        assert res["lazy"]["count"] == [(n + 1) / 2] * 2 and res["lazy"]["flag"] == [True, True], res["lazy"]
        assert res["lazy"]["variables"] > 1
    assert len({res["lazy"]["digest"] for res in results}) == 1
    for res in results:  # one rank's first batch overflowed: every rank skipped it and halved its scale
        fp16 = res["fp16"]
        assert "pass DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer))" in fp16["refused"]
        assert fp16["same_optimizer"] and fp16["scale"] == 2.0 ** 14, fp16
    assert len({res["fp16"]["digest"] for res in results}) == 1
    assert results[0]["resume"]["kind"] == ["SGD", True, 2 * n]  # distributed again, its state kept
    for res in results:  # root's state everywhere, then on as one process on the global batches
        assert res["resume"]["diff"] < 1e-5 and res["resume"]["slots"] < 1e-5, res["resume"]
        assert res["resume"]["iterations"] == 2 * n + 2


def test_the_engine_reads_tensorflow_host_tensors_in_place_and_leaves_them_unchanged():
    results = run_ok("tf_inputs_kept", 2, limit_s=300)
    for res in results:
        assert len(res) == 6
        for key, checks in res.items():
            assert checks == {"kept": True, "eager": True, "graph": True}, (key, checks)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 7)])
def test_host_tensors_cross_to_the_engine_and_back_without_copies(dtype, shape):
    """A host tensor reaches the engine as a read-only view of its own buffer (DLPack), and a result in an
    aligned buffer comes back as a tensor on that memory; bfloat16 (which numpy's DLPack cannot carry)
    and empty tensors (nothing to share) are copied.  The values and dtypes survive both ways."""
    import numpy as np
    import tensorflow as tf

    from tunelab.tensorflow.ops import _TF_ALIGN, _aligned_empty, _from_engine, _to_engine

    t = tf.cast(tf.reshape(tf.range(int(np.prod(shape))), shape), dtype)
    a = _to_engine(t)
    copied = dtype == "bfloat16" or a.size == 0
    assert a.flags.writeable == copied and a.flags.owndata == copied  # a view of TensorFlow's buffer, else a copy
    out = _aligned_empty(a.shape, a.dtype)
    assert out.shape == a.shape and out.dtype == a.dtype and (out.size == 0 or out.ctypes.data % _TF_ALIGN == 0)
    out[...] = a
    back = _from_engine(out)
    zero_copy = not copied and out.size > 0
    assert isinstance(back, tf.Tensor) == zero_copy
    if zero_copy:
        out.flat[0] = 9  # the tensor is the buffer
        assert float(tf.reshape(back, [-1])[0]) == 9
        out.flat[0] = 0
    back = tf.convert_to_tensor(back)
    assert back.dtype == t.dtype and back.shape == t.shape
    assert np.array_equal(back.numpy().astype(np.float64), t.numpy().astype(np.float64))


def _run_script(script, tmp_path) -> subprocess.CompletedProcess:
    """``script`` run by this Python with a checkpoint path (``ck.keras`` in ``tmp_path``) as its argument,
    and a profile store of its own."""
    return subprocess.run([sys.executable, str(script), str(tmp_path / "ck.keras")], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "TUNELAB_HOME": str(tmp_path / "home")})


def test_the_keras_wrapper_keeps_an_optimizers_own_schedule_callable_rate_and_state(tmp_path):
    """The wrapper was rebuilt from the optimizer's config: a schedule class of the user's own (not
    registered with Keras) and a callable rate could not be rebuilt (TypeError, ValueError), and an
    optimizer that had stepped lost its state (iterations 3 became 0, Adam's moments zeros).  Each is
    checked against the same optimizer unwrapped, stepping on one rank."""
    script = tmp_path / "keep.py"
    script.write_text(
        "import numpy as np, tensorflow as tf, keras\nimport tunelab.tensorflow.keras as hvd\nhvd.init()\n"
        "class Warm(keras.optimizers.schedules.LearningRateSchedule):\n"
        "    def __init__(self, base): self.base = base\n"
        "    def __call__(self, step): return self.base * tf.minimum(1.0, tf.cast(step + 1, tf.float32) / 10.0)\n"
        "    def get_config(self): return {'base': self.base}\n"
        "def run(make, wrap, warm_steps):\n"
        "    v = keras.Variable(np.ones(3, 'float32'))\n"
        "    opt = make()\n"
        "    for k in range(warm_steps): opt.apply([tf.constant([1.0, 2.0, 3.0])], [v])\n"
        "    if wrap: opt = hvd.DistributedOptimizer(opt, load_profile=False)\n"
        "    for k in range(3): opt.apply([tf.constant([0.5, -1.0, 2.0])], [v])\n"
        "    return int(opt.iterations.numpy()), v.numpy().tolist()\n"
        "for name, make, warm in (('schedule', lambda: keras.optimizers.SGD(Warm(0.1)), 0),\n"
        "                         ('callable', lambda: keras.optimizers.SGD(learning_rate=lambda: 0.05), 0),\n"
        "                         ('stepped', lambda: keras.optimizers.Adam(0.1), 3)):\n"
        "    print(name, run(make, True, warm) == run(make, False, warm), run(make, True, warm)[0])\n"
        "v = keras.Variable(np.ones(3, 'float32'))\n"
        "opt = keras.optimizers.SGD(0.1, momentum=0.9)\n"
        "opt.apply([tf.constant([1.0, 2.0, 3.0])], [v])\n"
        "w = hvd.DistributedOptimizer(opt, backward_passes_per_step=2, load_profile=False)\n"
        "state = {x.path: x.numpy().tolist() for x in w.variables}\n"
        "of = lambda end: next(v for k, v in state.items() if k.endswith(end))\n"
        "print('accumulating', of('_momentum') == opt.variables[-1].numpy().tolist(), of('_gradient_accumulator'))\n"
        "hvd.shutdown()\n")
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "schedule True 3" in proc.stdout and "callable True 3" in proc.stdout, proc.stdout
    assert "stepped True 6" in proc.stdout, proc.stdout
    # with backward_passes_per_step the copy has accumulators the optimizer lacks: they start at zero
    assert "accumulating True [0.0, 0.0, 0.0]" in proc.stdout, proc.stdout


def test_a_model_saved_with_the_distributed_optimizer_loads_with_its_optimizer_state(tmp_path):
    """Keras records an optimizer by its class's module and name; the wrapper's were tunelab's, where no
    such class is, and a checkpoint of a model compiled with it could not be loaded.  It saves as the
    optimizer it wraps, its state (iterations, momentum) included: load it and wrap it again."""
    script = tmp_path / "save_load.py"
    script.write_text(
        "import sys, numpy as np, keras\nimport tunelab.tensorflow as hvd\nhvd.init()\n"
        "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss='mse',"
        " jit_compile=False)\n"
        "x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)\n"
        "m.fit(x, y, epochs=2, batch_size=4, verbose=0)\nm.save(sys.argv[1])\n"
        "m2 = keras.models.load_model(sys.argv[1])\n"
        "print('loaded', type(m2.optimizer).__name__, int(m2.optimizer.iterations.numpy()),"
        " bool(np.allclose(m.predict(x, verbose=0), m2.predict(x, verbose=0))))\n")
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loaded SGD 4 True" in proc.stdout, proc.stdout


def test_a_resumed_accumulating_optimizer_and_what_the_keras_wrapper_cannot_use(tmp_path):
    """A model trained with backward_passes_per_step=2 (summed) and saved: ``load_model`` refuses to guess
    how its passes added up, and told, trains on as plain Keras with the rate doubled (its accumulated
    gradients averaged) does all three epochs; an optimizer wrapped twice, one that is not Keras 3's,
    and the LR callbacks over a schedule are refused with a line that says what is wanted."""
    script = tmp_path / "resume.py"
    script.write_text(
        "import sys, numpy as np, keras\nimport tunelab.tensorflow as hvd\nhvd.init()\n"
        "rng = np.random.default_rng(0)\n"
        "x, y = rng.normal(size=(32, 3)).astype(np.float32), rng.normal(size=(32, 2)).astype(np.float32)\n"
        "def model():\n"
        "    keras.utils.set_random_seed(1)\n"
        "    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation='tanh'), keras.layers.Dense(2)])\n"
        "m = model()\n"
        "m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2,"
        " load_profile=False), loss='mse', jit_compile=False)\n"
        "m.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0)\nm.save(sys.argv[1])\n"
        "try:\n    hvd.load_model(sys.argv[1], load_profile=False)\n    print('unasked: loaded')\n"
        "except ValueError as exc:\n    print('unasked:', exc)\n"
        "m2 = hvd.load_model(sys.argv[1], backward_passes_per_step=2, load_profile=False)\n"
        "m2.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)\n"
        "ref = model()\n"
        "ref.compile(optimizer=keras.optimizers.SGD(0.2, momentum=0.9, gradient_accumulation_steps=2), loss='mse',"
        " jit_compile=False)\n"
        "ref.fit(x, y, epochs=3, batch_size=4, shuffle=False, verbose=0)\n"
        "print('resumed diff', max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(m2.weights, ref.weights)))\n"
        "for name, make in (('twice', lambda: hvd.DistributedOptimizer(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))),\n"
        "                   ('foreign', lambda: hvd.DistributedOptimizer(object()))):\n"
        "    try:\n        make()\n        print(name + ': accepted')\n"
        "    except TypeError as exc:\n        print(name + ':', exc)\n"
        "s = model()\n"
        "s.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay("
        "0.1, 10, 0.5)), load_profile=False), loss='mse', jit_compile=False)\n"
        "try:\n"
        "    s.fit(x, y, epochs=1, batch_size=4, verbose=0, callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, 1)])\n"
        "    print('schedule: accepted')\n"
        "except ValueError as exc:\n    print('schedule:', exc)\n")
    proc = _run_script(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = dict(line.split(": ", 1) if ": " in line else line.rsplit(" ", 1) for line in proc.stdout.splitlines())
    assert "the saved optimizer accumulates 2 passes" in lines["unasked"], proc.stdout
    assert float(lines["resumed diff"]) < 1e-6, proc.stdout
    assert lines["twice"].startswith("this optimizer is a DistributedOptimizer already"), proc.stdout
    assert lines["foreign"].startswith("DistributedOptimizer wraps a Keras 3 optimizer"), proc.stdout
    assert lines["schedule"].startswith("LearningRateWarmupCallback sets the optimizer's learning rate"), proc.stdout
