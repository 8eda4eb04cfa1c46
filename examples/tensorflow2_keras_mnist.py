"""MNIST-style Keras training with Horovod's API on generated 28x28 digits (no download); ported from
``horovod.tensorflow.keras`` by its import line.

    mpiexec -n 2 python examples/tensorflow2_keras_mnist.py --epochs 2
"""

import argparse

import numpy as np
import tensorflow as tf

import tunelab.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description="Keras MNIST example (generated data)")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32)
args = parser.parse_args()

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)

# Generated digits: ten class prototypes plus noise, a different shard on every rank.
rng = np.random.default_rng(hvd.rank())
prototypes = np.random.default_rng(0).random((10, 28, 28, 1)).astype(np.float32)
labels = rng.integers(0, 10, args.steps_per_epoch * args.batch_size)
images = prototypes[labels] + 0.3 * rng.standard_normal((len(labels), 28, 28, 1)).astype(np.float32)
dataset = tf.data.Dataset.from_tensor_slices((images, labels.astype(np.int64))).repeat().shuffle(1000).batch(
    args.batch_size)

mnist_model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation="relu"),
    tf.keras.layers.Dense(10, activation="softmax"),
])

# Horovod: adjust learning rate based on number of ranks, wrap the optimizer.
scaled_lr = 0.001 * hvd.size()
opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr))
mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"],
                    jit_compile=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0, average metrics, warm the learning rate up.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
]
verbose = 2 if hvd.rank() == 0 else 0
mnist_model.fit(dataset, steps_per_epoch=args.steps_per_epoch, callbacks=callbacks, epochs=args.epochs,
                verbose=verbose)
