"""The device data path: CUDA tensors enter zero-copy, ranks of a node share device staging
segments (CUDA IPC on a GPU), shards cross nodes through pinned host memory or, with a CUDA-aware
MPI, straight from device memory.

Without a GPU the whole path runs under Numba's CUDA simulator, where device memory is host
memory: layouts, fusion, pipelining, staging and the coordinator are checked bit for bit against
numpy.  What the simulator cannot show (real IPC mappings, stream ordering, speed) is in the
``gpu`` tests, which run the same case with CuPy on one GPU shared by 2 and 4 processes.
"""

import numpy as np
import pytest
from mpi_harness import run_case, run_ok

from tunelab.engine.device import cuda_aware_mpi, device_buffer


class FakeCudaArray:
    def __init__(self, shape, typestr, addr=0x7F0000001000, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (addr, False),
                                         "strides": strides, "version": 3}


def test_cuda_array_interface_is_taken_without_copying():
    buf = device_buffer(FakeCudaArray((3, 4), "<f4"))
    assert (buf.addr, buf.size, buf.dtype, buf.shape, buf.nbytes) == (0x7F0000001000, 12, np.float32, (3, 4), 48)
    assert device_buffer(FakeCudaArray((5,), "<u2")).dtype.name == "bfloat16"  # CuPy has no bfloat16
    with pytest.raises(ValueError, match="C-contiguous"):
        device_buffer(FakeCudaArray((3, 4), "<f4", strides=(4, 12)))
    # explicit C strides (CuPy gives them), a dimension of one included, are contiguous
    assert device_buffer(FakeCudaArray((2, 1, 3), "<f8", strides=(24, 24, 8))).shape == (2, 1, 3)
    with pytest.raises(ValueError, match="C-contiguous"):
        device_buffer(FakeCudaArray((2, 3), "<f8", strides=(32, 8)))  # a row of a wider array


def test_host_staging_is_page_locked_by_numba_where_cupy_is_not_installed(monkeypatch):
    """The numba-cuda back end alone (no CuPy): staging for a non-CUDA-aware MPI imported cupy in the
    middle of a collective.  With stand-ins for a device (not the simulator) and numba's pinned array."""
    import sys

    from numba import cuda

    from tunelab.engine import device_ipc

    asked = []

    def pinned_array(shape, dtype):
        asked.append((shape, np.dtype(dtype)))
        return np.zeros(shape, dtype)

    monkeypatch.setattr(device_ipc, "simulated", lambda: False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    monkeypatch.setattr(cuda, "pinned_array", pinned_array, raising=False)
    staging = device_ipc.PinnedStaging()
    view = staging.view(64, np.dtype(np.float32))
    assert view.dtype == np.float32 and view.size == 16 and asked == [(64, np.dtype(np.uint8))]
    assert staging.view(32, np.dtype(np.float32)).size == 8 and len(asked) == 1  # big enough: kept
    staging.free()


def test_host_memory_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="expected a CUDA tensor .* got ndarray"):
        device_buffer(np.zeros(3, np.float32))  # numpy's DLPack device is the CPU


def test_the_kernel_backend_setting_is_checked():
    from tunelab.config import load_engine_config

    assert load_engine_config({}).backend == "auto"
    assert load_engine_config({"TUNELAB_KERNEL_BACKEND": "cupy"}).backend == "cupy"
    with pytest.raises(ValueError, match="backend must be one of auto, cupy, numba-cuda, cpu, got 'cuda'"):
        load_engine_config({"TUNELAB_KERNEL_BACKEND": "cuda"})


def test_cuda_aware_mpi_can_be_forced_either_way():
    assert cuda_aware_mpi({"TUNELAB_CUDA_AWARE_MPI": "1"}) is True
    assert cuda_aware_mpi({"TUNELAB_CUDA_AWARE_MPI": "off"}) is False
    assert isinstance(cuda_aware_mpi({}), bool)  # asks the MPI library; False when it cannot say


@pytest.mark.mpi
# (4, False) is the lazy test's 4-rank layouts without its deferred launches: the slowest of these cases
# (about 46 s under the simulator, 100 s before the cases' small grids: tests/mpi_cases.py), so it runs
# with the slow ones.
@pytest.mark.parametrize(("n", "cuda_aware"), [(2, False), pytest.param(4, False, marks=pytest.mark.slow),
                                               (2, True), (3, True)])
def test_device_path_under_the_cuda_simulator(n, cuda_aware):
    """cuda_aware: MPI is told it may take device pointers (under the simulator they are host
    pointers, so it can), and shards and flat-ring buffers cross nodes without host staging."""
    env = {"NUMBA_ENABLE_CUDASIM": "1", "TUNELAB_CUDA_AWARE_MPI": "1" if cuda_aware else "0"}
    run = run_case("device_path", n, 600, env=env, backend="numba-cuda")
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    for rank, res in enumerate(run.results):
        assert res["direct"] and set(res["direct"]) == {cuda_aware}
        assert res["checks"] >= 39 and res["failures"] == [], f"rank {rank}: {res['failures']}"
        assert res["mixed_kinds"] == [True, False, True]  # host in, host out; device in, device out
        assert "cuda float32[8]" in res["kind_mismatch"] and "rank 0: float32[8]" in res["kind_mismatch"]
        assert res["cpu_refuses"].startswith("device tensors need a GPU kernel back end")


@pytest.mark.mpi
@pytest.mark.parametrize(("n", "cuda_aware"), [(2, False), (4, True)])
def test_device_path_when_launches_run_as_late_as_a_gpu_may(n, cuda_aware):
    """The simulator runs a kernel before the next line; a GPU runs it when its stream gets to it.
    With every launch held back until something waits for its stream (tests/lazy_streams.py), every
    layout still gives numpy's bits: nothing the host hands to MPI, to a peer or to ``free`` is read
    before the launches that write or read it have run.  At four ranks, the layouts three do not have
    (nodes of 2 + 2, flat and hierarchical, and 3 + 1): one node and single-rank nodes took most of its
    140 s, and the three-rank cases run them."""
    env = {"NUMBA_ENABLE_CUDASIM": "1", "TUNELAB_CUDA_AWARE_MPI": "1" if cuda_aware else "0",
           "TUNELAB_DEVICE_ORDERING": "stream-sync", "PYTHONFAULTHANDLER": "1"}
    run = run_case("device_path", n, 600, env=env, backend="numba-cuda", lazy=True, multi_rank_nodes=n == 4)
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    for rank, res in enumerate(run.results):
        assert set(res["direct"]) == {cuda_aware}
        assert res["checks"] >= 43 and res["failures"] == [], f"rank {rank}: {res['failures']}"
        assert res["deferred"] > 100  # the launches did go through the lazy back end


_LAZY_ENV = {"NUMBA_ENABLE_CUDASIM": "1", "TUNELAB_DEVICE_ORDERING": "stream-sync", "PYTHONFAULTHANDLER": "1"}


def _lazy_results(case: str, n: int) -> list[dict]:
    """Every rank's result of a device case run under the simulator with stream-sync ordering (the
    lazy-streams cases), each checked to have no failures."""
    run = run_case(case, n, 300, env=_LAZY_ENV)
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    for rank, res in enumerate(run.results):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"
    return run.results


@pytest.mark.mpi
def test_a_submitted_gradient_waits_for_its_producer_and_no_later_work():
    """Gradient hooks submit while backward goes on queuing kernels; the call reducing gradients must
    wait for the kernels that wrote them and for nothing queued after the last of them (else
    communication cannot overlap the rest of backward). Under lazy streams
    (tests/mpi_cases.py::case_device_marks)."""
    results = _lazy_results("device_marks", 2)
    assert results[0]["later_not_run"][-1] is True  # (work between submits may run: fused calls)


@pytest.mark.mpi
def test_a_fused_call_waits_on_the_last_mark_of_each_producer_stream():
    """Six marked gradients on two producer streams, one of them also from a second thread, one fused
    call: five stream waits (one per producer stream and thread in begin, one per stream in end), not
    one per gradient, and numpy's results with launches run as late as a GPU may
    (tests/mpi_cases.py::case_device_mark_waits)."""
    for res in _lazy_results("device_mark_waits", 2):
        assert res["marked"] == 6 and res["waits"] == 5, res


@pytest.mark.mpi
def test_a_framework_on_a_side_stream_gets_its_gradients_reduced_and_ordered():
    """Training under ``torch.cuda.stream(s)``: the call waits for the side stream's gradients and the
    side stream waits for the results, on the first call (before the device path exists, when nothing
    is marked) as on later ones (tests/mpi_cases.py::case_device_side_stream)."""
    _lazy_results("device_side_stream", 2)


@pytest.mark.mpi
def test_back_to_back_one_shots_do_not_refill_a_slot_a_peer_still_reads():
    """Six direct one-shot calls with nothing read between them, one rank's GPU running behind
    (tests/mpi_cases.py::case_device_back_to_back): every result is numpy's sum."""
    for res in _lazy_results("device_back_to_back", 2):
        assert res["deferred"] > 6  # the launches did go through the lazy back end


@pytest.mark.mpi
def test_a_failed_device_setup_is_set_up_again_by_the_next_call():
    """A first device call whose staging setup failed (out of device memory) raises on every rank, and
    leaves no half-made device path behind: the next calls set it up again and reduce correctly."""
    for res in _lazy_results("device_setup_retry", 2):
        assert res["first"] == "out of device memory (injected)", res


@pytest.mark.mpi
def test_a_tensor_from_a_per_thread_default_stream_is_refused_where_it_is_submitted():
    """The coordinator's thread orders device work against the submitting thread's stream by its handle;
    the per-thread default stream's handle names another stream there (CuPy with
    CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1): such a submit was ordered against nothing."""
    for res in _lazy_results("device_per_thread_stream", 2):
        assert len(res["refused"]) == 2, res
        for said in res["refused"]:
            assert said.startswith("UsageError: a numba tensor produced on the per-thread default stream"), res
        assert res["sums"] == [[3.0] * 4] * 2, res


@pytest.mark.mpi
def test_a_knob_change_whose_device_staging_cannot_grow_stops_the_engine():
    """The old device staging is freed before the larger one is mapped: a failed mapping left the engine
    running with no staging, and its next call failed with an IndexError deep in the one-shot path."""
    for res in _lazy_results("device_slots_cannot_grow", 2):
        assert "out of device memory (injected)" in res["knobs"], res
        assert res["after"].startswith("TunelabError: this engine stopped after an error in a knob change"), res


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_a_device_setup_that_fails_on_one_rank_fails_on_every_rank_at_once(n):
    """The setup's exchanges carry each rank's outcome and are timed: the others no longer wait for good
    in the next exchange while the failed rank has raised (tests/mpi_cases.py::case_device_setup_fails_on_one_rank)."""
    results = _lazy_results("device_setup_fails_on_one_rank", n)
    assert results[-1]["first"] == "RuntimeError: no stream on this GPU (injected)", results[-1]
    for rank, res in enumerate(results[:-1]):
        assert res["first"].startswith("TunelabError: the device path's setup failed on rank "), res
        assert f"rank {n - 1} (RuntimeError: no stream on this GPU (injected))" in res["first"], res
    for rank, res in enumerate(results):
        assert res["first_s"] < 30, res  # at once, not after the 60 s timeout
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_without_cuda_ipc_device_buckets_are_staged_through_host_memory(n):
    """No CUDA IPC between a node's GPUs (tests/mpi_cases.py::case_device_without_ipc): the device path
    no longer fails every call; it stages through the host, said once, and stays exact."""
    results = _lazy_results("device_without_ipc", n)
    for rank, res in enumerate(results):
        assert res["checks"] >= 17 * len(res["staged"]), res
        assert all(s and "cannot map each other's memory through CUDA IPC" in s and "peer access is not "
                   "supported between these devices (injected)" in s for s in res["staged"]), res["staged"]
        assert res["shared_left"] is True, res
        said = "tunelab: {}: device tensors are staged through host memory (slower: every bucket crosses the bus twice)"
        assert res["warned"] == [[said.format(s)] if rank == 0 else [] for s in res["staged"]], res["warned"]


@pytest.mark.mpi
def test_interprocess_events_that_cannot_be_shared_fall_back_to_stream_syncs_unless_asked_for():
    """tests/mpi_cases.py::case_device_events_not_shared, under the simulator (whose default ordering is
    the interprocess events' protocol, with stand-in events)."""
    run = run_case("device_events_not_shared", 3, 300, env={"NUMBA_ENABLE_CUDASIM": "1"})
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    for rank, res in enumerate(run.results):
        assert res["failures"] == [] and res["checks"] == 1, res
        assert res["auto"] == "stream-sync", res
        assert len(res["auto_warned"]) == (1 if rank == 0 else 0), res
        assert "no interprocess event on this GPU (injected)" in res["ipc-events"], res
        if rank < 2:
            assert res["ipc-events"].startswith("TunelabError: an interprocess event failed on local rank 2"), res


@pytest.mark.mpi
def test_a_joined_rank_contributes_device_zeros_to_device_allreduces():
    """A rank that joined contributes zeros to the others' allreduces; with device tensors those zeros
    must be device memory, or the call is refused as a rank mismatch, and are made once per tensor
    (tests/mpi_cases.py::case_device_join)."""
    results = _lazy_results("device_join", 3)
    # ranks 0 and 1 joined last, rank 2 rounds before them: join names one of the two, the same on every
    # rank (rank 1 when both joined at the same cycle; which cycle each one's join falls in is timing)
    assert len({r["joined_last"] for r in results}) == 1 and results[0]["joined_last"] in (0, 1)
    assert [r["checks"] for r in results] == [9, 9, 3]
    # the joined rank's zeros are made once per tensor (three, a bfloat16 one among them), not per call
    # (six): its share is reused
    assert [r["zeros_made"] for r in results] == [0, 0, 3]


def _gpu_backend_or_skip(name: str) -> None:
    from tunelab.kernels import get_backend

    try:
        get_backend(name)
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"{name}: {exc}")


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["cupy", "numba-cuda"])
@pytest.mark.parametrize("n", [2, 4])
def test_ipc_ring_on_one_gpu_shared_by_several_ranks(n, backend):
    _gpu_backend_or_skip(backend)
    run = run_case("device_path", n, 600, backend=backend)
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    for rank, res in enumerate(run.results):
        assert res["checks"] >= 39 and res["failures"] == [], f"rank {rank}: {res['failures']}"


@pytest.mark.mpi
# (2, "auto"): its layouts (one host; nodes of one rank, flat and hierarchical) are (3, "auto")'s too (which
# adds nodes of unequal size), and (2, "stream-sync") runs the same two; slow, as the 4-rank case above.
@pytest.mark.parametrize(("n", "ordering"), [(1, "auto"), pytest.param(2, "auto", marks=pytest.mark.slow),
                                             (3, "auto"), (2, "stream-sync")])
def test_a_warm_device_call_uploads_no_table_allocates_nothing_and_never_waits_for_the_device(n, ordering):
    """Counted through an instrumenting kernel back end under the simulator, every layout: after
    warm-up a call launches kernels only, with its tables already on the device; closed (twice), the
    engine holds no table, event or staging buffer."""
    env = {"NUMBA_ENABLE_CUDASIM": "1", "TUNELAB_CUDA_AWARE_MPI": "1", "TUNELAB_DEVICE_ORDERING": ordering}
    run = run_case("device_structure", n, 600, env=env)
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    for rank, res in enumerate(run.results):
        assert res["failures"] == [], f"rank {rank}: {res['failures']}"
        assert res["uint16_reads_as"] == "bfloat16", res["uint16_reads_as"]
        for r in res["runs"]:
            assert r["held_after_close"] == {"path": False, "tables": 0, "marks": 0, "staging": 0,
                                             "shared_tables": 0}, r
            pc = r["per_call"]
            assert pc.get("copy_table", 0) >= 1, r  # it did run kernels
            for what in ("upload_table", "alloc", "synchronize"):
                assert pc.get(what, 0) == 0, f"rank {rank}: {what} per call in {r}"
            expected = "stream-sync" if ordering == "stream-sync" else "ipc-events"
            assert r["ordering"] == expected
            if r["nodes"] == 1 and r["oneshot"]:  # one bucket, one ordering point
                if expected == "ipc-events":  # peers' events are waited on by the stream
                    assert pc.get("stream_sync", 0) == 0 and pc["wait_event"] == (n - 1) + 2, r
                else:  # the stream (never the device) is waited on once, at the ordering point
                    assert pc["stream_sync"] == 1 and pc["wait_event"] == 2, r


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_sharing_a_gpu_let_one_rank_do_all_the_device_work(n):
    env = {"NUMBA_ENABLE_CUDASIM": "1", "TUNELAB_SHARED_GPU": "leader"}
    run = run_case("shared_gpu", n, 600, env=env)
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    specs = 6  # calls in the counted round, one dtype each
    for rank, res in enumerate(run.results):
        assert res["failures"] == [] and res["checks"] == 4 * 12 + 4, f"rank {rank}: {res['failures']}"
        counts = res["counts"]
        assert res["leader"] == (rank == 0)
        if rank == 0:  # one launch per call and dtype, tables already on the device
            assert counts.get("reduce_bcast") == specs, counts
            assert counts.get("upload_table", 0) == 0 and counts.get("synchronize", 0) == 0, counts
        else:  # peers launch nothing: they wait for their producer on the host and meet at barriers
            for launch in ("reduce_bcast", "copy_table", "scale_copy_table", "reduce"):
                assert counts.get(launch, 0) == 0, (launch, counts)
            assert counts.get("event_sync") == specs, counts


@pytest.mark.mpi
@pytest.mark.parametrize(("fail_at", "error"), [("launch", "RuntimeError: launch failed (injected)"),
                                                ("open", "NotShareable: cannot open the handle (injected)")])
def test_a_failure_of_the_rank_doing_the_shared_gpu_work_reaches_every_rank_at_once(fail_at, error):
    """The leader's launch, or its opening of a peer's new allocation, fails on the second of three calls
    (tests/mpi_cases.py::case_shared_gpu_leader_fails): the leader raises its own error, the peers a
    TunelabError naming it, all within seconds rather than the engine's 60 s timeout; the calls before
    and after are numpy's sums (after a failed open, the handles were published again)."""
    env = {"NUMBA_ENABLE_CUDASIM": "1", "TUNELAB_SHARED_GPU": "leader"}
    run = run_case("shared_gpu_leader_fails", 2, 120, env=env, fail_at=fail_at)
    assert run.returncode == 0 and all(r is not None for r in run.results), run.stderr[-3000:]
    leader, peer = run.results
    assert leader["leader"] and not peer["leader"]
    for res in (leader, peer):
        first, failed, after = res["calls"]
        assert first["error"] == after["error"] == "" and first["right"] and after["right"], res
        assert failed["seconds"] < 10, res
    assert leader["calls"][1]["error"] == error
    assert peer["calls"][1]["error"].startswith("TunelabError: ") and "local rank 0" in peer["calls"][1]["error"]


def test_a_model_on_a_gpu_has_its_own_profile_signature():
    """A config tuned for the device path is never auto-loaded for the host path, and the reverse."""
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from tunelab.torch.optimizer import parameters_signature

    cpu = [torch.zeros(2, 3), torch.zeros(4)]
    gpu = [SimpleNamespace(shape=t.shape, dtype=t.dtype, is_cuda=True) for t in cpu]
    assert parameters_signature(cpu).startswith("2p-")
    assert parameters_signature(gpu) == "cuda-" + parameters_signature(cpu)


def test_a_staging_segment_that_one_rank_cannot_set_up_fails_on_every_rank():
    """Out of device memory on one rank while the staging segments grow, or a peer's segment that
    cannot be mapped: every rank raises at once, naming the rank (the others used to wait for it in an
    allgather for good), each frees its own segment and closes what it mapped, and the next setup works
    (tests/mpi_cases.py::case_staging_setup_fails)."""
    results = run_ok("staging_setup_fails", 3, limit_s=60)
    for r, res in enumerate(results):
        assert res["allocate"]["error"].startswith("TunelabError: device staging of 4096 bytes"), res["allocate"]
        assert "local rank 2: MemoryError: out of memory allocating 4096 bytes" in res["allocate"]["error"]
        assert res["allocate"]["log"] == ([] if r == 2 else ["allocate", "release"])
        # allocated but refused export: no CUDA IPC on this node (the device path then stages through the host)
        assert res["export"]["error"].startswith("IpcUnavailable: the node's GPUs cannot map each other's memory")
        assert "local rank 2: cudaErrorNotSupported: operation not supported (injected)" in res["export"]["error"]
        assert res["export"]["log"] == ([] if r == 2 else ["allocate", "release"])
        assert res["open"]["error"].startswith("IpcUnavailable: "), res["open"]
        assert "local rank 0: OSError: cannot open the handle" in res["open"]["error"]
        opened = [f"open {q}" for q in range(3) if q != r]
        want = ["allocate", "open 1", "close 1", "release"] if r == 0 else ["allocate", *opened, *[f"close {q}" for q in range(3) if q != r], "release"]
        assert res["open"]["log"] == want, (r, res["open"]["log"])
        assert res["ok"]["addrs"] == [0x1000 * (q + 1) if q == r else 0x100000 + q for q in range(3)]


def test_a_tensor_on_another_gpu_than_the_ranks_others_is_refused_where_it_is_submitted():
    """One rank reduces on one GPU: a tensor on another (a model split over two GPUs in one rank) is
    refused with a clear error when it is submitted, before the device path exists and after, instead
    of being read through the wrong device's stream."""
    from types import SimpleNamespace

    from tunelab.engine.engine import Engine

    class TorchLike:  # what tunelab.engine.device.device_index reads of a torch tensor
        __module__ = "torch"

        def __init__(self, index: int) -> None:
            self.device = SimpleNamespace(index=index)

    engine = Engine.__new__(Engine)
    engine._device, engine._gpu_seen = None, None
    engine.check_gpu(SimpleNamespace(owner=TorchLike(1)))
    engine.check_gpu(SimpleNamespace(owner=TorchLike(1)))
    engine.check_gpu(SimpleNamespace(owner=object()))  # a library that does not say: not checked
    with pytest.raises(ValueError, match="on GPU 0, but this rank reduces on GPU 1"):
        engine.check_gpu(SimpleNamespace(owner=TorchLike(0)))
    engine._device = SimpleNamespace(index=2)  # the device path, once made, decides
    with pytest.raises(ValueError, match="on GPU 1, but this rank reduces on GPU 2"):
        engine.check_gpu(SimpleNamespace(owner=TorchLike(1)))
    # an output on another GPU than its input is refused too (the rank's GPU would write it)
    import numpy as np

    from tunelab.engine.device import DeviceBuffer

    def buf(addr: int, index: int) -> DeviceBuffer:
        return DeviceBuffer(addr, 4, np.dtype(np.float32), (4,), TorchLike(index))

    engine._inputs([buf(0x1000, 2)], [buf(0x1000, 2)], [True])  # in place
    engine._inputs([buf(0x1000, 2)], [buf(0x2000, 2)], [True])
    with pytest.raises(ValueError, match="on GPU 3, but this rank reduces on GPU 2"):
        engine._inputs([buf(0x1000, 2)], [buf(0x2000, 3)], [True])


def test_the_table_cache_tells_tables_of_the_same_bytes_but_other_shapes_apart():
    """Kernel tables are cached by content: a reduce's list of source addresses and a copy table of one
    row can hold the same numbers, and must not share an upload (the copy would be skipped, or the
    reduce would read one source)."""
    from types import SimpleNamespace

    from tunelab.engine.device_path import TableCache

    cache = TableCache(SimpleNamespace(upload_table=lambda table, stream: table.copy()), None)
    flat, row = cache.get(np.array([4096, 8192, 64])), cache.get(np.array([[4096, 8192, 64]]))
    assert flat.shape == (3,) and row.shape == (1, 3) and len(cache) == 2
    assert cache.get(np.array([4096, 8192, 64])) is flat  # found again by content


def test_an_output_made_for_a_cupy_tensor_is_on_that_tensors_gpu(monkeypatch):
    """A call without outputs gets new ones like its inputs: for a CuPy array on GPU 1 the new array is
    made on GPU 1, whatever the calling thread's current GPU (the coordinator's thread: GPU 0)."""
    import sys
    from types import SimpleNamespace

    from fake_cuda_device import CurrentDevice

    from tunelab.engine.device import DeviceBuffer, empty_like

    current = CurrentDevice(0)
    fake = SimpleNamespace(cuda=SimpleNamespace(Device=current.device),
                           empty=lambda shape, dtype: ("made on GPU", current.index, shape))
    monkeypatch.setitem(sys.modules, "cupy", fake)

    class CupyLike:
        __module__ = "cupy"
        device = SimpleNamespace(id=1)
        dtype = np.dtype(np.float32)

    got = empty_like(DeviceBuffer(0x1000, 6, np.dtype(np.float32), (2, 3), CupyLike()))
    assert got == ("made on GPU", 1, (2, 3)) and current.index == 0


def test_torch_producer_stream_is_read_raw_where_torch_can(monkeypatch):
    """A torch tensor's producer stream comes from torch's raw reader when the build has one (the
    GPU test checks it names the same stream as torch.cuda.current_stream), else the public call."""
    torch = pytest.importorskip("torch")
    from tunelab.engine.device import producer_stream_handle

    t = torch.zeros(2)
    asked = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda index: asked.append(index) or 0xBEEF, raising=False)
    assert producer_stream_handle(t) == 0xBEEF and asked == [t.get_device()]
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")

    class Named:
        cuda_stream = 0xCAFE

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Named())
    assert producer_stream_handle(t) == 0xCAFE
