"""The adapters' signatures against Horovod's own (its source, v0.28.1, written out here): a script
ported by its import line binds positional arguments as Horovod does, and what tunelab does not do
(Adasum, Product, process sets other than the global one) is refused in one line."""

import inspect

import pytest

from tunelab.reduce_ops import (
    Adasum,
    Average,
    ProcessSet,
    Product,
    Sum,
    check_op,
    global_process_set,
    resolve_op,
)

HOROVOD = {  # name -> Horovod's parameters, in order
    "torch.DistributedOptimizer": ["optimizer", "named_parameters", "compression", "backward_passes_per_step", "op",
                                   "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense",
                                   "process_set"],
    "torch.broadcast_optimizer_state": ["optimizer", "root_rank", "model"],
    "tf.DistributedGradientTape": ["gradtape", "device_dense", "device_sparse", "compression", "sparse_as_dense", "op",
                                   "gradient_predivide_factor", "num_groups", "groups", "process_set",
                                   "scale_local_gradients"],
    "tf.DistributedOptimizer": ["optimizer", "name", "use_locking", "device_dense", "device_sparse", "compression",
                                "sparse_as_dense", "backward_passes_per_step", "op", "gradient_predivide_factor",
                                "average_aggregated_gradients", "num_groups", "groups", "process_set",
                                "scale_local_gradients"],
    "keras.DistributedOptimizer": ["optimizer", "name", "device_dense", "device_sparse", "compression",
                                   "sparse_as_dense", "gradient_predivide_factor", "op", "backward_passes_per_step",
                                   "average_aggregated_gradients", "num_groups", "groups", "process_set",
                                   "scale_local_gradients"],
    "tf.reducescatter": ["tensor", "device_dense", "compression", "op", "name", "process_set", "ignore_name_scope",
                         "prescale_factor", "postscale_factor"],
    "tf.grouped_reducescatter": ["tensors", "device_dense", "compression", "op", "process_set", "prescale_factor",
                                 "postscale_factor"],
    "keras.allreduce": ["value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression"],
    "keras.reducescatter": ["value", "name", "op"],
    "tf.BroadcastGlobalVariablesCallback": ["root_rank", "device", "local_variables"],
}


def _positional(fn) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


def _adapters() -> dict:
    torch_hvd = pytest.importorskip("tunelab.torch")
    tf_hvd = pytest.importorskip("tunelab.tensorflow")
    import tunelab.tensorflow.keras as keras_hvd

    return {"torch": torch_hvd, "tf": tf_hvd, "keras": keras_hvd}


@pytest.mark.parametrize("name", sorted(HOROVOD))
def test_positional_arguments_bind_as_in_horovod(name):
    module, attr = name.split(".")
    fn = getattr(_adapters()[module], attr)
    fn = fn.__init__ if inspect.isclass(fn) else fn
    ours = _positional(fn)
    assert ours == HOROVOD[name], ours  # (tunelab's own settings, load_profile and model_name, by keyword only)


def test_horovods_other_reductions_are_named_and_refused_in_one_line():
    assert check_op(Average) == Average and resolve_op(Sum) == Sum
    for op, text in ((Adasum, "op=Adasum (adaptive summation)"), (Product, "op=Product")):
        with pytest.raises(ValueError) as caught:
            resolve_op(op)
        assert str(caught.value).startswith(f"{text} is not supported by tunelab: use Average"), caught.value
    adapters = _adapters()
    for module in adapters.values():
        assert (module.Adasum, module.Product, module.Average) == (Adasum, Product, Average)
    import keras
    import tensorflow as tf

    with pytest.raises(ValueError, match="Adasum"):
        adapters["tf"].DistributedGradientTape(tf.GradientTape(), op=Adasum)
    with pytest.raises(ValueError, match="Adasum"):
        adapters["keras"].DistributedOptimizer(keras.optimizers.SGD(0.1), op=Adasum)


def test_only_the_global_process_set_is_taken():
    adapters = _adapters()
    assert adapters["torch"].global_process_set is adapters["tf"].global_process_set is global_process_set
    import keras
    import tensorflow as tf

    other = ProcessSet([0])
    with pytest.raises(ValueError, match=r"process_set=ProcessSet\(\[0\]\): tunelab runs every collective on all ranks"):
        adapters["tf"].DistributedGradientTape(tf.GradientTape(), process_set=other)
    with pytest.raises(ValueError, match="only global_process_set"):
        adapters["keras"].DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=other)
    tape = adapters["tf"].DistributedGradientTape(tf.GradientTape(), process_set=global_process_set)
    assert tape._op == Average


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor must be a number > 0"),
    ({"gradient_predivide_factor": 2.0, "op": Sum}, "gradient_predivide_factor needs op=Average"),
    ({"num_groups": -1}, "num_groups must be an integer >= 0"),
    ({"groups": "two"}, "groups must be a number of groups or lists of variables"),
])
def test_the_tapes_horovod_options_are_checked(kwargs, message):
    import tensorflow as tf

    with pytest.raises(ValueError, match=message):
        _adapters()["tf"].DistributedGradientTape(tf.GradientTape(), **kwargs)
