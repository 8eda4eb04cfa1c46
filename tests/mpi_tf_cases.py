"""TensorFlow / Keras training cases for mpi_cases.py, against single-process references."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras

import tunelab.tensorflow as tl

PER_RANK = 4


def tiny_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(5)])


def data(step: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return (rng.standard_normal((world * PER_RANK, 10)).astype(np.float32),
            rng.integers(0, 5, world * PER_RANK).astype(np.int32))


def loss_fn(model: keras.Model, x: np.ndarray, y: np.ndarray) -> tf.Tensor:
    logits = model(x, training=True)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def reference(steps: int, world: int) -> list[np.ndarray]:
    model = tiny_model(1)  # rank 0's init, which the distributed runs broadcast
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    for step in range(steps):
        x, y = data(step, world)
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return [w.numpy() for w in model.weights]


def custom_loop(steps: int, use_function: bool, compression: type) -> list[np.ndarray]:
    model = tiny_model(seed=1 + tl.rank())  # different init per rank: the broadcast must fix it
    tl.broadcast_variables(model.weights, root_rank=0)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)

    def train_step(x: tf.Tensor, y: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        tape = tl.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    step_fn = tf.function(train_step) if use_function else train_step
    r = tl.rank()
    for step in range(steps):
        x, y = data(step, tl.size())
        step_fn(x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])
    return [w.numpy() for w in model.weights]


def fit_run(epochs: int, batches: int) -> tuple[list[np.ndarray], list[float]]:
    model = tiny_model(seed=1 + tl.rank())
    model.compile(optimizer=tl.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    r, n = tl.rank(), tl.size()
    xs, ys = zip(*(data(b, n) for b in range(batches)))
    x = np.concatenate([bx[r * PER_RANK:(r + 1) * PER_RANK] for bx in xs])
    y = np.concatenate([by[r * PER_RANK:(r + 1) * PER_RANK] for by in ys])
    hist = model.fit(x, y, batch_size=PER_RANK, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[tl.BroadcastGlobalVariablesCallback(0), tl.MetricAverageCallback()])
    return [w.numpy() for w in model.weights], [float(v) for v in hist.history["loss"]]


def fit_reference(epochs: int, batches: int, world: int) -> list[np.ndarray]:
    model = tiny_model(seed=1)  # rank 0's init, which the callback broadcasts
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    xs, ys = zip(*(data(b, world) for b in range(batches)))
    model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=world * PER_RANK, epochs=epochs,
              shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def case_tf_training(comm, steps: int = 5) -> dict:
    tl.init(comm)
    n = tl.size()
    ref = reference(steps, n)
    out = {}
    coordinator = tl._rt.current().coordinator
    enqueue, gradients = coordinator._enqueue, []  # count the gradients handed to the coordinator

    def counting(reqs):
        gradients.extend(r.name for r in reqs if "gradients" in r.name)
        return enqueue(reqs)

    coordinator._enqueue = counting
    for label, use_fn, comp in (("function", True, tl.Compression.none), ("eager", False, tl.Compression.none),
                                ("fp16", True, tl.Compression.fp16)):
        gradients.clear()
        mine = custom_loop(steps, use_fn, comp)
        out[label] = {"max_abs_diff": _max_diff(mine, ref), "digest": float(sum(float(w.sum()) for w in mine)),
                      "gradients_submitted": len(gradients)}
    gradients.clear()
    weights, losses = fit_run(epochs=2, batches=3)
    out["fit"] = {"max_abs_diff": _max_diff(weights, fit_reference(2, 3, n)), "losses": losses,
                  "gradients_submitted": len(gradients)}
    coordinator._enqueue = enqueue
    x = tf.constant(np.arange(6, dtype=np.float32) + tl.rank())
    out["allreduce_sum"] = tl.allreduce(x, op=tl.Sum).numpy().tolist()
    out["allgather"] = tl.allgather(tf.fill([tl.rank() + 1], float(tl.rank()))).numpy().tolist()
    out["broadcast"] = tl.broadcast(tf.constant([float(tl.rank())] * 3), root_rank=n - 1).numpy().tolist()
    tl.shutdown()
    return out


def _captured(fn) -> str:
    """What ``fn()`` printed (the profile log line goes to stdout on rank 0)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn()
    return buf.getvalue().strip()


def _tiny_job(comm, **settings):
    """A job's start: init with ``settings``, the tiny model and its optimizer, this rank's data."""
    tl.init(comm, **settings)
    r = tl.rank()
    x, y = data(0, tl.size())
    return (tl._rt.current(), tiny_model(seed=1), keras.optimizers.SGD(0.1),
            x[r * PER_RANK:(r + 1) * PER_RANK], y[r * PER_RANK:(r + 1) * PER_RANK])


def _tape_step(model, opt, x, y):
    """A tf.function train step through a DistributedGradientTape made inside it (the profile lookup
    happens while it is traced)."""
    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        tape = tl.DistributedGradientTape(tape, model_name="tiny")
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    return step


def case_tf_autoload(comm, env_home: str) -> dict:
    """Without a profile a tape logs the defaults; after one is stored, a new tape (made inside a
    tf.function) loads it once, on every rank, and a Keras DistributedOptimizer loads it in model.fit.
    A knob pinned in init() keeps its value."""
    import os

    os.environ["TUNELAB_HOME"] = env_home
    logs = []
    for attempt in range(2):  # two jobs: the second starts after a profile was stored
        rt, model, opt, x, y = _tiny_job(comm, cycle_time_ms=7.0)
        r = tl.rank()
        if attempt == 1 and r == 0:
            from tunelab.profiles import ProfileStore

            store = ProfileStore()
            pid = store.upsert_profile(rt.profile_key(tl.model_signature(model), "tensorflow"), "test hardware",
                                       {}, "tiny")
            store.set_best(pid, {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0,
                                 "segment_bytes": 1 << 16}, 125.0, 100.0, 0.01, "test")
        comm.Barrier()
        step = _tape_step(model, opt, x, y)
        logs.append(_captured(lambda step=step: [step() for _ in range(3)]))  # one trace: one lookup
        knobs = rt.engine.knobs.as_dict()
        tl.shutdown()
    tl.init(comm, cycle_time_ms=7.0)  # a third job trains with model.fit
    fitted = tiny_model(seed=1)
    fitted.compile(optimizer=tl.DistributedOptimizer(keras.optimizers.SGD(0.1), model_name="fitted"),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    fit_log = _captured(lambda: fitted.fit(x, y, batch_size=PER_RANK, epochs=2, verbose=0))
    tl.shutdown()
    return {"first": logs[0], "second": logs[1], "fit": fit_log, "knobs": knobs}


def case_tf_retune(comm, env_home: str) -> dict:
    """A TensorFlow job (a tf.function train step) that loads its profile with the retune setting:
    its steps are reported from inside the graph, so when the loaded knobs turn slow the watch re-opens
    the search, locks again and saves the lock to the store."""
    import os
    import time

    os.environ["TUNELAB_HOME"] = env_home
    loaded = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    import dataclasses

    from tunelab.tuning import watch
    # this job's steps take milliseconds: watched blocks of a second would outlast the test, so it
    # keeps the plan's 3-step blocks
    watch.WATCH_PLAN = dataclasses.replace(watch.WATCH_PLAN, block_seconds=None)
    rt, model, opt, x, y = _tiny_job(comm, retune=True)
    r = tl.rank()
    if r == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        pid = store.upsert_profile(rt.profile_key(tl.model_signature(model), "tensorflow"), "test hardware", {}, "tiny")
        store.set_best(pid, loaded, 125.0, 100.0, 0.01, "tune-run", gain_interval=(1.25, 1.1, 1.4))
    comm.Barrier()
    step = _tape_step(model, opt, x, y)

    def run() -> int:
        for i in range(400):
            slow = i >= 30 and all(getattr(rt.engine.knobs, k) == v for k, v in loaded.items())
            time.sleep(0.03 if slow else 0.005)  # the loaded configuration has become slow
            step()
            watch = rt._watch  # rank 0's: every rank stops at the same step
            if comm.bcast(watch is not None and len(watch.driver.decisions) >= 2, root=0):
                return i + 1
        return 400

    steps = []
    log = _captured(lambda: steps.append(run()))
    result = {"log": log, "steps": steps[0]}
    if r == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        best = store.best(rt.profile_key(tl.model_signature(model), "tensorflow"))
        result.update(best=best.knobs, outcome=best.outcome, decisions=len(rt._watch.driver.decisions))
    tl.shutdown()
    return result


def case_tf_keras_watch(comm, env_home: str) -> dict:
    """The Keras DistributedOptimizer in a custom tf.function loop, not built before its first step (it
    is built, and its profile loaded, inside that step's trace): the retune watch sees every step."""
    import os

    os.environ["TUNELAB_HOME"] = env_home
    rt, model, _, x, y = _tiny_job(comm, retune=True)
    if tl.rank() == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        pid = store.upsert_profile(rt.profile_key(tl.model_signature(model), "tensorflow"), "test hardware", {}, "tiny")
        store.set_best(pid, {"cycle_time_ms": 3.0}, 125.0, 100.0, 0.01, "tune-run", gain_interval=(1.25, 1.1, 1.4))
    comm.Barrier()
    opt = tl.DistributedOptimizer(keras.optimizers.SGD(0.1), model_name="tiny")

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    log = _captured(lambda: [step() for _ in range(12)])
    result = {"log": log, "steps": rt._watch.steps if rt._watch is not None else None}
    tl.shutdown()
    return result


def case_tf_api_edges(comm) -> dict:
    """An integer average with a postscale (one factor, one truncation, as Horovod), and a group of a
    floating and an integer tensor whose floating one still has its gradient."""
    tl.init(comm)
    r = tl.rank()
    x = tf.constant([7, -7], tf.int64) if r == 0 else tf.zeros(2, tf.int64)
    avg = tl.allreduce(x, op=tl.Average, postscale_factor=2.0).numpy().tolist()
    v, i = tf.Variable([1.0, 2.0]), tf.constant([3, 4], tf.int32)
    with tf.GradientTape() as tape:
        f, k = tl.grouped_allreduce([v * (r + 1), i], op=tl.Sum)
        loss = tf.reduce_sum(f)
    g = tape.gradient(loss, v)
    out = {"int_avg_post": avg, "ints": k.numpy().tolist(), "grad": None if g is None else g.numpy().tolist()}
    # a 0-d integer average (it raised "No module named 'cupy'": the truncation gave a numpy scalar)
    three = tf.constant(3 + r)  # 3 and 4: trunc(3.5) = 3
    out["int_scalar"] = [int(tl.allreduce(three)), int(tf.function(lambda t: tl.allreduce(t))(three)),
                         [x.numpy().tolist() for x in tl.grouped_allreduce([three, tf.constant([1, 2])])]]
    # IndexedSlices through allreduce stay IndexedSlices of every rank's rows (they were made dense)
    rows = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), dense_shape=tf.constant([3, 2]))
    avg_rows, sum_rows = tl.allreduce(rows), tl.allreduce(rows, op=tl.Sum, postscale_factor=2.0)
    out["slices"] = [type(avg_rows).__name__, avg_rows.values.numpy().tolist(), avg_rows.indices.numpy().tolist(),
                     sum_rows.values.numpy().tolist()]
    # a step whose last batch is smaller on one rank only: that rank traces the step again, and its
    # unnamed collectives must keep the names the other rank's first trace runs with (they stalled)
    w = tf.Variable(tf.ones([3, 2]))

    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w))
        (g,) = tl.DistributedGradientTape(tape).gradient(loss, [w])
        w.assign_sub(0.1 * g)
        return tl.allreduce(loss)

    out["retraced"] = [round(float(step(tf.ones([b, 3]))), 4) for b in ([4, 4, 4] if r == 0 else [4, 4, 3])]
    # XLA cannot compile a Python op: a model compiled with jit_compile=True (what "auto" gives on a host
    # with a GPU) and a jit-compiled tf.function are refused with one line where they are traced (they
    # failed at the first step with a page about EagerPyFunc); the next collective still sums
    import tunelab.tensorflow.keras as hvd

    xla = []
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse", jit_compile=True)
    for run in (lambda: model.fit(np.ones((8, 4), np.float32), np.ones((8, 2), np.float32), epochs=1, verbose=0),
                lambda: tf.function(lambda t: tl.allreduce(t), jit_compile=True)(tf.ones(2))):
        try:
            run()
            xla.append("no error")
        except Exception as exc:  # noqa: BLE001 (the type and text are the finding)
            last = str(exc).strip().splitlines()[-1].strip()  # (autograph puts the traced function's
            kind = f"{type(exc).__name__}: "  # lines, and the type again, before a tf.function's error)
            xla.append(kind + last.removeprefix(kind))
    out["xla"] = xla
    out["after_xla"] = tl.allreduce(tf.constant([float(r + 1)]), op=tl.Sum).numpy().tolist()
    tl.shutdown()
    return out


def case_tf_gradient_gaps(comm) -> dict:
    """Gradients None on one rank only (a branch one rank takes): each gradient keeps its own name, so
    the others still meet their peers' (rank 0's c met rank 1's b, and took their average, silently),
    and the one missing on a rank is named in a stall on every rank."""
    tl.init(comm, timeout_s=3.0)
    r = tl.rank()
    a, b, c = tf.Variable([1.0, 1.0]), tf.Variable([1.0, 1.0]), tf.Variable([1.0, 1.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a) + (2.0 * tf.reduce_sum(b) if r == 1 else 0.0) + 3.0 * tf.reduce_sum(c)
    out: dict = {}
    # the tape's unconnected_gradients=ZERO, through the wrapper used as a context manager: zeros where
    # a branch is not taken, so every rank reduces every gradient (the wrapper took neither)
    try:
        with tl.DistributedGradientTape(tf.GradientTape()) as zero_tape:
            zero_loss = tf.reduce_sum(a) + (2.0 * tf.reduce_sum(b) if r == 1 else 0.0) + 3.0 * tf.reduce_sum(c)
        zero = zero_tape.gradient(zero_loss, [a, b, c], unconnected_gradients=tf.UnconnectedGradients.ZERO)
        out["zero_grads"] = [g.numpy().tolist() for g in zero]
    except Exception as exc:  # noqa: BLE001 (the error is the finding)
        out["zero_grads"] = f"{type(exc).__name__}: {exc}"
    try:
        grads = tl.DistributedGradientTape(tape).gradient(loss, [a, b, c])
        out["grads"] = [None if g is None else g.numpy().tolist() for g in grads]
    except Exception as exc:  # noqa: BLE001 (the error is the finding)
        out["error"] = f"{type(exc).__name__}: {exc}"
    try:
        tl.shutdown()
    except Exception:  # noqa: BLE001, S110 (the stall has ended the coordinator: shutdown may say so again)
        pass
    return out


from mpi_tf_parity_cases import case_tf_parity  # noqa: F401  (dispatched by mpi_cases.py)


def case_tf_inputs_kept(comm) -> dict:
    """Host tensors reach the engine as read-only views of TensorFlow's own buffers (DLPack, no copy):
    every engine path must leave them as they were.  On one node (the one-shot up to
    ``oneshot_max_bytes``, the two-shot above) and on emulated nodes of one rank (recursive doubling
    up to ``doubling_max_bytes``, the flat ring above), eagerly and in a graph; the sums are checked too."""
    out = {}
    for layout, settings in (("one node", {}), ("nodes of one rank", {"ranks_per_node": 1})):
        tl.init(comm, **settings)
        n, r = tl.size(), tl.rank()
        for count in (6, 3000, 600_000):  # 24 B, 12 KiB, 2.3 MiB of float32
            base = np.arange(count, dtype=np.float32) % 97 + r
            x = tf.constant(base)
            eager = tl.allreduce(x, op=tl.Sum)
            graph = tf.function(lambda t: tl.allreduce(t, op=tl.Sum))(x)
            want = (np.arange(count, dtype=np.float32) % 97) * n + n * (n - 1) / 2
            out[f"{layout} {count}"] = {"kept": bool(np.array_equal(x.numpy(), base)),
                                        "eager": bool(np.array_equal(eager.numpy(), want)),
                                        "graph": bool(np.array_equal(graph.numpy(), want))}
        tl.shutdown()
    return out
