"""``tunelab bench allreduce``: nccl-tests-style allreduce benchmark (rank side).

For every size: each algorithm's warm-up, then timed iterations that start together after a
barrier, the algorithms taking turns (four rounds, each giving every algorithm a quarter of its
iterations, in an order that rotates: a slow stretch of a shared host falls on all of them alike);
the reported time is the median over iterations of the slowest rank.  Inputs are exact-sum
integers, the output is poisoned before every timed iteration and compared bit for bit with a numpy
reference after it: ``wrong`` counts mismatched elements (the most in any iteration, summed over ranks).

The ``bound`` row is the physical limit of any allreduce on these ranks: every rank reads its
input and writes its output at the same time, as a plain copy (host memory, or device memory with
``--device cuda``), measured like the others in the same run.  Ranks sharing one GPU share its
memory system: there one rank copies all of their bytes in one launch.  An allreduce moves at least those
bytes, so its time over ``bound`` says how far it is from the memory system.  (Between hosts, or
behind an emulated link, the link sets a higher bound that this row does not include.)

With ``--device cuda`` inputs and outputs live in device memory: ring and hierarchical run the
engine's device path (CUDA-IPC staging within a node), and ``mpi`` is the path a script without
one takes: copy to the host, ``MPI_Allreduce``, copy back.  gloo is host-only and is skipped.  Every
device row's time ends when its result is in device memory: the engine's calls return once their
kernels are queued, so each timed call ends with a wait for the caller's stream (which waits on the
call), as the copy of the ``bound`` row ends with one.
"""

from __future__ import annotations

import numpy as np

from ..config import load_engine_config
from ..dtypes import dtype_from_name
from ..hardware import host_info
from ..knobs import Knobs
from .baselines import MPI_UNSUPPORTED, GlooGroup, torch_available
from .common import bound_copy, count_wrong, exact_input, exact_sum, interleaved_iterations

ALGORITHMS = ("ring", "hierarchical", "mpi", "gloo", "bound")


def run_rank(p: dict) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    dtype = dtype_from_name(p["dtype"])
    on_device = p.get("device", "cpu") == "cuda"
    tools = _device_tools(comm) if on_device else None
    algorithms, notes = _algorithms(p, dtype, on_device)
    if "hierarchical" in algorithms and not p.get("algorithms_given", True):
        from ..engine.topology import build_topology

        topo = build_topology(comm, p.get("ranks_per_node"))
        sizes, even = topo.node_sizes, topo.homogeneous
        topo.free()
        if not even:  # (asked for by name, the engine's own error says why it cannot run)
            algorithms.remove("hierarchical")
            notes.append(f"hierarchical: skipped, nodes of unequal size {list(sizes)}")
    engines = _engines(comm, p, algorithms)
    gloo = None
    if "gloo" in algorithms:
        if torch_available():
            gloo = GlooGroup(comm)
        else:
            algorithms.remove("gloo")
            notes.append("gloo: skipped, torch is not installed (pip install 'tunelab[torch]')")
    sharing, leader = _gpu_sharing(comm, engines) if on_device else (1, True)
    if sharing > 1 and "bound" in algorithms:
        notes.append(f"bound: {sharing} ranks share one GPU: one rank copies all their bytes in one launch")
    rows = []
    for size in p["sizes"]:
        count = max(1, size // dtype.itemsize)
        src = exact_input(count, comm.rank, comm.size, dtype)
        expected = exact_sum(count, comm.size, dtype)
        rows += _measure_size(comm, p, algorithms, src, expected, engines, gloo, tools, sharing, leader)
    if "ring" in engines and "hierarchical" in engines:
        topo = engines["ring"].topology
        if topo.num_nodes == 1 or topo.local_size == 1:  # (the engine takes hierarchical only across nodes of 2+)
            where = "one node" if topo.num_nodes == 1 else "nodes of one rank"
            inside = (": within a node both are the one-shot or two-shot through shared memory"
                      if topo.num_nodes == 1 else ": both are the ring over every rank")
            notes.append(f"ring and hierarchical run the same code on {where}{inside} (their rows differ only "
                         "by noise)")
    if any(e.shared_gpu for e in engines.values()):  # what the engine did, not what it might have
        notes.append("ring/hierarchical on a shared GPU: the node's first rank reduces for every rank in one "
                     "launch (the shared-GPU path)")
    if on_device and engines:
        from ..engine.device import device_backend_name, simulated

        notes.append(f"device kernels: {device_backend_name(next(iter(engines.values())).config.backend)}"
                     + (" under the CUDA simulator: results are checked, timings mean nothing" if simulated() else ""))
    hardware = _hardware(comm, p, engines)
    for e in engines.values():
        e.close()
    if gloo is not None:
        gloo.close()
    return {"rows": rows, "hardware": hardware, "device": "cuda" if on_device else "cpu", "notes": notes}


def _measure_size(comm, p: dict, algorithms: list[str], src: np.ndarray, expected: np.ndarray, engines: dict,
                  gloo, tools: tuple | None, sharing: int, leader: bool) -> list[dict]:
    """One row per algorithm at one size, the algorithms taking turns (:func:`.common.interleaved_iterations`).
    They share one output (and its device copy), poisoned before every timed iteration and checked bit for
    bit after it: taking turns, they would otherwise hold an output each at once."""
    from mpi4py import MPI

    out = np.empty_like(src)
    device = (tools[0](src), tools[0](out)) if tools is not None else None
    ops = [_operation(algo, comm, src, out, device, engines, gloo, tools, sharing, leader) for algo in algorithms]
    wrong = [0] * len(ops)

    def poison(i: int) -> None:  # an algorithm that writes nothing is caught
        out.view(np.uint8).fill(0xFF)
        if device is not None:
            tools[2](device[1], out)
            tools[4]()

    # The bound's copy is checked against the input (as every other row is against the sum, untimed
    # alike: a check that only some rows paid would leave the others' next iteration other caches);
    # where ranks share a GPU its leader copies all their bytes, and nothing is a copy of this input.
    bound_checked = sharing == 1

    def check(i: int) -> None:
        if algorithms[i] != "bound":
            wrong[i] = max(wrong[i], count_wrong(ops[i][2](), expected))
        elif bound_checked:
            wrong[i] = max(wrong[i], count_wrong(ops[i][2](), src))

    times = interleaved_iterations(comm, [(op, reset) for op, reset, _ in ops], p["iters"], p["warmup"],
                                   before=poison, after=check)
    count = src.size
    return [_row(algo, count, src.dtype, times[i],
                 None if algo == "bound" and not bound_checked else comm.allreduce(wrong[i], op=MPI.SUM), comm.size)
            for i, algo in enumerate(algorithms)]


def _algorithms(p: dict, dtype: np.dtype, on_device: bool) -> tuple[list[str], list[str]]:
    """The algorithms this run can measure, and a note for each one left out or measured differently."""
    algorithms = list(p["algorithms"])
    notes: list[str] = []
    if on_device and "gloo" in algorithms:
        algorithms.remove("gloo")
        notes.append("gloo: skipped on --device cuda (it reduces host memory only)")
    if on_device and "mpi" in algorithms:
        notes.append("mpi on --device cuda: device -> host copy, MPI_Allreduce, host -> device copy")
    if "mpi" in algorithms and dtype.name in MPI_UNSUPPORTED:
        algorithms.remove("mpi")
        notes.append(f"mpi: skipped, MPI has no standard {dtype.name} sum")
    if p.get("link_gbps") is not None and ({"mpi", "gloo"} & set(algorithms)):
        notes.append("mpi and gloo run outside the engine: the emulated link does not slow them")
    return algorithms, notes


def _engines(comm, p: dict, algorithms: list[str]) -> dict:
    """One engine per engine algorithm asked for (flat ring, hierarchical), with the run's knobs."""
    from ..engine.engine import Engine

    engines = {}
    for algo in ("ring", "hierarchical"):
        if algo in algorithms:
            cfg = load_engine_config(ranks_per_node=p.get("ranks_per_node"), link_gbps=p.get("link_gbps"),
                                     link_latency_us=p.get("link_latency_us"),
                                     **{**p.get("knobs", {}), "hierarchical": algo == "hierarchical"})
            engines[algo] = Engine(comm, cfg)
    return engines


def _operation(algo: str, comm, src: np.ndarray, out: np.ndarray, device: tuple | None, engines: dict, gloo,
               tools: tuple | None, sharing: int = 1, leader: bool = True) -> tuple:
    """(op, reset, result) for one algorithm at one size: ``op`` is what is timed, ``reset`` (or None)
    restores its input before each iteration, ``result()`` is its output as a host array.  ``out`` (and
    with ``--device cuda`` ``device``, the input and output in device memory) is the output every
    algorithm of this size writes, poisoned by the caller before every timed iteration, so an allreduce
    that writes nothing is caught.  ``sharing``: how many ranks share this rank's GPU (the bound is then
    one copy of all their bytes, by the ``leader``, the node's first)."""
    from mpi4py import MPI

    if tools is not None:  # --device cuda: inputs and outputs in device memory
        upload, download, store, copy, wait = tools
        if algo == "bound" and sharing > 1:
            # Ranks sharing one GPU: its memory system is the limit for all of them together, reached by
            # one launch moving every rank's bytes (N processes copying at once would add the GPU's
            # switching between their contexts, which the engine's shared-GPU path does not pay).
            if not leader:
                return (lambda: None), None, lambda: out
            d_all, d_all_out = upload(np.concatenate([src] * sharing)), upload(np.concatenate([out] * sharing))
            return (lambda: copy(d_all_out, d_all)), None, lambda: out
        d_src, d_out = device
        if algo == "bound":
            def op() -> None:
                copy(d_out, d_src)
        elif algo in engines:
            def op() -> None:
                # The device path returns once its kernels are queued (the caller's stream waits on
                # them): a call's time ends when its result is there, as the copy's and MPI's do.
                engines[algo].allreduce(d_src, out=d_out)
                wait()
        else:
            def op() -> None:
                comm.Allreduce(download(d_src), out, op=MPI.SUM)
                store(d_out, out)
                wait()  # (CuPy's upload is queued on its stream: the row ends when the result is there)
        return op, None, lambda: download(d_out)
    if algo == "bound":
        op = bound_copy(src, out, next(iter(engines.values()), None))
    elif algo in engines:
        def op() -> None:
            engines[algo].allreduce(src, out=out)
    elif algo == "mpi":
        def op() -> None:
            comm.Allreduce(src, out, op=MPI.SUM)
    else:  # gloo reduces in place: its row times the copy of the input into the output too, which every
        def op() -> None:  # other row (out of place, its input kept) pays in its own way
            np.copyto(out, src)
            gloo.allreduce_(out)
    return op, None, lambda: out


def _gpu_sharing(comm, engines: dict) -> tuple[int, bool]:
    """(how many ranks of this node use this rank's GPU, whether this rank is the first of them)."""
    from mpi4py import MPI

    from ..engine.device import device_backend_name
    from ..kernels import get_backend

    backend = next(iter(engines.values())).config.backend if engines else load_engine_config().backend
    mine = get_backend(device_backend_name(backend)).device_id()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ids = local.allgather(mine)
    rank = local.rank
    local.Free()
    same = [r for r, i in enumerate(ids) if i == mine]
    return len(same), rank == same[0]


def _hardware(comm, p: dict, engines: dict) -> dict:
    """What ran where: the host (its GPUs too, with ``--device cuda``), the ranks' layout into nodes, the
    emulated link, the knobs, a lab's facts."""
    topo = next(iter(engines.values())).topology if engines else None
    return {**host_info(gpus=p.get("device", "cpu") == "cuda"), "world_size": comm.size,
            "nodes": topo.num_nodes if topo else None,
            "ranks_per_node": list(topo.node_sizes) if topo else None,
            "link_gbps": p.get("link_gbps"), "link_latency_us": p.get("link_latency_us") or 0.0,
            "knobs": (next(iter(engines.values())).knobs if engines else Knobs(**p.get("knobs", {}))).as_dict(),
            **lab_facts(comm)}


def _device_tools(comm) -> tuple:
    """(upload, download, store host into device, device-to-device copy, wait until the caller's stream
    is done) for the GPU back end the engine will use, on this rank's own GPU (:func:`_rank_gpu`)."""
    from ..engine.device import device_backend_name
    from ..errors import TunelabError

    name = device_backend_name(load_engine_config().backend)
    if name == "cupy":
        import cupy

        cupy.cuda.Device(_rank_gpu(comm, cupy.cuda.runtime.getDeviceCount())).use()

        def wait() -> None:
            cupy.cuda.get_current_stream().synchronize()

        def copy(dst, src) -> None:
            dst[...] = src  # a device-to-device copy on CuPy's current stream, then a wait for it
            wait()

        return cupy.asarray, cupy.asnumpy, lambda d, h: d.set(h), copy, wait
    if name == "numba-cuda":
        from numba import cuda

        cuda.select_device(_rank_gpu(comm, len(cuda.gpus)))

        def copy_numba(dst, src) -> None:
            dst.copy_to_device(src)  # device to device: queued (cuMemcpyDtoD does not wait for itself) ...
            cuda.synchronize()  # ... so wait for it, as the engine rows wait for their calls

        return cuda.to_device, lambda a: a.copy_to_host(), lambda d, h: d.copy_to_device(h), copy_numba, cuda.synchronize
    raise TunelabError("--device cuda needs a CUDA device with CuPy or numba-cuda; none is available")


def _rank_gpu(comm, gpus: int) -> int:
    """The GPU this rank's buffers live on, of the ``gpus`` it sees: its place among its machine's ranks,
    modulo ``gpus``, as ``bench train`` and ``tune`` place a rank's model (without it every rank took
    the current device, GPU 0, and a node of several GPUs was measured as ranks sharing one)."""
    from mpi4py import MPI

    from ..workloads.torch_device import gpu_slot

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return gpu_slot(comm.rank, local.rank) % max(1, gpus)
    finally:
        local.Free()


def _row(algo: str, count: int, dtype: np.dtype, times: np.ndarray, wrong: int | None, world: int) -> dict:
    nbytes = count * dtype.itemsize
    t = float(np.median(times))
    algbw = nbytes / t / 1e9
    return {"algorithm": algo, "size": nbytes, "count": count, "dtype": dtype.name,
            "time_us": t * 1e6, "time_us_p10": float(np.percentile(times, 10)) * 1e6,
            "time_us_p90": float(np.percentile(times, 90)) * 1e6,
            "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world,
            "wrong": None if wrong is None else int(wrong), "iters": int(times.size)}


def lab_facts(comm) -> dict:
    """``{"lab": {...}}`` when this job runs on a lab's hosts (how many, their link), else ``{}``."""
    from mpi4py import MPI

    from ..lab.launch import current_lab

    state = current_lab()
    if state is None:
        return {}
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    hosts = comm.allreduce(1 if host.rank == 0 else 0, op=MPI.SUM)
    per_host = host.size
    host.Free()
    from ..lab.spec import bucket

    return {"lab": {"hosts": hosts, "ranks_per_host": per_host, "link_gbps": state.spec.link_gbps,
                    "burst_bytes": bucket(state.spec.link_gbps)[0],
                    "link_latency_us": state.spec.link_latency_us if state.netem else 0.0,
                    "sustained_gbps": state.sustained_gbps, "transport": "tcp over shaped veth links"}}


def link_bound_s(size: int, hosts: int, gbps: float) -> float:
    """The least time any allreduce of ``size`` bytes over ``hosts`` hosts needs behind full-duplex
    links of ``gbps``: each host must send (and receive) 2 (H-1)/H of the data, as a ring does."""
    return 2 * (hosts - 1) / hosts * size * 8 / (gbps * 1e9)


def add_link_bound(rows: list[dict], hardware: dict) -> None:
    """On a lab (or behind an emulated link): a computed ``link-bound`` row per size and
    ``time_vs_link`` on every row, the time over what the link's bandwidth allows."""
    lab = hardware.get("lab")
    if lab:
        hosts, gbps = int(lab["hosts"]), float(lab["link_gbps"])
    elif hardware.get("link_gbps") and (hardware.get("nodes") or 1) > 1:
        hosts, gbps = int(hardware["nodes"]), float(hardware["link_gbps"])
    else:
        return
    sizes = sorted({r["size"] for r in rows})
    for size in sizes:
        proto = next(r for r in rows if r["size"] == size)
        t = link_bound_s(size, hosts, gbps)
        # busbw as every measured row has it (algbw x 2 (N-1)/N over the run's N ranks, read off a
        # measured row), so a row at the link bound shows the bound's busbw, not more
        factor = proto["busbw_gbps"] / proto["algbw_gbps"] if proto.get("algbw_gbps") else 2 * (hosts - 1) / hosts
        rows.append({"algorithm": "link-bound", "size": size, "count": proto["count"], "dtype": proto["dtype"],
                     "time_us": t * 1e6, "time_us_p10": t * 1e6, "time_us_p90": t * 1e6,
                     "algbw_gbps": size / t / 1e9, "busbw_gbps": size / t / 1e9 * factor,
                     "wrong": None, "iters": 0, "computed": True})
    rows.sort(key=lambda r: (r["size"], r["algorithm"] == "link-bound"))
    for r in rows:
        r["time_vs_link"] = r["time_us"] / (link_bound_s(r["size"], hosts, gbps) * 1e6)


def add_ratios(rows: list[dict], baseline: str = "mpi") -> None:
    """Add ``busbw_vs_<baseline>`` to every row whose size has a baseline row, and ``time_vs_bound``
    (time over the ``bound`` row's: 1.0 is the memory system's limit) where a bound was measured."""
    base = {r["size"]: r["busbw_gbps"] for r in rows if r["algorithm"] == baseline}
    bound = {r["size"]: r["time_us"] for r in rows if r["algorithm"] == "bound"}
    for r in rows:
        b = base.get(r["size"])
        r[f"busbw_vs_{baseline}"] = (r["busbw_gbps"] / b) if b and r["algorithm"] != "bound" else None
        t = bound.get(r["size"])
        r["time_vs_bound"] = (r["time_us"] / t) if t else None
