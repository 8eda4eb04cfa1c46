"""Horovod-parity cases for tunelab.tensorflow (re-exported by mpi_tf_cases.py): references are
single-process TensorFlow/numpy computations from every rank's regenerated inputs."""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import tunelab.tensorflow as tl
import tunelab.tensorflow.keras as hvd


def _arr(n: int, shape: tuple, seed: int) -> list[np.ndarray]:
    return [np.random.default_rng((seed, q)).standard_normal(shape) for q in range(n)]


def _err(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - TF wraps py_function errors in its own types
        return f"{type(exc).__name__}: {exc}"
    return ""


def errors(r: int, n: int) -> dict:
    last = r == n - 1
    out = {"shape": _err(lambda: hvd.allreduce(tf.ones([3 + last]), name="e.shape")),
           "root": _err(lambda: hvd.broadcast(tf.ones([2]), root_rank=int(last), name="e.root")),
           "graph": _err(tf.function(lambda: hvd.allreduce(tf.ones([2, 1 + last]), name="e.graph")))}
    out["after"] = hvd.allreduce(tf.constant([float(r)] * 2), op=hvd.Sum, name="e.after").numpy().tolist()
    scalar = tf.function(lambda: hvd.allreduce(tf.constant(float(r)), name="scalar"))()  # 0-d, in a graph
    out["scalar"] = [scalar.shape.as_list(), float(scalar)]
    # Horovod's prescale and postscale factors, eagerly, in a graph and under a tape; calls it refuses
    x = tf.constant([1.0, 2.0]) * float(r + 1)
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, name="s.eager", prescale_factor=2.0,
                                  postscale_factor=0.25).numpy().tolist()
    out["scaled_fn"] = tf.function(lambda: hvd.allreduce(x, op=hvd.Sum, name="s.fn", prescale_factor=2.0,
                                                         postscale_factor=0.25))().numpy().tolist()
    v = tf.Variable([1.0, 1.0, 1.0])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(hvd.allreduce(v, op=hvd.Sum, name="s.grad", prescale_factor=2.0, postscale_factor=3.0))
    out["scaled_grad"] = tape.gradient(y, v).numpy().tolist()
    out["both_ops"] = _err(lambda: hvd.allreduce(x, average=True, op=hvd.Sum))
    out["mixed_int_avg"] = _err(lambda: hvd.grouped_allreduce([tf.ones([2]), tf.ones([2], tf.int32)], name="mixed"))
    return out


def gradients(r: int, n: int) -> dict:
    """d/dx_r of sum_q <w_q, reduce(x)> through hvd.allreduce in a GradientTape, eager and in tf.function."""
    xs, ws = _arr(n, (4,), 1), _arr(n, (4,), 2)
    out = {}
    for op, fn in ((hvd.Sum, np.sum), (hvd.Average, np.mean)):
        expected = fn(ws, axis=0)  # d/dx_r of sum_q <w_q, sum/mean_q x_q> is sum/mean_q w_q
        for mode in ("eager", "function"):
            x = tf.Variable(xs[r])

            def grad(x=x, op=op, mode=mode) -> tf.Tensor:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(ws[r] * hvd.allreduce(x, op=op, name=f"g.{op}.{mode}"))
                return tape.gradient(loss, x)

            g = (tf.function(grad) if mode == "function" else grad)()
            out[f"{op}_{mode}"] = float(np.abs(g.numpy() - expected).max())
    # allgather (rows differ per rank): this rank's rows of the mean of every rank's weights
    total = n * (n + 1) // 2
    xg, wg = _arr(n, (r + 1, 3), 3)[r], _arr(n, (total, 3), 4)
    start = r * (r + 1) // 2
    expected = np.mean(wg, axis=0)[start:start + r + 1]
    xv = tf.Variable(xg)
    for mode in ("eager", "function"):
        def ggrad(mode=mode) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(wg[r] * hvd.allgather(xv, name=f"g.gather.{mode}"))
            return tape.gradient(loss, xv)

        g = (tf.function(ggrad) if mode == "function" else ggrad)()
        out[f"allgather_{mode}"] = float(np.abs(g.numpy() - expected).max())
    # broadcast from the last rank: the mean of the weights on the root, zero elsewhere
    wb = _arr(n, (4,), 5)
    expected = np.mean(wb, axis=0) if r == n - 1 else np.zeros(4)
    xb = tf.Variable(_arr(n, (4,), 6)[r])
    for mode in ("eager", "function"):
        def bgrad(mode=mode) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(wb[r] * hvd.broadcast(xb, root_rank=n - 1, name=f"g.bcast.{mode}"))
            return tape.gradient(loss, xb)

        g = (tf.function(bgrad) if mode == "function" else bgrad)()
        out[f"broadcast_{mode}"] = float(np.abs(g.numpy() - expected).max())
    return out


def alltoall_reducescatter(r: int, n: int) -> dict:
    """alltoall and reducescatter against numpy from every rank's regenerated inputs: values, received
    counts, gradients of sum_q <w_q, out_q> (eager and in tf.function), and bad plans."""
    out = {}
    # alltoall: rank q sends (q + j) % 3 rows to rank j
    splits = [[(q + j) % 3 for j in range(n)] for q in range(n)]
    xs = [np.random.default_rng((7, q)).standard_normal((sum(splits[q]), 2)) for q in range(n)]
    def part(q: int, j: int) -> np.ndarray:  # rows rank q sends to rank j
        return xs[q][sum(splits[q][:j]):sum(splits[q][:j + 1])]

    want = np.concatenate([part(q, r) for q in range(n)])
    ws = [np.random.default_rng((8, j)).standard_normal((sum(splits[q][j] for q in range(n)), 2)) for j in range(n)]
    # d/dx_r: the weights of the rows rank r sent, from the rank that received them, where they landed
    expected = np.concatenate([ws[j][sum(splits[q][j] for q in range(r)):][:splits[r][j]] for j in range(n)])
    x = tf.Variable(xs[r])
    for mode in ("eager", "function"):
        def a2a(mode=mode):
            with tf.GradientTape() as tape:
                got, counts = tl.alltoall(x, splits=tf.constant(splits[r]), name=f"a2a.{mode}")
                loss = tf.reduce_sum(ws[r] * got)
            return got, counts, tape.gradient(loss, x)

        got, counts, g = (tf.function(a2a) if mode == "function" else a2a)()
        out[f"a2a_{mode}"] = [float(np.abs(got.numpy() - want).max()), counts.numpy().tolist() == [splits[q][r] for q in range(n)],
                              float(np.abs(g.numpy() - expected).max())]
    ints = tl.alltoall(tf.constant([10 * r + j for j in range(2 * n)]), name="a2a.int")  # equal parts, no counts
    out["a2a_int"] = ints.numpy().tolist() == [10 * q + 2 * r + k for q in range(n) for k in range(2)]
    # reducescatter of 2n + 1 rows (uneven: the first rank gets three), Sum and Average, grouped with a 1-d one
    ys = [np.random.default_rng((9, q)).standard_normal((2 * n + 1, 3)) for q in range(n)]
    zs = [np.random.default_rng((10, q)).standard_normal(n + 2) for q in range(n)]
    def rows(total: int, j: int) -> tuple[int, int]:
        base, extra = divmod(total, n)
        return j * base + min(j, extra), base + (j < extra)

    for op, fn in ((tl.Sum, np.sum), (tl.Average, np.mean)):
        (ys0, yc), (zs0, zc) = rows(2 * n + 1, r), rows(n + 2, r)
        want_y, want_z = fn(ys, axis=0)[ys0:ys0 + yc], fn(zs, axis=0)[zs0:zs0 + zc]
        wy = [np.random.default_rng((11, j)).standard_normal((rows(2 * n + 1, j)[1], 3)) for j in range(n)]
        scale = 1.0 if op == tl.Sum else 1.0 / n
        y, z = tf.Variable(ys[r]), tf.Variable(zs[r])
        for mode in ("eager", "function"):
            def rs(op=op, mode=mode, y=y, z=z, wy=wy):
                with tf.GradientTape() as tape:
                    gy, gz = tl.grouped_reducescatter([y, z], op=op, name=f"rs.{op}.{mode}")
                    loss = tf.reduce_sum(wy[r] * gy) + tf.reduce_sum(gz)
                return gy, gz, tape.gradient(loss, [y, z])

            gy, gz, (dy, dz) = (tf.function(rs) if mode == "function" else rs)()
            out[f"rs_{op}_{mode}"] = [float(np.abs(gy.numpy() - want_y).max()), float(np.abs(gz.numpy() - want_z).max()),
                                      float(np.abs(dy.numpy() - scale * np.concatenate(wy)).max()),
                                      float(np.abs(dz.numpy() - scale).max())]
    last = r == n - 1
    out["a2a_bad"] = _err(lambda: tl.alltoall(tf.ones([n]), splits=[1] * (n + last), name="a2a.bad"))
    out["a2a_bad_graph"] = _err(tf.function(lambda: tl.alltoall(tf.ones([n + last]), name="a2a.badg")))
    out["rs_max"] = _err(lambda: tl.reducescatter(tf.ones([n]), op=tl.Max))
    out["after"] = tl.alltoall(tf.fill([n], float(r)), name="a2a.after").numpy().tolist()
    return out


def integer_average(r: int, n: int) -> dict:
    base = np.array([-7, -6, -5, -4, -2, -1, 0, 1, 4, 5, 7, 11, -11])
    vals = [base * (q + 1) + (q == 0) for q in range(n)]
    sums = np.sum(vals, axis=0)
    expected = [int(s // n) if s >= 0 else -int((-s) // n) for s in sums]
    got = hvd.allreduce(tf.constant(vals[r], dtype=tf.int32), name="ia").numpy().tolist()
    return {"expected": expected, "int32": got}


def broadcast_optimizer_variables(r: int, n: int) -> dict:
    """hvd.broadcast_variables(opt.variables) inside a tf.function, int64 iteration counter included."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    opt.iterations.assign(5 + r)
    for v in opt.variables[1:]:
        v.assign(tf.fill(v.shape, tf.cast(1.0 + r, v.dtype)))  # the root's 1.0 is no initial value
    tf.function(lambda: hvd.broadcast_variables(opt.variables, root_rank=0))()
    return {"iterations": int(opt.iterations.numpy()), "dtype": opt.iterations.dtype,
            "others": [float(np.abs(v.numpy()).max()) for v in opt.variables[1:]]}


def embedding_training(r: int, n: int, sparse_as_dense: bool) -> dict:
    """An embedding's IndexedSlices gradients reduced by allgather (or densified): weights vs one process."""
    def build() -> keras.Model:
        keras.utils.set_random_seed(4)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(13, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(2)])

    def batch(step: int, q: int):
        rng = np.random.default_rng((step, q, 9))
        return rng.integers(0, 13, (4, 3)).astype(np.int32), rng.standard_normal((4, 2)).astype(np.float32)

    def loss(model, x, y):
        return tf.reduce_mean((model(x) - y) ** 2)

    model, ref = build(), build()
    opt, ref_opt = keras.optimizers.SGD(0.3), keras.optimizers.SGD(0.3)
    kinds = set()
    for step in range(3):
        with tf.GradientTape() as tape:
            value = loss(model, *batch(step, r))
        tape = tl.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense, load_profile=False)
        grads = tape.gradient(value, model.trainable_variables)
        kinds.add(type(grads[0]).__name__)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        with tf.GradientTape() as tape:
            value = sum(loss(ref, *batch(step, q)) for q in range(n)) / n
        ref_opt.apply_gradients(zip(tape.gradient(value, ref.trainable_variables), ref.trainable_variables))
    diff = max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(model.weights, ref.weights))
    return {"diff": diff, "kinds": sorted(kinds)}


PER_RANK = 4


def _data(batches: int, n: int):
    rng = np.random.default_rng(77)
    return (rng.standard_normal((batches * n * PER_RANK, 6)).astype(np.float32),
            rng.integers(0, 3, batches * n * PER_RANK).astype(np.int32))


def _model() -> keras.Model:
    keras.utils.set_random_seed(8)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _rank_rows(x: np.ndarray, r: int, n: int, micro: int) -> np.ndarray:
    """Rank r's rows when each global batch of micro * n * PER_RANK rows is split by rank."""
    per_step = micro * n * PER_RANK
    return np.concatenate([x[s:s + per_step][r * micro * PER_RANK:(r + 1) * micro * PER_RANK]
                           for s in range(0, len(x), per_step)])


def fit_accumulated(r: int, n: int, average: bool) -> float:
    """Keras DistributedOptimizer with backward_passes_per_step=2 against one process on the global batches."""
    x, y = _data(4, n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5),
                                                     backward_passes_per_step=2,
                                                     average_aggregated_gradients=average, load_profile=False),
                  loss=loss, jit_compile=False)
    model.fit(_rank_rows(x, r, n, 2), _rank_rows(y, r, n, 2), batch_size=PER_RANK, epochs=1, shuffle=False,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = _model()  # summed micro-batch gradients are the mean times 2: SGD with twice the learning rate
    ref.compile(optimizer=keras.optimizers.SGD(0.1 if average else 0.2, momentum=0.5), loss=loss, jit_compile=False)
    ref.fit(x, y, batch_size=2 * n * PER_RANK, epochs=1, shuffle=False, verbose=0)
    return max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(model.weights, ref.weights))


def _bn_model(layer: type) -> keras.Model:
    keras.utils.set_random_seed(9)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), layer(momentum=0.8),
                             keras.layers.Activation("tanh"), keras.layers.Dense(3)])


def sync_batch_norm(comm, r: int, n: int) -> dict:
    """hvd.SyncBatchNormalization against keras' BatchNormalization on the global batch in one process:
    rank q holds 2 + q rows (shapes differ), with and without a Keras mask, eagerly and in a tf.function:
    outputs, input gradients, the parameters' gradients summed over ranks (by MPI) and the moving
    statistics; then model.fit with the DistributedOptimizer against one process on the global batches."""
    rows = [2 + q for q in range(n)]
    start = sum(rows[:r])
    xs, ws = np.random.default_rng(31).standard_normal((2, sum(rows), 3, 4)).astype(np.float32)
    masks = np.random.default_rng(32).random((sum(rows), 3)) > 0.3
    out: dict = {}
    for masked in (False, True):
        for mode in ("eager", "function"):
            def run(layer, x, w, m, mode=mode):
                xv = tf.Variable(x)

                def step():
                    with tf.GradientTape() as tape:
                        y = layer(xv, training=True, mask=None if m is None else tf.constant(m))
                        loss = tf.reduce_sum(y * w)
                    return [y, *tape.gradient(loss, [xv, *layer.trainable_variables])]

                got = (tf.function(step) if mode == "function" else step)()
                return [t.numpy() for t in got] + [v.numpy() for v in layer.non_trainable_variables]

            mine, ref = hvd.SyncBatchNormalization(momentum=0.5), keras.layers.BatchNormalization(momentum=0.5)
            mask = masks if masked else None
            got = run(mine, xs[start:start + rows[r]], ws[start:start + rows[r]],
                      None if mask is None else mask[start:start + rows[r]])
            want = run(ref, xs, ws, mask)
            y, dx, dgamma, dbeta, mean, var = got
            dgamma, dbeta = (comm.allreduce(g.astype(np.float64)) for g in (dgamma, dbeta))  # MPI's sum
            out[f"{'masked' if masked else 'plain'}_{mode}"] = [
                float(np.abs(y - want[0][start:start + rows[r]]).max()),
                float(np.abs(dx - want[1][start:start + rows[r]]).max()),
                float(np.abs(dgamma - want[2]).max()), float(np.abs(dbeta - want[3]).max()),
                float(np.abs(mean - want[4]).max()), float(np.abs(var - want[5]).max()),
                float(np.abs(want[4]).max())]  # (the moving mean moved: the check is not of zeros)
    x, y = _data(3, n)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _bn_model(hvd.SyncBatchNormalization)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), load_profile=False), loss=loss,
                  jit_compile=False)
    model.fit(_rank_rows(x, r, n, 1), _rank_rows(y, r, n, 1), batch_size=PER_RANK, epochs=2, shuffle=False,
              verbose=0)
    ref = _bn_model(keras.layers.BatchNormalization)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=False)
    ref.fit(x, y, batch_size=n * PER_RANK, epochs=2, shuffle=False, verbose=0)
    out["fit"] = max(float(np.abs(a.numpy() - b.numpy()).max()) for a, b in zip(model.weights, ref.weights))
    out["inference"] = float(np.abs(model.predict(x, verbose=0) - ref.predict(x, verbose=0)).max())
    return out


def join_uneven(r: int, n: int) -> dict:
    """Rank q has 2 + q batches (a tf.function step with DistributedGradientTape); ranks that ran out
    join and contribute zeros; averages divide by n, as in Horovod.  Reference: one process."""
    def batch(step: int, q: int):
        g = np.random.default_rng((41, step, q))
        return g.standard_normal((3, 4)).astype(np.float32), g.standard_normal((3, 2)).astype(np.float32)

    def make():
        return tf.Variable(np.random.default_rng(40).standard_normal((4, 2)).astype(np.float32))

    w = make()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w - y) ** 2)
        (g,) = tl.DistributedGradientTape(tape).gradient(loss, [w])
        w.assign_sub(0.1 * g)

    for s in range(2 + r):
        step(*batch(s, r))
    last = hvd.join()
    after = hvd.allreduce(tf.ones(2), name="join.after", op=hvd.Sum).numpy().tolist()
    ref = make()
    for s in range(2 + r):  # this rank's steps (a rank that joined applies no later update)
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_mean((batch(s, q)[0] @ ref - batch(s, q)[1]) ** 2) for q in range(n) if s < 2 + q)
        ref.assign_sub(0.1 * tape.gradient(loss, ref) / n)
    if r == 0:
        time.sleep(0.5)  # rank 0 joins last this time (join returns the rank that joined last)
    graph_last = tf.function(tl.join)()  # in a graph (tunelab.tensorflow, the keras module above)
    return {"last": last, "graph_last": int(graph_last), "after": after,
            "diff": float(np.abs(w.numpy() - ref.numpy()).max())}


class _LrRecorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float] = []

    def on_train_batch_begin(self, batch: int, logs=None) -> None:
        self.seen.append(float(np.asarray(self.model.optimizer.learning_rate)))


def lr_callbacks(r: int, n: int) -> dict:
    x, y = _data(3, n)
    out = {}
    for kind in ("warmup", "schedule"):
        model = _model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), load_profile=False),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        cb = (hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2) if kind == "warmup" else
              hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=1))
        rec = _LrRecorder()
        hist = model.fit(_rank_rows(x, r, n, 1), _rank_rows(y, r, n, 1), batch_size=PER_RANK, epochs=3,
                         shuffle=False, verbose=0, callbacks=[cb, rec, hvd.callbacks.MetricAverageCallback()])
        out[kind] = rec.seen
        out[f"{kind}_logged"] = [float(v) for v in hist.history["lr"]]
    return out


class _RankCount(keras.callbacks.Callback):
    """Logs a numpy integer (this rank's number + 1) and a flag at every epoch's end."""

    def __init__(self, r: int) -> None:
        super().__init__()
        self.r = r

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        logs["rank_count"] = np.int64(self.r + 1)
        logs["flag"] = True


def lazily_built_broadcast(r: int, n: int) -> dict:
    """A model without an Input is built, with its optimizer, inside the first traced step: the
    broadcast callback must still leave every rank with root's weights and optimizer state."""
    import hashlib

    x, y = _data(2, n)
    keras.utils.set_random_seed(100 + r)  # each rank its own initial weights
    model = keras.Sequential([keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), load_profile=False),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    hist = model.fit(_rank_rows(x, r, n, 1), _rank_rows(y, r, n, 1), batch_size=PER_RANK, epochs=2, shuffle=False,
                     verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), _RankCount(r),
                                           hvd.callbacks.MetricAverageCallback()])
    h = hashlib.sha256()
    for v in [*model.weights, *model.optimizer.variables]:
        h.update(np.asarray(v).tobytes())
    return {"digest": h.hexdigest(), "count": [float(c) for c in hist.history["rank_count"]],
            "flag": [bool(f) for f in hist.history["flag"]], "variables": len(model.optimizer.variables)}


def mixed_precision(r: int, n: int) -> dict:
    """mixed_float16 with a loss scaler, and one rank whose batch overflows at first: its check must see
    the reduced gradients, so every rank skips the same steps (a plain optimizer, which Keras would wrap
    with a check of each rank's own gradients, is refused)."""
    import hashlib

    x, y = _data(3, n)
    x, y = _rank_rows(x, r, n, 1), _rank_rows(y, r, n, 1)
    if r == n - 1:
        x[:PER_RANK] *= 1e5  # this rank's first batch overflows in float16
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        try:
            hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), load_profile=False)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        model = _model()
        opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), load_profile=False)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.MetricAverageCallback()])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    h = hashlib.sha256()
    for v in model.weights:
        h.update(np.asarray(v).tobytes())
    return {"refused": refused, "digest": h.hexdigest(), "scale": float(np.asarray(model.optimizer.dynamic_scale)),
            "same_optimizer": model.optimizer is opt}


def resumed_on_root(comm, r: int, n: int) -> dict:
    """Horovod's resume: root alone loads a checkpoint with ``hvd.load_model`` (its optimizer distributed
    again, its momentum kept), the others build a fresh model; ``BroadcastGlobalVariablesCallback``
    leaves every rank on root's state, and training goes on as one process on the global batches."""
    import shutil
    import tempfile

    x, y = _data(2, n)
    folder = comm.bcast(tempfile.mkdtemp(prefix="tl-resume-") if r == 0 else None, root=0)
    path = f"{folder}/ck.keras"
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if r == 0:  # a checkpoint of a model trained one epoch on its own, with momentum in its state
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss, jit_compile=False)
        model.fit(x, y, batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0)
        model.save(path)
    comm.Barrier()
    if r == 0:
        model = hvd.load_model(path, load_profile=False)
        kind = [type(model.optimizer).__name__, bool(getattr(type(model.optimizer), "_tunelab_distributed", False)),
                int(model.optimizer.iterations.numpy())]
    else:
        keras.utils.set_random_seed(50 + r)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), load_profile=False),
                      loss=loss, jit_compile=False)
        kind = None
    model.fit(_rank_rows(x, r, n, 1), _rank_rows(y, r, n, 1), batch_size=PER_RANK, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    ref = keras.models.load_model(path)  # one process on the global batches
    ref.fit(x, y, batch_size=n * PER_RANK, epochs=1, shuffle=False, verbose=0)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(model.weights, ref.weights))
    slots = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(model.optimizer.variables, ref.optimizer.variables))
    comm.Barrier()
    if r == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return {"kind": kind, "diff": diff, "slots": slots, "iterations": int(model.optimizer.iterations.numpy())}


def horovod_order(r: int, n: int) -> dict:
    """Horovod's signatures: a tape with gradient_predivide_factor and num_groups (its average numpy's),
    the Keras optimizer's positional arguments in horovod.tensorflow.keras's order (the 7th is the
    predivide factor: read as backward_passes_per_step, it accumulated and left the variable alone),
    the Keras allreduce with its name second and its op sixth, reducescatter's second positional
    argument (device_dense, not the op), and Horovod's Adasum refused in one line."""
    xs = _arr(n, (5,), 7)
    mean = np.mean(xs, axis=0)
    out = {}
    v = tf.Variable(xs[r])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    (g,) = tl.DistributedGradientTape(tape, gradient_predivide_factor=4.0, num_groups=2,
                                      load_profile=False).gradient(loss, [v])
    out["predivide_tape"] = float(np.abs(g.numpy() - 2 * mean).max())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), None, "", "", hvd.Compression.none, False, 4.0,
                                   hvd.Average, load_profile=False)
    w = tf.Variable(np.zeros(5, dtype=np.float32))
    opt.apply_gradients([(tf.constant(xs[r]), w)])
    out["keras_order"] = float(np.abs(w.numpy() + mean).max())
    out["keras_allreduce"] = float(hvd.allreduce(float(r + 1), "k.sum", None, 1.0, 1.0, hvd.Sum))
    out["reducescatter"] = tl.reducescatter(tf.ones([n]), "", name="rs.order").numpy().tolist()
    out["reducescatter_scaled"] = tl.reducescatter(tf.ones([n]), op=tl.Sum, name="rs.scaled", prescale_factor=2.0,
                                                   postscale_factor=3.0).numpy().tolist()
    out["grouped_reducescatter"] = [t.numpy().tolist() for t in tl.grouped_reducescatter(
        [tf.ones([n])], "", tl.Compression.none, tl.Sum, name="grs.order")]
    out["adasum_tape"] = _err(lambda: tl.DistributedGradientTape(tf.GradientTape(), op=tl.Adasum))
    out["adasum_keras"] = _err(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum))
    # a worker-local variable (Horovod's local_variables) is left out of the broadcast: each rank keeps its own
    keras.utils.set_random_seed(300 + r)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0), load_profile=False), loss="mse",
                  jit_compile=False)
    local = model.layers[0].kernel
    model.fit(np.ones((PER_RANK, 6), np.float32), np.zeros((PER_RANK, 3), np.float32), batch_size=PER_RANK, epochs=1,
              verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local])])
    seen = hvd.allgather_object([float(np.asarray(local).sum()), float(np.asarray(model.layers[1].kernel).sum())])
    out["local_kept"] = len({a for a, _ in seen}) == n and len({b for _, b in seen}) == 1
    return out


def case_tf_parity(comm) -> dict:
    hvd.init(comm)
    r, n = hvd.rank(), hvd.size()
    out = {"errors": errors(r, n), "gradients": gradients(r, n), "int_avg": integer_average(r, n),
           "a2a_rs": alltoall_reducescatter(r, n),
           "syncbn": sync_batch_norm(comm, r, n), "join": join_uneven(r, n),
           "bcast_opt": broadcast_optimizer_variables(r, n),
           "sparse": embedding_training(r, n, False), "sparse_as_dense": embedding_training(r, n, True),
           "bpps_avg": fit_accumulated(r, n, True), "bpps_sum": fit_accumulated(r, n, False),
           "lr": lr_callbacks(r, n), "lazy": lazily_built_broadcast(r, n), "fp16": mixed_precision(r, n), "resume": resumed_on_root(comm, r, n), "built": [hvd.mpi_built(), hvd.gloo_built(), hvd.nccl_built()],
           "horovod_order": horovod_order(r, n)}
    hvd.shutdown()
    return out
