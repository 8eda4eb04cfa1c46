"""How tunelab.tensorflow hands tensors to the engine and results back, where GPUs are involved
(tunelab/tensorflow/ops.py), with stand-ins for TF tensors, the runtime and CuPy: no GPU needed."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tunelab.tensorflow import ops

GPU, CPU = "/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"


def test_an_int32_result_of_a_gpu_op_is_read_from_host_memory() -> None:
    """TF keeps int32 tensors in host memory even when the op ran on a GPU: its device says GPU, its
    backing device says CPU.  Such a tensor goes to the engine as a numpy array, not through DLPack
    as device memory (which CuPy refuses for a host capsule)."""
    t = SimpleNamespace(device=GPU, backing_device=CPU, dtype=tf.int32, numpy=lambda: np.arange(3, dtype=np.int32))
    got = ops._to_engine(t)
    assert isinstance(got, np.ndarray) and got.tolist() == [0, 1, 2]


def test_gpu_results_are_waited_for_before_tf_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's kernels for a call are queued on its own stream; TF's streams are not ordered after
    CuPy's, so the results are waited for (CuPy's current stream of the results' GPU, which waits on the
    call; not of this thread's current GPU) before they go back to TF.  Host results need no wait."""
    from fake_cuda_device import CurrentDevice

    waits: list[str] = []
    current = CurrentDevice(0)  # this thread's current GPU: 0, while the results are on GPU 1
    stream = SimpleNamespace(synchronize=lambda: waits.append("current stream" if current.index == 1 else "GPU 0's"))
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: stream,
                                                                                  Device=current.device)))

    class DeviceResult:  # what a CuPy array is to this code: not numpy, reshaped, on GPU 1
        device = SimpleNamespace(id=1)

        def reshape(self, shape):
            return self

    def runtime(result):
        handle = SimpleNamespace(wait=lambda: result)
        coordinator = SimpleNamespace(submit_group=lambda names, arrays, op, outs=None, group=None: [handle])
        return SimpleNamespace(coordinator=coordinator, topology=SimpleNamespace(size=2))

    monkeypatch.setattr(ops._rt, "current", lambda: runtime(np.ones(3, np.float32)))
    ops._reduce_numpy(["t"], [np.ones(3, np.float32)], "sum", None)
    assert waits == []
    monkeypatch.setattr(ops._rt, "current", lambda: runtime(DeviceResult()))
    ops._reduce_numpy(["t"], [SimpleNamespace(dtype=np.float32, shape=(3,), ndim=1)], "sum", None)
    assert waits == ["current stream"]
    # an integer average is a sum scaled afterwards, by kernels on CuPy's current stream: they are queued
    # before the wait, or TF would read the results while they still run
    waits.clear()
    monkeypatch.setattr(ops, "integer_average", lambda out, world: waits.append("integer average") or out)
    ops._reduce_numpy(["t"], [SimpleNamespace(dtype=np.int64, shape=(3,), ndim=1)], "average", None)
    assert waits == ["integer average", "current stream"]


@pytest.mark.parametrize("gpus", [[], ["GPU:0", "GPU:1"]])
def test_the_keras_workloads_keep_tensorflow_off_the_gpus(monkeypatch, gpus) -> None:
    """The Keras workloads (tune, bench train) train on the CPU: a TensorFlow that sees GPUs must be
    told to use none (else every rank's ops go to the first GPU, each rank reserving nearly all its
    memory), and one that sees none is left alone; thread counts as asked."""
    from tunelab.workloads.keras_models import configure_runtime

    calls = []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: list(gpus) if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "set_visible_devices", lambda devices, kind: calls.append(("visible", devices, kind)))
    monkeypatch.setattr(tf.config.threading, "set_intra_op_parallelism_threads", lambda n: calls.append(("intra", n)))
    monkeypatch.setattr(tf.config.threading, "set_inter_op_parallelism_threads", lambda n: calls.append(("inter", n)))
    configure_runtime(3)
    assert ("intra", 3) in calls and ("inter", 1) in calls
    assert [c for c in calls if c[0] == "visible"] == ([("visible", [], "GPU")] if gpus else [])


@pytest.mark.parametrize(("visible", "virtual", "where", "refused"), [
    ([0, 1], {}, "GPU:1", False),          # every GPU visible: logical GPU:1 is CUDA device 1
    ([1], {}, "GPU:0", True),              # Horovod's set_visible_devices(gpus[local_rank]) on rank 1
    ([0], {}, "GPU:0", False),             # ... on rank 0: the same numbering
    ([0], {0: 2}, "GPU:1", True),          # GPU 0 split in two logical devices: GPU:1 is on device 0
])
def test_a_gpu_tensor_is_refused_where_tensorflows_gpu_numbering_is_not_cudas(monkeypatch, request, visible,
                                                                             virtual, where, refused) -> None:
    """TF's DLPack names TF's logical GPU; CuPy reads it as a CUDA ordinal.  Where the two differ the
    hand-over is refused with what to do instead (CUDA_VISIBLE_DEVICES), not run on the wrong GPU."""
    from tunelab.errors import TunelabError

    devices = [SimpleNamespace(name=f"/physical_device:GPU:{i}") for i in visible]
    monkeypatch.setattr(ops.tf.config, "get_visible_devices", lambda kind="GPU": devices)
    monkeypatch.setattr(ops.tf.config, "get_logical_device_configuration",
                        lambda d: [None] * virtual[int(d.name[-1])] if int(d.name[-1]) in virtual else None)
    ops._physical_gpus.cache_clear()  # (read once per process: each case is another process's layout,
    request.addfinalizer(ops._physical_gpus.cache_clear)  # not to be left for the tests after it)
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(from_dlpack=lambda capsule: ("cupy", capsule)))
    monkeypatch.setattr(ops.tf.experimental.dlpack, "to_dlpack", lambda t: "capsule")
    t = SimpleNamespace(device=f"/job:localhost/replica:0/task:0/device:{where}", backing_device=None,
                        dtype=tf.float32)
    if refused:
        with pytest.raises(TunelabError, match="CUDA_VISIBLE_DEVICES"):
            ops._to_engine(t)
    else:
        assert ops._to_engine(t) == ("cupy", "capsule")
