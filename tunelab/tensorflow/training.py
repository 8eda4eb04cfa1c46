"""``DistributedGradientTape`` and the Keras ``DistributedOptimizer`` of ``tunelab.tensorflow``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

if TYPE_CHECKING:
    from typing_extensions import Self  # (typing's from Python 3.11; tunelab runs on 3.10)

from .. import runtime as _rt
from ..reduce_ops import Average, check_process_set, predivide_factor, resolve_op
from .ops import Compression, py_function, reduce_gradients


def variables_signature(variables: Sequence[Any]) -> str:
    """Identity of a model for tuned profiles: the shapes and dtypes of its trainable variables, in order.
    Keras lays weights out differently from torch (NHWC kernels, conv biases), so the two frameworks'
    signatures of "the same" model differ on purpose: a profile is tuned for one framework's tensors."""
    import hashlib

    h = hashlib.sha256()
    for v in variables:
        shape = tuple(None if d is None else int(d) for d in v.shape)
        h.update(f"{shape}:{tf.as_dtype(v.dtype).name};".encode())
    return f"{len(variables)}v-{h.hexdigest()[:16]}"


def model_signature(model: Any) -> str:
    """The profile key of a Keras model: :func:`variables_signature` of its trainable variables."""
    return variables_signature(model.trainable_variables)


@tf.autograph.experimental.do_not_convert
def _load_profile(variables: Sequence[Any], model_name: str) -> None:
    """Apply the stored tuned knobs (collective).  Runs eagerly even while a ``tf.function`` is being
    traced, so the lookup happens once, now, instead of being baked into (or skipped by) the graph;
    AutoGraph is kept out of it because it would try to convert the profile store's code."""
    with tf.init_scope():
        _rt.current().load_profile(variables_signature(variables), "tensorflow", model_name)


def _report_step(grads: list[Any], signature: Callable[[], str]) -> list[Any]:
    """With the retune setting and a loaded profile, tell the runtime that a training step of the model
    ``signature()`` (called only then) had its gradients reduced (the watch of that model's profile times
    the steps between two calls, :mod:`tunelab.tuning.watch`): right away when eager, and inside a
    ``tf.function`` as an op that runs after the reduced gradients exist and that the returned gradients
    depend on, so it runs at every step of the graph, not once at tracing.  Without a watch nothing is
    added."""
    runtime = _rt.current()
    if not runtime.watching:
        return grads
    key = signature()
    if tf.executing_eagerly():
        runtime.step_done(key, "tensorflow")
        return grads

    def done() -> bool:
        _rt.current().step_done(key, "tensorflow")
        return True

    reduced = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    with tf.control_dependencies(reduced):
        reported = py_function(done, [], tf.bool, "the step's report to the retune watch")
    with tf.control_dependencies([reported]):
        return [None if g is None else tf.identity(g) if not isinstance(g, tf.IndexedSlices)
                else tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape) for g in grads]


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over all ranks.
    ``IndexedSlices`` gradients (embeddings) are reduced by allgather, as Horovod does, or densified and
    allreduced with ``sparse_as_dense=True``.

    With ``load_profile`` (collective: every rank must call ``gradient()``), the first ``gradient()``
    call applies the knobs ``tunelab tune`` stored for this hardware, model (the sources' shapes) and
    world size, logged in one line on rank 0; knobs set explicitly or through ``TUNELAB_*`` win.
    A model is looked up once per job: wrappers made anew every step (the usual Horovod pattern) or
    inside a ``tf.function`` trace reuse the first lookup."""

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: type = Compression.none, sparse_as_dense: bool = False, op: str = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: Any = None, scale_local_gradients: bool = True, *, load_profile: bool = True,
                 model_name: str = "") -> None:
        # Horovod's signature, in its order (a positional argument means what it means there); tunelab's
        # own settings after it, by keyword.  device_dense, device_sparse: accepted and unused (tunelab
        # reduces tensors where they live); num_groups, groups: checked, and the engine's fusion decides
        # how gradients travel together (their sums are the same); scale_local_gradients: Horovod's for
        # local variables, which a tape of tunelab's does not have; process_set: the global one only.
        _check_grouping(num_groups, groups)
        check_process_set(process_set)
        op = resolve_op(op)  # (here: Horovod's Adasum is refused when the tape is made, not at its first step)
        self._tape, self._compression, self._op = gradtape, compression, op
        self._sparse_as_dense = sparse_as_dense
        self._predivide = predivide_factor(gradient_predivide_factor, op)
        self._profile_pending, self._model_name = load_profile, model_name

    def __getattr__(self, item: str) -> Any:
        if item == "_tape":  # (not set yet: copy.copy, unpickling)
            raise AttributeError(item)
        return getattr(self._tape, item)

    def __enter__(self) -> Self:
        """``with hvd.DistributedGradientTape(tf.GradientTape()) as tape:`` records on the wrapped tape,
        and ``tape`` is this wrapper."""
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._tape.__exit__(*exc)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = None) -> Any:
        """The wrapped tape's gradients, averaged (``op``) over ranks.  ``unconnected_gradients``
        (``tf.UnconnectedGradients.ZERO``) as the tape takes it: zeros where a source does not reach
        ``target`` on some rank, which every rank then reduces alike."""
        if self._profile_pending:
            self._profile_pending = False
            _load_profile(tf.nest.flatten(sources), self._model_name)
        grads = self._tape.gradient(target, sources, output_gradients,
                                    unconnected_gradients=unconnected_gradients or tf.UnconnectedGradients.NONE)
        flat = reduce_gradients(tf.nest.flatten(grads, expand_composites=False), "tape.gradients", self._op,
                                self._compression, self._sparse_as_dense, self._predivide)
        return tf.nest.pack_sequence_as(grads, _report_step(flat, lambda: variables_signature(tf.nest.flatten(sources))))


def _check_grouping(num_groups: int, groups: Any) -> None:
    """Horovod's ``num_groups`` (a count >= 0) and ``groups`` (a count, or lists of variables), checked;
    both only say which gradients travel together, which the engine's fusion decides here."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an integer >= 0, got {num_groups!r}")
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups >= 0):
        return
    if isinstance(groups, (list, tuple)) and all(isinstance(g, (list, tuple)) for g in groups):
        return
    raise ValueError(f"groups must be a number of groups or lists of variables, got {groups!r}")


def _scaled(g: Any, scale: float) -> Any:
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g * tf.cast(scale, g.dtype)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression: type = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: str = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: Any = None, scale_local_gradients: bool = True, *, load_profile: bool = True,
                         model_name: str = "") -> Any:
    """``horovod.tensorflow``'s ``DistributedOptimizer``, in its order (``use_locking``: TF1's, unused):
    :func:`keras_distributed_optimizer`, which ``tunelab.tensorflow.keras`` gives in the order of
    ``horovod.tensorflow.keras``."""
    return keras_distributed_optimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor, op,
        backward_passes_per_step, average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients,
        load_profile=load_profile, model_name=model_name)


def keras_distributed_optimizer(optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
                                compression: type = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: str = Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                num_groups: int = 0, groups: Any = None, process_set: Any = None,
                                scale_local_gradients: bool = True, *, load_profile: bool = True,
                                model_name: str = "") -> Any:
    """A Keras 3 optimizer of the same class and config whose ``apply`` (and so ``apply_gradients``
    and ``model.fit``) first averages the gradients over all ranks.

    Horovod's signature, in ``horovod.tensorflow.keras``'s order (tunelab's ``load_profile`` and
    ``model_name`` after it, by keyword): ``device_dense``/``device_sparse`` are accepted and unused
    (tunelab reduces tensors where they live); ``num_groups``/``groups`` are checked, and the engine's
    fusion decides which gradients travel together; ``gradient_predivide_factor`` f divides gradients
    by f before the sum and the sum by ``size() / f`` after.  ``backward_passes_per_step`` k > 1 updates the variables every k-th step with the sum of the k
    rank-averaged gradients, divided by k when ``average_aggregated_gradients`` (Keras' own
    ``gradient_accumulation_steps`` does the accumulating; the allreduce still runs every step).

    With ``load_profile`` the tuned knobs are applied when the optimizer is built on the model's
    variables: ``model.fit`` builds it eagerly before tracing its train step, and a build that
    happens inside a trace still looks the profile up eagerly (see :class:`DistributedGradientTape`).

    Half precision: under the ``mixed_float16`` policy ``model.compile`` would wrap a plain optimizer in
    a ``LossScaleOptimizer`` whose overflow check reads each rank's own gradients before this one
    reduces them, so ranks would skip different steps and pair one step's gradients with another's.
    Pass ``keras.optimizers.LossScaleOptimizer(opt)``: the distributed optimizer is then that loss
    scaler, reducing before its check (every rank skips the same steps); a plain one is refused."""
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    op = resolve_op(op)
    predivide = predivide_factor(gradient_predivide_factor, op)
    _check_grouping(num_groups, groups)
    check_process_set(process_set)
    import keras

    if getattr(type(optimizer), "_tunelab_distributed", False):
        raise TypeError("this optimizer is a DistributedOptimizer already: wrap the plain optimizer, once")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        # (a tf_keras / Keras 2 optimizer never calls the ``apply`` this wraps: its gradients would go unreduced)
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    scaler = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if not scaler and keras.mixed_precision.dtype_policy().name == "mixed_float16":
        raise ValueError("under the mixed_float16 policy pass DistributedOptimizer(keras.optimizers."
                         "LossScaleOptimizer(optimizer)): Keras would wrap a plain one in a loss scaler whose "
                         "overflow check reads each rank's own gradients, and ranks would skip different steps")
    base = optimizer.__class__
    passes = backward_passes_per_step
    # Keras averages the k accumulated gradients; Horovod's default sums them (average_aggregated=False).
    scale = 1.0 if passes == 1 or average_aggregated_gradients else float(passes)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not self.built:  # built (and the profile loaded) before the step is reported, not after
                import keras

                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        if load_profile and not getattr(self, "_tunelab_profile_loaded", False):
            # built without the lookup (:func:`load_model` rebuilt it on one rank's load): look it up here,
            # where every rank comes (eagerly, even inside a trace: see _load_profile)
            self._tunelab_profile_loaded = True
            variables = trainable_variables if trainable_variables is not None else self._trainable_variables
            self._tunelab_signature = variables_signature(variables)
            _load_profile(variables, model_name)
        grads = _report_step(reduce_gradients(list(grads), "optimizer.gradients", op, compression, sparse_as_dense,
                                              predivide),
                             lambda: getattr(self, "_tunelab_signature", ""))
        if scale != 1.0:
            grads = [_scaled(g, scale) for g in grads]
        return base.apply(self, grads, trainable_variables)

    def build(self: Any, variables: Any) -> None:
        variables = list(variables)
        base.build(self, variables)
        self._tunelab_signature = variables_signature(variables)
        if load_profile and not getattr(self, "_tunelab_profile_loaded", False):
            self._tunelab_profile_loaded = True
            _load_profile(variables, model_name)

    # saved as the optimizer it wraps (Keras records a class by its module and name: this one's module,
    # tunelab's, has no such class, and a saved model could not be loaded); wrap it again after loading
    cls = type(base.__name__, (base,), {"apply": apply, "build": build, "_tunelab_distributed": True,
                                        "__module__": base.__module__, "__qualname__": base.__qualname__})
    config = optimizer.get_config()
    # A learning rate schedule of the user's own (its class not registered with Keras) or a callable one
    # cannot go through the config: the copy is made with a number, then given the same object.
    inner = optimizer.inner_optimizer if scaler else optimizer
    own_rate = getattr(inner, "_learning_rate", None)
    if isinstance(own_rate, keras.optimizers.schedules.LearningRateSchedule) or \
            (callable(own_rate) and not isinstance(own_rate, keras.Variable)):
        (config["inner_optimizer"]["config"] if scaler else config)["learning_rate"] = 0.0
    else:
        own_rate = None
    if passes > 1:
        # (a loss scaler's inner optimizer accumulates; its own config takes no such setting)
        accumulating = config["inner_optimizer"]["config"] if scaler else config
        if accumulating.get("gradient_accumulation_steps") not in (None, passes):  # (equal: a saved one's, resumed)
            raise ValueError("pass backward_passes_per_step or the optimizer's gradient_accumulation_steps, not both")
        accumulating["gradient_accumulation_steps"] = passes
    if name is not None:
        config["name"] = name
    wrapped = cls.from_config(config)
    if own_rate is not None:
        (wrapped.inner_optimizer if scaler else wrapped).learning_rate = own_rate
    if optimizer.built:  # it stepped already (resumed): the copy takes its state (iterations, slots)
        _take_state(wrapped, optimizer, list(optimizer._trainable_variables), "the optimizer")
    return wrapped


def _take_state(wrapped: Any, built: Any, variables: list, what: str) -> None:
    """Build ``wrapped`` (a DistributedOptimizer) on ``variables`` as ``built`` was, and give it
    ``built``'s state.  Its own build, not the wrapper's: the profile is looked up at the first step,
    where every rank comes.  ValueError when the states do not match."""
    import keras

    base = type(wrapped).__mro__[1]
    with keras.name_scope(wrapped.name, caller=wrapped):
        base.build(wrapped, variables)
    wrapped.built = True
    # by path: the copy may hold more (backward_passes_per_step's accumulators, which start at zero)
    mine = {v.path: v for v in wrapped.variables}
    for old in built.variables:
        new = mine.get(old.path)
        if new is None or tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"{what}'s state does not fit its distributed copy ({old.path} "
                             f"{list(old.shape)} has no counterpart)")
        new.assign(old)


def load_model(filepath: Any, custom_optimizers: Sequence[type] | None = None, custom_objects: dict | None = None,
               compression: type = Compression.none, **distributed: Any) -> Any:
    """Horovod's ``hvd.load_model``: a model saved by Keras, compiled, whose optimizer is a
    :func:`DistributedOptimizer` again, with the state it was saved with (its iteration count and
    slots, such as momentum).  ``custom_optimizers``: optimizer classes of your own that the file
    names (as ``custom_objects``); ``distributed``: the other arguments of :func:`DistributedOptimizer`.

    A model whose optimizer accumulates passes (``backward_passes_per_step`` k, which Keras saves as its
    ``gradient_accumulation_steps``) is refused unless ``backward_passes_per_step=k`` is passed again (with
    ``average_aggregated_gradients`` as it was trained): the file does not say whether they were summed.

    Nothing here is collective, so one rank may load (Horovod's examples resume on rank 0 and
    broadcast with ``BroadcastGlobalVariablesCallback``): the tuned profile is looked up at the first
    step, where every rank comes."""
    import keras

    objects = {c.__name__: c for c in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    loaded = getattr(model, "optimizer", None)
    if loaded is None or getattr(type(loaded), "_tunelab_distributed", False):
        return model
    config = loaded.get_config()
    saved = (config["inner_optimizer"]["config"] if isinstance(loaded, keras.optimizers.LossScaleOptimizer)
             else config).get("gradient_accumulation_steps") or 1
    if saved > 1 and "backward_passes_per_step" not in distributed:
        # saved by a DistributedOptimizer of k passes (summed, unless average_aggregated_gradients) or by
        # Keras' own accumulation (averaged): the file does not say which, and a guess changes every update k-fold
        raise ValueError(f"{filepath}: the saved optimizer accumulates {saved} passes (gradient_accumulation_steps"
                         f"={saved}): pass backward_passes_per_step={saved} to train on as it was (and "
                         "average_aggregated_gradients=True if it averaged them)")
    if distributed.get("backward_passes_per_step", saved) != saved:
        raise ValueError(f"{filepath}: the saved optimizer accumulates {saved} passes, not "
                         f"backward_passes_per_step={distributed['backward_passes_per_step']}")
    wrapped = keras_distributed_optimizer(loaded, compression=compression, **distributed)  # (its state taken)
    model.optimizer = wrapped
    return model
