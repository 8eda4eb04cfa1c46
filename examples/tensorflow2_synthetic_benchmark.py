"""Synthetic-data training throughput with Horovod's TF2 API (ported from ``horovod.tensorflow`` by its
import line).

    mpiexec -n 2 python examples/tensorflow2_synthetic_benchmark.py --num-iters 3
"""

import argparse
import timeit

import numpy as np
import tensorflow as tf

import tunelab.tensorflow as hvd

parser = argparse.ArgumentParser(description="TensorFlow 2 synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size")
parser.add_argument("--image-size", type=int, default=64, help="input image size")
parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
args = parser.parse_args()

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)

model = tf.keras.Sequential([
    tf.keras.Input((args.image_size, args.image_size, 3)),
    tf.keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
    tf.keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
    tf.keras.layers.GlobalAveragePooling2D(),
    tf.keras.layers.Dense(1000)])
opt = tf.optimizers.SGD(0.01)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)


@tf.function
def benchmark_step(first_batch):
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.losses.sparse_categorical_crossentropy(target, probs, from_logits=True)
    # Horovod: wrap the tape to average gradients over all ranks.
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))
    # Horovod: broadcast initial variables from rank 0 once the optimizer's are created.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log(f"Batch size: {args.batch_size}, number of ranks: {hvd.size()}")
benchmark_step(first_batch=True)
timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)
img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per rank: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")
