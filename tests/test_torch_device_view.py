"""How tunelab.torch hands CUDA tensors to the engine: the buffer read from the tensor itself must say
what torch's own ``__cuda_array_interface__`` says (address, element count, type, shape)."""

import numpy as np
import pytest
from conftest import MORE_GPUS

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and a CUDA build of torch")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)])
def test_engine_view_says_what_the_interface_says(dtype, shape):
    _cuda()
    from tunelab.dtypes import bfloat16
    from tunelab.torch._convert import engine_view

    t = torch.zeros(shape, dtype=getattr(torch, dtype), device="cuda")
    # the interface cannot describe bfloat16: its int16 view has the same memory
    iface = (t.view(torch.int16) if dtype == "bfloat16" else t).__cuda_array_interface__
    buf = engine_view(t)
    assert buf.addr == iface["data"][0]
    assert buf.size == int(np.prod(iface["shape"], dtype=np.int64))
    assert buf.shape == tuple(iface["shape"])
    assert buf.dtype == (bfloat16() if dtype == "bfloat16" else np.dtype(iface["typestr"]))
    assert buf.owner is not None and buf.owner.data_ptr() == t.data_ptr()


def test_engine_view_refuses_a_uint16_tensor_rather_than_reading_it_as_bfloat16():
    """Its ``__cuda_array_interface__`` says "<u2", which the engine reads as bfloat16 (CuPy's way)."""
    _cuda()
    from tunelab.torch._convert import engine_view

    with pytest.raises(TypeError, match="cannot reduce dtype uint16"):
        engine_view(torch.zeros(4, dtype=torch.uint16, device="cuda"))


def test_engine_view_of_a_slice_points_at_the_slice_and_refuses_strided_views():
    _cuda()
    from tunelab.torch._convert import engine_view

    base = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
    row = base[2]
    assert engine_view(row).addr == base.data_ptr() + 2 * 6 * 4
    with pytest.raises(ValueError, match="C-contiguous"):
        engine_view(base[:, 1])


def test_producer_stream_handle_is_torchs_current_stream_in_every_thread():
    """The raw handle read for a gradient's producer is the stream torch would name: the default stream,
    a side stream entered with ``torch.cuda.stream``, and another thread's own current stream."""
    _cuda()
    import threading

    from tunelab.engine.device import producer_stream_handle

    t = torch.zeros(4, device="cuda")
    assert producer_stream_handle(t) == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert producer_stream_handle(t) == side.cuda_stream != 0
    assert producer_stream_handle(t) == torch.cuda.current_stream().cuda_stream
    seen = {}

    def other() -> None:
        mine = torch.cuda.Stream()
        with torch.cuda.stream(mine):
            seen["handle"], seen["want"] = producer_stream_handle(t), mine.cuda_stream

    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert seen["handle"] == seen["want"] != side.cuda_stream


def test_producer_stream_handle_follows_the_tensors_device_not_the_current_one():
    """A tensor on GPU 1 while GPU 0 is current: its producer stream is GPU 1's current stream (needs two
    GPUs)."""
    _cuda()
    if torch.cuda.device_count() < 2:
        pytest.skip(f"{MORE_GPUS} (two)")
    from tunelab.engine.device import producer_stream_handle

    t = torch.zeros(4, device="cuda:1")
    side = torch.cuda.Stream(device=1)
    with torch.cuda.stream(side), torch.cuda.device(0):  # (entering the stream makes GPU 1 current: undo)
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1).cuda_stream == side.cuda_stream
        assert producer_stream_handle(t) == side.cuda_stream != torch.cuda.current_stream(0).cuda_stream
