"""Gradient replay: 2 ranks through the coordinator (exact averages, step timing), and its pieces in one process."""

import statistics

import numpy as np
import pytest
from mpi_harness import run_ok

from tunelab.workloads.replay import GradientReplay, gradient_names, make_gradients
from tunelab.workloads.shapes import gradient_shapes


@pytest.mark.mpi
def test_replayed_resnet50_steps_average_exactly_and_take_about_the_requested_time():
    forward_ms, backward_ms = 100.0, 250.0
    results = run_ok("replay_steps", 2, limit_s=150, model="resnet50",
                     forward_ms=forward_ms, backward_ms=backward_ms, steps=4)
    requested = forward_ms + backward_ms
    for rank, res in enumerate(results):
        assert res["tensors"] == 161 and res["nbytes"] == 25_557_032 * 4
        assert res["wrong"] == [] and res["profiled_wrong"] == [], (rank, res)
        steady = statistics.median(res["step_ms"][1:])  # the first step also negotiates the names
        assert 0.5 * requested <= steady <= 3 * requested, (rank, res["step_ms"])
        assert 0.5 * requested <= res["profiled_ms"][0] <= 3 * requested, (rank, res["profiled_ms"])
    assert results[0]["profiled_first"] == results[1]["profiled_first"]
    assert results[0]["profiled_first"] != "grad.fc.bias"  # the profile, not backward order, decides


# ---- single process (no launch) ------------------------------------------------------------------
def test_gradients_match_the_model_shapes_in_backward_order():
    grads = make_gradients("resnet50", seed=3)
    assert [g.shape for g in grads] == gradient_shapes("resnet50")
    assert gradient_names("resnet50")[:2] == ["grad.fc.bias", "grad.fc.weight"]
    assert all(g.dtype == np.float32 and np.abs(g).max() <= 8 and np.all(g == np.round(g)) for g in grads)
    assert not np.array_equal(grads[1], make_gradients("resnet50", seed=4)[1])


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown model"):
        gradient_names("alexnet")
    with pytest.raises(ValueError, match="dtype must be one of"):
        make_gradients("resnet50", dtype="int32")
    with pytest.raises(ValueError, match="backward_ms"):
        GradientReplay("resnet50", 10, -1)
    with pytest.raises(ValueError, match="161 finite non-negative"):
        GradientReplay("resnet50", 10, 10, ready_offsets_ms=[1.0, 2.0])


class _CopyCoordinator:
    """Stands in for the coordinator in one process: records the submission order, 'reduces' by copying."""

    class _Done:
        def wait(self) -> None:
            pass

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, name, array, op, out=None):
        assert op == "average"
        out[...] = array
        self.submitted.append(name)
        return self._Done()


def test_a_recorded_torch_profile_drives_the_replay_order():
    torch_models = pytest.importorskip("tunelab.workloads.torch_models")
    pytest.importorskip("torch")
    from tunelab.workloads.replay import record_backward_profile

    model = torch_models.build("resnet50")
    inputs, targets = torch_models.synthetic_batch("resnet50", 2, image_size=32)
    offsets = record_backward_profile(model, inputs, targets)
    assert len(offsets) == 161 and all(0 <= t < 60_000 for t in offsets)
    assert offsets[0] <= offsets[-1]  # the classifier's gradient is ready long before conv1's
    replay = GradientReplay("resnet50", 0, 20, ready_offsets_ms=offsets)
    coordinator = _CopyCoordinator()
    replay.step(coordinator)
    ranked = sorted(range(161), key=lambda i: offsets[i])
    assert coordinator.submitted == [replay.names[i] for i in ranked]
    assert all(np.array_equal(o, g) for o, g in zip(replay.outputs, replay.gradients))


@pytest.mark.gpu
def test_a_cuda_profile_times_the_device_not_the_queueing():
    """On a GPU, the hooks fire when the backward's kernels are queued, long before they run: the
    profile must follow the device.  A backward of a few large matmuls takes milliseconds on the device
    and microseconds to queue; the last gradient's offset must be a good part of the device time that
    CUDA events around the whole backward measure."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")
    from tunelab.workloads.replay import record_backward_profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)]).cuda()
    inputs = torch.randn(8192, 4096, device="cuda")
    targets = torch.randint(0, 4096, (8192,), device="cuda")
    offsets = record_backward_profile(model, inputs, targets)
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    loss.backward()
    end.record()
    torch.cuda.synchronize()
    device_ms = begin.elapsed_time(end)
    assert len(offsets) == 12 and all(t >= 0 for t in offsets)
    assert offsets[-1] >= 0.5 * device_ms, (offsets, device_ms)
