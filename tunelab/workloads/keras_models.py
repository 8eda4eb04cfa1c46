"""Keras 3 (TensorFlow backend) training workloads on synthetic data: ResNet-50, VGG-16, a BERT-like encoder.

These mirror :mod:`tunelab.workloads.torch_models` so the engine can be driven
from either framework.  The CNNs are Keras' own application models with random
weights (``weights=None``; nothing is downloaded); all three output logits so
one loss fits every workload.  Keras' ResNet-50 differs from the torch one in
ways the shapes module does not model (it puts biases on its convs and the stride
on the first 1x1 conv), and its VGG-16 flattens instead of pooling to 7x7, so its
classifier size depends on the image size; only at 224x224 does it have the
published 138,357,544 parameters.

TensorFlow and Keras are imported lazily so that ``tunelab`` imports without them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import keras

DEFAULT_CLASSES = {"resnet50": 1000, "vgg16": 1000, "bert": 2}


# What TensorFlow's C++ libraries print while they load, before its log level applies: absl's banner
# and lines of a severity the level hides (I: 0, W: 1, E: 2; TF_CPP_MIN_LOG_LEVEL hides those below it).
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_LOG_LINE = re.compile(r"^([IWEF])\d{4} ")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}


def _log_level() -> int:
    """TensorFlow's C++ log level as it reads it: the variable, or TensorFlow's own 0 without it."""
    text = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")
    return int(text) if text.strip().isdigit() else 0


def _hidden_by_level(line: str, level: int) -> bool:
    if line.startswith(_ABSL_BANNER):
        return level >= 1
    m = _LOG_LINE.match(line)
    return m is not None and _SEVERITY[m.group(1)] < level


# Run by a small process beside one that filters its stderr: it waits on a pipe from that process and,
# should the pipe close without the word that the filtered block ended (the process died inside it: a
# C++ library's fatal abort, say), writes out the held file, whose last lines say why it died.
_WATCH = """import os, sys
if sys.stdin.buffer.read() != b"ended":
    fd = int(sys.argv[1])
    os.lseek(fd, 0, 0)
    held = b"".join(iter(lambda: os.read(fd, 1 << 16), b""))
    sys.stderr.buffer.write(b"tunelab: the process died while its native output was held back "
                            b"(TensorFlow's start-up); what it wrote then:\\n" + held)
"""


def _watch_held(held: Any) -> subprocess.Popen | None:
    """Start the watcher of ``held`` (see ``_WATCH``) with this process's stderr as its own; None where
    it cannot start (the filter still works, but a death inside it loses the held lines)."""
    try:
        return subprocess.Popen([sys.executable, "-S", "-E", "-c", _WATCH, str(held.fileno())],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(held.fileno(),))
    except (OSError, ValueError):
        return None


def _release(watch: subprocess.Popen | None) -> None:
    """The filtered block ended: the watcher leaves without a word."""
    if watch is None:
        return
    try:
        watch.communicate(b"ended", timeout=30)
    except (OSError, subprocess.SubprocessError):
        watch.kill()
        watch.wait()


@contextlib.contextmanager
def _native_stderr_filtered(drop: list[Callable[[str], bool]]) -> Iterator[None]:
    """Run the body with file descriptor 2 (where C++ libraries write) sent to a temporary file, then
    pass what it wrote on to stderr, less the lines for which any function in ``drop`` (which the body
    may still append to) says so.  Python's own writes to stderr in the body go the same way.  A process
    that dies inside the body (a fatal abort) runs no more of its own code, so a small watcher process
    (``_WATCH``) writes out everything the body wrote instead."""
    sys.stderr.flush()
    held = None
    try:
        held = tempfile.TemporaryFile()  # noqa: SIM115 (closed below: by the with, or here if dup fails)
        saved = os.dup(2)
    except OSError:  # nowhere to hold it, or no stderr to restore: nothing is filtered, nothing is lost
        if held is not None:
            held.close()
        yield
        return
    with held:
        watch = _watch_held(held)
        try:
            os.dup2(held.fileno(), 2)
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            _release(watch)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not any(d(line) for d in drop)))
            sys.stderr.flush()


def import_tensorflow() -> Any:
    """Import TensorFlow for tunelab's own commands, whose progress lines would otherwise sit among its
    start-up lines.  TensorFlow 2.21's C++ libraries write INFO lines (oneDNN, "could not find cuda
    drivers") while they load, before ``TF_CPP_MIN_LOG_LEVEL`` applies; here they are left out as that
    level says (2 unless set: errors are kept; 0 keeps everything)."""
    if sys.modules.get("tensorflow") is not None:  # imported already (None: blocked, the import says so)
        return sys.modules["tensorflow"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    level = _log_level()
    with _native_stderr_filtered([lambda line: _hidden_by_level(line, level)]):
        import tensorflow as tf
    return tf


def configure_runtime(threads: int) -> None:
    """Set TensorFlow up for one rank of a CPU run, before its runtime starts (it ignores later changes):
    ``threads`` for its ops, one inter-op thread (ranks sharing a host must not oversubscribe its
    cores), and no GPU.  The Keras workloads train on the CPU; a TensorFlow that sees GPUs would
    otherwise place every rank's ops on the first one, each rank reserving nearly all its memory.
    Looking for GPUs on a machine without a CUDA driver logs a failed ``cuInit`` as an error; when
    none is found that line only says so, and is left out (TF_CPP_MIN_LOG_LEVEL=0 keeps it)."""
    tf = import_tensorflow()
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    level = _log_level()
    drop: list[Callable[[str], bool]] = [lambda line: _hidden_by_level(line, level)]
    with _native_stderr_filtered(drop):
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus and level > 0:
            drop.append(lambda line: "cuInit" in line)
    if gpus:
        tf.config.set_visible_devices([], "GPU")


def _keras() -> Any:
    """Import Keras on TensorFlow, or explain which extra installs it."""
    try:
        import keras
        import tensorflow  # noqa: F401  (Keras 3 needs the backend importable)
    except ImportError as exc:
        raise ImportError(
            "the Keras workloads need TensorFlow: pip install 'tunelab[tensorflow]'"
        ) from exc
    return keras


def resnet50(image_size: int = 224, num_classes: int = 1000) -> keras.Model:
    """Keras' ResNet-50 with random weights on S x S x 3 images (S >= 32), logits out."""
    keras = _keras()
    return keras.applications.ResNet50(
        weights=None, input_shape=(image_size, image_size, 3), classes=num_classes,
        classifier_activation=None,
    )


def vgg16(image_size: int = 224, num_classes: int = 1000) -> keras.Model:
    """Keras' VGG-16 with random weights on S x S x 3 images (S >= 32), logits out."""
    keras = _keras()
    return keras.applications.VGG16(
        weights=None, input_shape=(image_size, image_size, 3), classes=num_classes,
        classifier_activation=None,
    )


@functools.cache
def _embeddings_class() -> type:
    """BERT's input layer as one Keras layer: token + position + segment tables, LayerNorm, dropout.

    A custom layer is needed because the position and segment terms depend on no input
    tensor; built from plain ops in a functional model they would be constants, not weights.
    """
    keras = _keras()

    class Embeddings(keras.layers.Layer):
        def __init__(self, vocab: int, hidden: int, max_len: int, dropout: float, **kw: Any) -> None:
            super().__init__(**kw)
            self.vocab, self.hidden, self.max_len = vocab, hidden, max_len
            self.norm = keras.layers.LayerNormalization(epsilon=1e-12, name="norm")
            self.dropout = keras.layers.Dropout(dropout)

        def build(self, input_shape: tuple[int | None, ...]) -> None:
            init = keras.initializers.TruncatedNormal(stddev=0.02)
            self.word = self.add_weight(shape=(self.vocab, self.hidden), initializer=init, name="word")
            self.position = self.add_weight(shape=(self.max_len, self.hidden), initializer=init, name="position")
            self.segment = self.add_weight(shape=(2, self.hidden), initializer=init, name="segment")
            self.norm.build((*input_shape, self.hidden))

        def call(self, ids: Any, training: bool | None = None) -> Any:
            ops = keras.ops
            # Synthetic inputs are one unpadded segment: position i, segment 0 for every token.
            x = ops.take(self.word, ids, axis=0)
            x = x + self.position[: ops.shape(ids)[1]] + self.segment[0]
            return self.dropout(self.norm(x), training=training)

        def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
            return (*input_shape, self.hidden)

    return Embeddings


def _encoder_layer(x: Any, index: int, heads: int, ffn: int, dropout: float) -> Any:
    """One post-LayerNorm transformer block with a GELU feed-forward, applied functionally to ``x``."""
    keras = _keras()
    layers = keras.layers
    hidden = x.shape[-1]
    dense = {"kernel_initializer": keras.initializers.TruncatedNormal(stddev=0.02)}
    name = f"layer_{index}"
    attended = layers.MultiHeadAttention(
        heads, key_dim=hidden // heads, dropout=dropout, name=f"{name}_attention", **dense
    )(x, x)
    x = layers.Add()([x, layers.Dropout(dropout)(attended)])
    x = layers.LayerNormalization(epsilon=1e-12, name=f"{name}_attention_norm")(x)
    y = layers.Dense(ffn, activation="gelu", name=f"{name}_intermediate", **dense)(x)
    y = layers.Dense(hidden, name=f"{name}_output", **dense)(y)
    x = layers.Add()([x, layers.Dropout(dropout)(y)])
    return layers.LayerNormalization(epsilon=1e-12, name=f"{name}_output_norm")(x)


def bert_encoder(
    seq_len: int = 128,
    vocab: int = 30522,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    ffn: int = 3072,
    max_len: int = 512,
    num_classes: int = 2,
    dropout: float = 0.1,
) -> keras.Model:
    """A BERT-base-like classifier on N x ``seq_len`` int32 token ids, logits out.

    Same parameter count as the torch encoder (109,483,778 at the defaults); Keras keeps
    attention weights per head (hidden x heads x head_dim) rather than as square matrices.
    """
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
    if seq_len > max_len:
        raise ValueError(f"seq_len {seq_len} exceeds the {max_len} position embeddings")
    keras = _keras()
    dense = {"kernel_initializer": keras.initializers.TruncatedNormal(stddev=0.02)}
    ids = keras.Input(shape=(seq_len,), dtype="int32", name="token_ids")
    x = _embeddings_class()(vocab, hidden, max_len, dropout, name="embeddings")(ids)
    for index in range(layers):
        x = _encoder_layer(x, index, heads, ffn, dropout)
    first = x[:, 0]  # the [CLS] position, which the pooler summarises
    pooled = keras.layers.Dense(hidden, activation="tanh", name="pooler", **dense)(first)
    pooled = keras.layers.Dropout(dropout)(pooled)
    logits = keras.layers.Dense(num_classes, name="classifier", **dense)(pooled)
    return keras.Model(ids, logits, name="bert_encoder")


MODELS: dict[str, Callable[..., Any]] = {"resnet50": resnet50, "vgg16": vgg16, "bert": bert_encoder}


def build(name: str, image_size: int = 224, num_classes: int | None = None, seq_len: int = 128,
          **kw: Any) -> keras.Model:
    """Build workload ``name`` with random weights; ``image_size`` applies to CNNs, ``seq_len`` to bert."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    classes = DEFAULT_CLASSES[name] if num_classes is None else num_classes
    if name == "bert":
        return bert_encoder(seq_len=seq_len, num_classes=classes, **kw)
    return MODELS[name](image_size=image_size, num_classes=classes, **kw)


def compile_for_training(model: keras.Model, learning_rate: float = 0.01, jit_compile: bool = False) -> None:
    """Compile ``model`` with SGD and a from-logits sparse cross-entropy, ready for ``train_on_batch``.

    XLA is off by default: compiling a whole ResNet step with it costs far more on a CPU
    than the few steps a benchmark or test runs.
    """
    keras = _keras()
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )


def synthetic_batch(
    name: str,
    batch_size: int,
    image_size: int = 224,
    seed: int = 0,
    seq_len: int = 128,
    num_classes: int | None = None,
    vocab: int = 30522,
) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic (inputs, targets) batch as numpy arrays, which Keras accepts directly.

    CNNs get N x S x S x 3 (NHWC, Keras' layout) float32 images, the encoder N x ``seq_len``
    int32 token ids below ``vocab``; targets are int32 class indices.  No TensorFlow import needed.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    classes = DEFAULT_CLASSES[name] if num_classes is None else num_classes
    rng = np.random.default_rng(seed)
    if name == "bert":
        inputs = rng.integers(0, vocab, size=(batch_size, seq_len), dtype=np.int32)
    else:
        inputs = rng.standard_normal((batch_size, image_size, image_size, 3), dtype=np.float32)
    targets = rng.integers(0, classes, size=(batch_size,), dtype=np.int32)
    return inputs, targets
