"""Training workloads: parameter counts, agreement with the shapes module, one real training step.

Counts are checked against figures published for the reference architectures, or against
a formula written out here independently of the code under test.
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tunelab.workloads import keras_models, shapes, torch_models

TINY_BERT = {"vocab": 1000, "hidden": 64, "layers": 2, "ffn": 128, "max_len": 64}


def bert_parameter_count(vocab, hidden, layers, ffn, max_len, num_classes, segments=2):
    """BERT's parameter count by hand: embeddings, per-layer attention/FFN/norms, pooler, classifier."""
    embeddings = (vocab + max_len + segments) * hidden + 2 * hidden
    attention = 4 * (hidden * hidden + hidden) + 2 * hidden
    feed_forward = (hidden * ffn + ffn) + (ffn * hidden + hidden) + 2 * hidden
    pooler = hidden * hidden + hidden
    classifier = hidden * num_classes + num_classes
    return embeddings + layers * (attention + feed_forward) + pooler + classifier


def count(params):
    return sum(math.prod(shape) for _, shape in params)


# --- shapes (no framework) ---------------------------------------------------------------------


def test_vgg16_shapes_have_the_published_parameter_count():
    params = shapes.vgg16_parameters()
    assert len(params) == 32 and len({name for name, _ in params}) == 32
    assert count(params) == 138_357_544
    assert shapes.gradient_shapes("vgg16")[:2] == [(1000,), (1000, 4096)]


def test_bert_shapes_match_the_formula_and_the_published_figure():
    params = shapes.bert_base_parameters()
    assert len(params) == 5 + 12 * 16 + 4
    # 109,482,240 for the BERT-base encoder with pooler, plus a 768 x 2 classifier
    assert count(params) == bert_parameter_count(30522, 768, 12, 3072, 512, 2) == 109_483_778
    assert count(shapes.bert_base_parameters(**TINY_BERT, num_classes=3)) == bert_parameter_count(
        **TINY_BERT, num_classes=3
    )
    assert shapes.gradient_shapes("bert")[0] == (2,)


# --- torch -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield torch
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "name, tensors, total",
    [("resnet50", 161, 25_557_032), ("vgg16", 32, 138_357_544), ("bert", 201, 109_483_778)],
)
def test_torch_models_match_the_shapes_module(torch, name, tensors, total):
    model = torch_models.build(name)
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert params == shapes.MODELS[name]()
    assert len(params) == tensors and torch_models.parameter_count(model) == total


def _train_step(torch, model, inputs, targets):
    model.train()
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("name, image_size", [("resnet50", 32), ("vgg16", 32)])
def test_torch_cnn_trains_on_a_tiny_batch(torch, name, image_size):
    torch.manual_seed(0)
    model = torch_models.build(name, num_classes=10)
    inputs, targets = torch_models.synthetic_batch(name, 2, image_size=image_size, num_classes=10)
    _train_step(torch, model, inputs, targets)


def test_torch_bert_trains_on_a_tiny_batch(torch):
    torch.manual_seed(0)
    model = torch_models.build("bert", heads=4, **TINY_BERT)
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert params == shapes.bert_base_parameters(**TINY_BERT)
    inputs, targets = torch_models.synthetic_batch("bert", 2, seq_len=16, vocab=TINY_BERT["vocab"])
    _train_step(torch, model, inputs, targets)
    assert model(inputs).shape == (2, 2)


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "bert"])
def test_torch_synthetic_batches_are_deterministic(torch, name):
    a = torch_models.synthetic_batch(name, 4, image_size=16, seed=3, seq_len=8)
    b = torch_models.synthetic_batch(name, 4, image_size=16, seed=3, seq_len=8)
    c = torch_models.synthetic_batch(name, 4, image_size=16, seed=4, seq_len=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    inputs, targets = a
    if name == "bert":
        assert inputs.shape == (4, 8) and inputs.dtype == torch.int64 and int(inputs.max()) < 30522
    else:
        assert inputs.shape == (4, 3, 16, 16) and inputs.dtype == torch.float32
    assert targets.dtype == torch.int64 and int(targets.max()) < torch_models.DEFAULT_CLASSES[name]


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="choose from"):
        torch_models.build("alexnet")
    with pytest.raises(ValueError, match="choose from"):
        keras_models.synthetic_batch("alexnet", 1)


def test_missing_frameworks_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    # and Keras: imported for the first time here, it would fail half-way for want of TensorFlow and
    # leave its half-made modules behind for every later test of this process
    monkeypatch.setitem(sys.modules, "keras", None)
    with pytest.raises(ImportError, match=r"pip install 'tunelab\[torch\]'"):
        torch_models.build("resnet50")
    with pytest.raises(ImportError, match=r"pip install 'tunelab\[tensorflow\]'"):
        keras_models.build("resnet50")


# --- TensorFlow's start-up lines ----------------------------------------------------------------


def test_native_start_up_lines_are_left_out_as_the_log_level_says(capfd):
    lines = [keras_models._ABSL_BANNER + "\n",
             "I0000 00:00:1.0  1 port.cc:153] oneDNN custom operations are on.\n",
             "W0000 00:00:1.0  1 x.cc:1] a warning\n",
             "E0000 00:00:1.0  1 cuda_platform.cc:52] failed call to cuInit: no driver\n",
             "a line of the program's own\n"]
    for level, kept in [(2, [3, 4]), (1, [2, 3, 4]), (0, [0, 1, 2, 3, 4])]:
        with keras_models._native_stderr_filtered([lambda line, lv=level: keras_models._hidden_by_level(line, lv)]):
            for line in lines:
                os.write(2, line.encode())  # as a C++ library writes: to the descriptor, not sys.stderr
        assert capfd.readouterr().err == "".join(lines[i] for i in kept), level
    # an error in the body still lets what it wrote through, and stderr is back where it was
    with pytest.raises(RuntimeError, match="in the body"), keras_models._native_stderr_filtered([]):
        os.write(2, b"E0000 before the error\n")
        raise RuntimeError("in the body")
    assert capfd.readouterr().err == "E0000 before the error\n"


def test_a_process_that_dies_inside_the_filter_still_shows_what_it_wrote():
    # a C++ library's fatal error aborts the process: the filter's own code never runs again, and the
    # held lines (the reason for the abort among them) must not vanish with it
    code = ("import os\n"
            "from tunelab.workloads import keras_models\n"
            "with keras_models._native_stderr_filtered([lambda line: True]):\n"
            "    os.write(2, b'I0000 an info line\\n')\n"
            "    os.write(2, b'F0000 cpu_feature_guard.cc:1] this CPU lacks what TensorFlow was built for\\n')\n"
            "    os.abort()\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "this CPU lacks what TensorFlow was built for" in done.stderr, done.stderr
    assert "I0000 an info line" in done.stderr and "died while" in done.stderr
    # and a body that ends normally leaves no watcher behind, nor a line of its own
    code = ("import os\n"
            "from tunelab.workloads import keras_models\n"
            "with keras_models._native_stderr_filtered([]):\n"
            "    os.write(2, b'kept\\n')\n"
            "try:\n"
            "    os.waitpid(-1, os.WNOHANG)\n"
            "except ChildProcessError:\n"
            "    print('no child left')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr == "kept\n" and done.stdout == "no child left\n"


@pytest.mark.parametrize("level", [None, "0"])
def test_tensorflow_is_imported_without_its_start_up_lines(level):
    pytest.importorskip("tensorflow")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    code = ("from tunelab.workloads.keras_models import configure_runtime, import_tensorflow\n"
            "import_tensorflow(); configure_runtime(1)\n")
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stderr
    start_up = [line for line in err.splitlines() if line.startswith(("I0000", "WARNING: All log messages"))]
    if level == "0":  # TensorFlow does print them (else the other case would pass for nothing)
        assert start_up, err
    else:
        assert start_up == [] and "cuInit" not in err, err


# --- keras -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras():
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    try:
        tf.config.threading.set_intra_op_parallelism_threads(2)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # the runtime already started in this process; keep its settings
        pass
    return keras


@pytest.mark.parametrize("name", ["resnet50", "vgg16", "bert"])
def test_keras_synthetic_batches_are_deterministic(name):
    a = keras_models.synthetic_batch(name, 4, image_size=16, seed=3, seq_len=8)
    b = keras_models.synthetic_batch(name, 4, image_size=16, seed=3, seq_len=8)
    c = keras_models.synthetic_batch(name, 4, image_size=16, seed=4, seq_len=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    expected = (4, 8) if name == "bert" else (4, 16, 16, 3)  # NHWC for Keras
    assert a[0].shape == expected and a[1].shape == (4,)


@pytest.mark.parametrize(
    "name, total",
    # Keras' ResNet-50 gives its convs biases: 25,636,712 rather than torch's 25,557,032.
    # Keras' VGG-16 flattens the final map, so the published count holds at 224 x 224 only.
    [("resnet50", 25_636_712), ("vgg16", 138_357_544), ("bert", 109_483_778)],
)
def test_keras_models_have_the_published_parameter_count(keras, name, total):
    keras.backend.clear_session()
    assert keras_models.build(name, image_size=224).count_params() == total


@pytest.mark.parametrize("name", ["resnet50", "vgg16"])
def test_keras_cnn_trains_on_a_tiny_batch(keras, name):
    keras.backend.clear_session()
    model = keras_models.build(name, image_size=32, num_classes=10)
    keras_models.compile_for_training(model)
    inputs, targets = keras_models.synthetic_batch(name, 2, image_size=32, num_classes=10)
    assert np.isfinite(model.train_on_batch(inputs, targets))


def test_keras_bert_trains_on_a_tiny_batch(keras):
    keras.backend.clear_session()
    model = keras_models.build("bert", seq_len=16, heads=4, **TINY_BERT)
    assert model.count_params() == bert_parameter_count(**TINY_BERT, num_classes=2)
    keras_models.compile_for_training(model)
    inputs, targets = keras_models.synthetic_batch("bert", 2, seq_len=16, vocab=TINY_BERT["vocab"])
    before = [w.numpy().copy() for w in model.trainable_weights]
    assert np.isfinite(model.train_on_batch(inputs, targets))
    assert model.predict(inputs, verbose=0).shape == (2, 2)
    changed = [not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights)]
    assert sum(changed) > len(changed) // 2  # the step reached most weights, not just the head


def test_in_the_lab_ranks_take_gpus_by_their_place_on_the_machine(monkeypatch) -> None:
    """The lab's hosts are network namespaces of one machine, each with its own local ranks: a rank's GPU
    is picked by its world rank there (by its local rank, every lab host's first rank took GPU 0), and
    ranks on different lab hosts that end up on one GPU count as sharing it."""
    from types import SimpleNamespace

    from tunelab.lab import launch
    from tunelab.workloads import torch_device

    monkeypatch.setattr(launch, "current_lab", lambda: None)
    assert torch_device.gpu_slot(5, 1) == 1
    monkeypatch.setattr(launch, "current_lab", lambda: object())
    assert torch_device.gpu_slot(5, 1) == 5
    monkeypatch.setattr(torch_device, "gpu_id", lambda device: device)
    world = SimpleNamespace(allgather=lambda mine: ["gpu0", "gpu1", "gpu0"])  # 3 lab hosts, 2 GPUs
    assert torch_device.ranks_share_a_gpu(world, "gpu0") is True
    world = SimpleNamespace(allgather=lambda mine: ["gpu0", "gpu1"])
    assert torch_device.ranks_share_a_gpu(world, "gpu0") is False
