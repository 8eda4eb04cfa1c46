"""Test bodies run on every rank by tests/mpi_harness.py: ``python mpi_cases.py CASE PARAMS OUTDIR``.

Each case works at any world size and checks results against references that numpy
computes from every rank's inputs (each rank regenerates all ranks' inputs from seeds).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import zlib
from pathlib import Path

import numpy as np
from mpi4py import MPI

from tunelab.config import load_engine_config
from tunelab.dtypes import dtype_from_name, supported_names
from tunelab.engine.engine import Engine
from tunelab.errors import CollectiveTimeoutError, RankMismatchError, TopologyError, TunelabError

FLOATS = ("float16", "bfloat16", "float32", "float64")


def exact_inputs(count: int, dtype: np.dtype, world: int, seed: int) -> list[np.ndarray]:
    """Random small integers for every rank: any summation order gives the exact sum."""
    span = 8 if world <= 16 else 2
    return [np.random.default_rng((seed, r)).integers(-span, span + 1, count).astype(dtype)
            for r in range(world)]


def float_inputs(count: int, dtype: np.dtype, world: int, seed: int) -> list[np.ndarray]:
    return [np.random.default_rng((seed, r)).standard_normal(count).astype(dtype) for r in range(world)]


def top_half_inputs(count: int, world: int, seed: int) -> list[np.ndarray]:
    """float16 inputs in [16384, 65408], one sign per element on every rank: their sums overflow
    float16, their average does not.  Multiples of 128: every partial sum of them scaled by 1/2 or
    1/4 is exact in float16, so no order of the adds can move a bit of the average."""
    rng = np.random.default_rng((seed, count))  # the same stream on every rank
    sign = np.where(rng.random(count) < 0.5, -1.0, 1.0)
    return [(sign * 128 * rng.integers(128, 512, count)).astype(np.float16) for _ in range(world)]


def reference(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """numpy reference; sums are exact (float64 accumulation of small integers)."""
    dtype = inputs[0].dtype
    if op == "min":
        return np.minimum.reduce(inputs)
    if op == "max":
        return np.maximum.reduce(inputs)
    total = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    if op == "sum":
        return total.astype(dtype)
    # average: the sum scaled by 1/N, computed in float32 for half types
    work = np.float64 if dtype == np.float64 else np.float32
    return (total.astype(work) * work(1.0 / len(inputs))).astype(dtype)


def bit_mismatches(a: np.ndarray, b: np.ndarray) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.size, b.size, 1)
    return int(np.any(a.reshape(a.size, -1).view(np.uint8) != b.reshape(b.size, -1).view(np.uint8),
                      axis=-1).sum()) if a.size else 0


def layouts(world: int) -> list[dict]:
    """Node layouts worth testing at this world size (real host, emulated nodes)."""
    out: list[dict] = [{"ranks_per_node": None, "hierarchical": False}]
    for k in sorted({1, 2, world - 1} - {0}):
        if k < world:
            out.append({"ranks_per_node": k, "hierarchical": False})
            if world % k == 0:
                out.append({"ranks_per_node": k, "hierarchical": True})
    return out


# ---- cases ---------------------------------------------------------------------------------------
def case_engine_sweep(comm: MPI.Comm, seed: int = 0) -> dict:
    """Every dtype x op x size x layout x in/out-of-place; bitwise against numpy."""
    n = comm.size
    counts = sorted({0, 1, 2, n - 1 if n > 1 else 3, n, n + 1, 7, 13, 1000, 4099, 20011})
    failures: list[str] = []
    checks = 0
    for lay in layouts(n):
        # two-shot pipelined in tiny pieces (rings between nodes), two-shot in one piece (recursive
        # doubling between nodes up to 1 MiB), and one-shot up to 256 KiB (the default doubling)
        for segment, oneshot, doubling in ((4096, 0, 0), (1 << 22, 0, 1 << 20), (4096, 1 << 18, None)):
            more = {} if doubling is None else {"doubling_max_bytes": doubling}
            engine = Engine(comm, load_engine_config(segment_bytes=segment, oneshot_max_bytes=oneshot,
                                                     **more, **lay))
            for name in supported_names():
                dt = dtype_from_name(name)
                for op in ("sum", "average", "min", "max"):
                    if op == "average" and name not in FLOATS:
                        continue
                    for count in counts:
                        inputs = exact_inputs(count, dt, n, seed=zlib.crc32(f"{name}/{op}/{count}".encode()))
                        ref = reference(inputs, op)
                        mine = inputs[comm.rank].copy()
                        inplace = (count % 2 == 1)
                        out = engine.allreduce(mine, op, out=mine if inplace else None)
                        bad = bit_mismatches(out, ref)
                        checks += 1
                        if bad:
                            failures.append(f"{lay} seg={segment} oneshot={oneshot} doubling={doubling} {name} {op} n={count} "
                                            f"inplace={inplace}: {bad} wrong")
                        if not inplace and bit_mismatches(mine, inputs[comm.rank]):
                            failures.append(f"{lay} {name} {op} n={count}: input was modified")
            engine.close()
    return {"checks": checks, "failures": failures[:20]}


def case_random_batches(comm: MPI.Comm, seed: int = 1, rounds: int = 25, fenced: bool = False) -> dict:
    """Random batches (shapes, dtypes, groups) under random knobs and layouts; ``fenced``: the node
    barrier puts memory barriers around its flags as it does on CPUs without x86's store order."""
    if fenced:
        import platform

        platform.machine = lambda: "aarch64"
    n = comm.size
    failures: list[str] = []
    checks = 0
    rng = np.random.default_rng(seed)  # same stream on every rank: same choices everywhere
    for rnd in range(rounds):
        lay = layouts(n)[rng.integers(len(layouts(n)))]
        knobs = {"fusion_threshold_bytes": int(rng.choice([0, 64, 4096, 1 << 16, 1 << 26])),
                 "segment_bytes": int(rng.choice([4096, 1 << 14, 1 << 20])),
                 "oneshot_max_bytes": int(rng.choice([0, 256, 1 << 18])),
                 "doubling_max_bytes": int(rng.choice([0, 256, 1 << 16])),
                 "group_fusion": bool(rng.integers(2))}
        engine = Engine(comm, load_engine_config(**lay, **knobs))
        if fenced and not engine.barrier.fenced:
            failures.append("the node barrier is not fenced")
        ntensors = int(rng.integers(1, 12))
        names = [str(rng.choice(supported_names())) for _ in range(ntensors)]
        shapes = [tuple(int(d) for d in rng.integers(0, 40, rng.integers(0, 3))) for _ in range(ntensors)]
        groups = [None if rng.random() < 0.5 else int(rng.integers(3)) for _ in range(ntensors)]
        op = str(rng.choice(["sum", "min", "max"]))
        per_rank = [[] for _ in range(n)]
        for i, (name, shape) in enumerate(zip(names, shapes)):
            count = int(np.prod(shape))
            for r, x in enumerate(exact_inputs(count, dtype_from_name(name), n, seed=rnd * 100 + i)):
                per_rank[r].append(x.reshape(shape))
        outs = engine.allreduce_batch(per_rank[comm.rank], op, groups=groups)
        for i in range(ntensors):
            checks += 1
            ref = reference([per_rank[r][i] for r in range(n)], op)
            if bit_mismatches(outs[i], ref):
                failures.append(f"round {rnd} {lay} {knobs} tensor {i} {names[i]}{shapes[i]} {op}")
        engine.close()
    return {"checks": checks, "failures": failures[:20]}


def case_grouped_determinism(comm: MPI.Comm, seed: int = 2) -> dict:
    """A group of random floats gives the same bits whatever else is in flight, when group fusion is
    off; fusion thresholds do not change grouped results either."""
    n = comm.size
    digests = []
    for lay in layouts(n):
        group = [x[comm.rank] for x in (float_inputs(c, np.dtype(np.float32), n, seed + c)
                                         for c in (5, 1000, 333, 4097))]
        others = [x[comm.rank] for x in (float_inputs(c, np.dtype(np.float32), n, seed + 7 * c)
                                          for c in (17, 2048))]
        results = []
        for threshold, companions in ((1 << 26, []), (1 << 26, others), (0, others), (4096, others)):
            engine = Engine(comm, load_engine_config(fusion_threshold_bytes=threshold, group_fusion=False,
                                                     segment_bytes=4096, **lay))
            tensors = companions[:1] + group + companions[1:]
            ids = [None] * len(companions[:1]) + [5] * len(group) + [None] * len(companions[1:])
            outs = engine.allreduce_batch(tensors, "sum", groups=ids)
            mine = outs[len(companions[:1]):len(companions[:1]) + len(group)]
            results.append(b"".join(o.tobytes() for o in mine))
            engine.close()
        digests.append(len(set(results)) == 1)
        ref = reference([np.concatenate([x[r] for x in (float_inputs(c, np.dtype(np.float32), n, seed + c)
                                                        for c in (5, 1000, 333, 4097))]) for r in range(n)],
                        "sum")
        got = np.frombuffer(results[0], np.float32)
        digests.append(bool(np.allclose(got, ref, rtol=1e-5, atol=1e-5)))
    return {"all_identical": all(digests)}


def case_doubling_same_bits(comm: MPI.Comm, seed: int = 3) -> dict:
    """Random floats (signed zeros and NaNs among them) through recursive doubling between emulated
    nodes of one rank (flat) and of two (hierarchical shards): every rank ends with the same bits, and
    the values are numpy's (sums within float32 rounding, min and max exactly, zeros of either sign
    being equal)."""
    n = comm.size
    failures: list[str] = []
    for lay in ({"ranks_per_node": 1}, {"ranks_per_node": 2, "hierarchical": True}):
        if n % lay["ranks_per_node"] or n // lay["ranks_per_node"] < 2:
            continue
        engine = Engine(comm, load_engine_config(doubling_max_bytes=1 << 20, **lay))
        for count in (1, 7, 1000, 4099):
            rng = np.random.default_rng(seed + count)  # the same stream on every rank
            inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
            for r, x in enumerate(inputs):
                x[::5] = -0.0 if r % 2 else 0.0
                if count > 10:
                    x[3 + r] = np.nan
            for op in ("sum", "min", "max"):
                out = engine.allreduce(inputs[comm.rank].copy(), op)
                if len(set(comm.allgather(out.tobytes()))) != 1:
                    failures.append(f"{lay} {op} n={count}: ranks hold different bits")
                stacked = np.stack(inputs)
                ref = {"sum": stacked.sum(axis=0, dtype=np.float64).astype(np.float32),
                       "min": np.minimum.reduce(stacked), "max": np.maximum.reduce(stacked)}[op]
                same = np.isclose(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True) if op == "sum" \
                    else (out == ref) | (np.isnan(out) & np.isnan(ref))
                if not same.all():
                    failures.append(f"{lay} {op} n={count}: {int((~same).sum())} values differ from numpy")
        engine.close()
    return {"failures": failures[:20]}


def case_short_route_same_bits(comm: MPI.Comm, seed: int = 19) -> dict:
    """A single small host tensor takes a short route (one node: the agreed one-shot; several: recursive
    doubling on the output); the same call as a group takes the planned one through the kernels.  With
    signed zeros and NaNs of different payloads in the inputs, both give the same bits on every rank."""
    n, failures, checks = comm.size, [], 0
    for lay in ({"ranks_per_node": None}, {"ranks_per_node": 1}, {"ranks_per_node": 2}):
        if lay["ranks_per_node"] and (n % lay["ranks_per_node"] or n // lay["ranks_per_node"] < 2):
            continue
        engine = Engine(comm, load_engine_config(**lay))
        for dtype, bits in ((np.float32, np.uint32), (np.float64, np.uint64)):
            for count in (1, 5, 300):
                rng = np.random.default_rng((seed, count))  # the same stream on every rank
                inputs = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
                for r, x in enumerate(inputs):
                    x[::2] = -0.0 if r % 2 else 0.0
                    if count > 1:  # quiet NaNs whose payloads name their rank
                        x[1] = (np.array([0x7FC00001 + r], np.uint32) if dtype == np.float32
                                else np.array([0x7FF8000000000001 + r], np.uint64)).view(dtype)[0]
                for op in ("sum", "min", "max"):
                    short = engine.allreduce(inputs[comm.rank].copy(), op)
                    planned = engine.grouped_allreduce([inputs[comm.rank].copy()], op)[0]
                    checks += 1
                    if short.view(bits).tolist() != planned.view(bits).tolist():
                        failures.append(f"{lay} {np.dtype(dtype).name} {op} n={count}: the short route's bits differ")
                    if len(set(comm.allgather(short.tobytes()))) != 1:
                        failures.append(f"{lay} {np.dtype(dtype).name} {op} n={count}: ranks hold different bits")
        engine.close()
    return {"checks": checks, "failures": failures[:20]}


def case_half_average_near_the_top(comm: MPI.Comm, seed: int = 29) -> dict:
    """A float16 average whose sum overflows float16 but whose average does not
    (:func:`top_half_inputs`): every route, layout and piece size gives the average numpy computes
    from the float64 sum, bit for bit, never inf."""
    n, failures, checks = comm.size, [], 0
    for lay in layouts(n):
        for segment, oneshot, doubling in ((4096, 0, 0), (1 << 22, 0, 1 << 20), (4096, 1 << 18, None)):
            more = {} if doubling is None else {"doubling_max_bytes": doubling}
            engine = Engine(comm, load_engine_config(segment_bytes=segment, oneshot_max_bytes=oneshot,
                                                     **more, **lay))
            for count in (1, 7, 3000):
                inputs = top_half_inputs(count, n, seed)
                ref = reference(inputs, "average")
                for route in ("single", "batch"):
                    mine = inputs[comm.rank].copy()
                    if route == "single":
                        out = engine.allreduce(mine, "average")
                    else:  # fused with a float32 companion into one planned call
                        out = engine.allreduce_batch([mine, np.ones(5, np.float32)], "average")[0]
                    checks += 1
                    bad = bit_mismatches(out, ref)
                    if bad:
                        failures.append(f"{lay} seg={segment} oneshot={oneshot} doubling={doubling} n={count} {route}: "
                                        f"{bad} wrong, {int(np.isinf(out).sum())} inf")
            engine.close()
    return {"checks": checks, "failures": failures[:20]}


def case_ring_on_a_stream(comm: MPI.Comm, seed: int = 13) -> dict:
    """The ring and recursive doubling as the device path drives them with a CUDA-aware MPI: every
    reduction is queued, as a launch on a stream is, and runs only when ``sync`` is called, while MPI
    reads and writes the memory at once, and calls follow each other with no sync between them (one
    receive area for all, as the device path keeps one).  The ring's documented contract (``sync``
    before MPI reads what a reduction wrote, and before a receive reuses what one reads) must then
    still give numpy's sums, bit for bit, on every size, segment and path; a missing ``sync`` sends a
    stale partial or overwrites one a queued reduction has yet to read."""
    from tunelab.kernels import ReduceOp, get_backend

    from tunelab.engine.mpi_ring import RingAllreduce

    kernels = get_backend("cpu")
    queued: list[tuple] = []

    def reduce(out: int, srcs: np.ndarray, count: int, dtype: np.dtype, op: ReduceOp) -> None:
        queued.append((out, np.array(srcs, copy=True), count, dtype, op))

    def sync() -> None:
        while queued:
            kernels.reduce(*queued.pop(0))

    ring = RingAllreduce(comm, kernels)
    scratch = [np.empty(0, dtype=np.uint8)]

    def area(nbytes: int) -> int:  # one receive area for every call, as the device path keeps one
        if scratch[-1].size < nbytes:
            sync()  # (queued reductions may read the old one)
            scratch.append(np.empty(nbytes, dtype=np.uint8))
        return scratch[-1].ctypes.data

    n, dtype, runs = comm.size, np.dtype(np.float32), []
    for doubling in (0, 1 << 20):
        for count in (40_000, 1000, 5, 1):  # largest first: later calls reuse the area unsynced
            for segment in (64, 4096, 1 << 22):
                ring.doubling_max_bytes = doubling
                inputs = exact_inputs(count, dtype, n, seed + count)
                buf = inputs[comm.rank].copy()
                ring.run(buf.ctypes.data, count, dtype, ReduceOp.SUM, segment, reduce, area, sync)
                runs.append((f"doubling={doubling} count={count} segment={segment}", buf, inputs))
    sync()  # what runs on the stream after the calls sees their last reductions; nothing before
    failures = [f"{name}: {bit_mismatches(buf, reference(inputs, 'sum'))} wrong" for name, buf, inputs in runs
                if bit_mismatches(buf, reference(inputs, "sum"))]
    checks = len(runs)
    return {"checks": checks, "failures": failures[:20]}


def case_mismatch(comm: MPI.Comm, ranks_per_node: int | None = None) -> dict:
    """Ranks submit different shapes, dtypes or tensor counts: every rank must get
    RankMismatchError quickly, and the engine must keep working afterwards.  ``ranks_per_node``:
    emulated nodes, where a small call takes recursive doubling straight on its output; ``route``:
    between nodes, one rank's call small enough for that and the other's not (on one node both fit
    the one-shot limit, so it is one more shape mismatch there)."""
    engine = Engine(comm, load_engine_config(timeout_s=30, ranks_per_node=ranks_per_node))
    r, last = comm.rank, comm.size - 1
    calls = {
        "shape": lambda: engine.allreduce(np.ones(100 + (r == last), np.float32)),
        "dtype": lambda: engine.allreduce(np.ones(100, np.float64 if r == last else np.float32)),
        "count": lambda: engine.allreduce_batch([np.ones(3, np.float32)] * (1 + (r == last))),
        "op": lambda: engine.allreduce(np.ones(3, np.float32), "max" if r == last else "sum"),
        "route": lambda: engine.allreduce(np.ones(100 if r == last else 1 << 18, np.float32)),
        # Engine.set_knobs on the last rank alone: another fusion threshold (other buckets, the same
        # tensors), no one-shot (a small call takes the long route there), other pieces
        "fusion": lambda: _knobs_on(engine, r == last, lambda: engine.allreduce_batch(
            [np.ones(1000, np.float32), np.ones(3000, np.float32), np.ones(500, np.float32)]),
            fusion_threshold_bytes=4096),
        "oneshot": lambda: _knobs_on(engine, r == last, lambda: engine.allreduce(np.ones(100, np.float32)),
                                     oneshot_max_bytes=0, doubling_max_bytes=0),
        "segment": lambda: _knobs_on(engine, r == last, lambda: engine.allreduce(np.ones(1 << 18, np.float32)),
                                     segment_bytes=8192),
    }
    out = {}
    for kind, call in calls.items():
        t0 = time.monotonic()
        message = ""
        try:
            call()
        except RankMismatchError as exc:
            message = str(exc)
        after = engine.allreduce(np.full(10, r, np.int64))
        out[kind] = {"message": message, "elapsed_s": time.monotonic() - t0,
                     "recovered": bool((after == sum(range(comm.size))).all())}
    engine.close()
    return out


def _knobs_on(engine: Engine, changed: bool, call, **knobs: object) -> object:
    """``call()`` with ``knobs`` set on this rank first where ``changed``; the knobs of before afterwards."""
    before = engine.knobs
    if changed:
        engine.set_knobs(**knobs)
    try:
        return call()
    finally:
        engine.set_knobs(before)


def case_one_rank_invalid(comm: MPI.Comm, ranks_per_node: int | None = None) -> dict:
    """Only the last rank passes invalid arguments (an unknown op, a wrong output, a wrong number of
    outputs, small and large tensors): that rank gets its own error, every other rank a mismatch naming
    it, at the same call, and the next calls reduce the right data (a rank that raised before the
    call's agreement used to leave the others pairing this call with its next one)."""
    engine = Engine(comm, load_engine_config(timeout_s=30, ranks_per_node=ranks_per_node))
    r, last = comm.rank, comm.size - 1
    out = {}
    for size in (8, 1 << 18):
        calls = {
            "op": lambda size=size: engine.allreduce(np.ones(size, np.float32), "product" if r == last else "sum"),
            "out": lambda size=size: engine.allreduce(np.ones(size, np.float32),
                                                      out=np.empty(size, np.float64 if r == last else np.float32)),
            "outs": lambda size=size: engine.allreduce_batch(
                [np.ones(size, np.float32)] * 2, outs=[np.empty(size, np.float32) for _ in range(1 if r == last else 2)]),
            "order": lambda size=size: engine.allreduce(np.ones(size, ">f4" if r == last else np.float32)),
            # an object array (no view of the slots can be made for it: numpy raised before the agreement)
            "object": lambda size=size: engine.allreduce(np.ones(size, object if r == last else np.float32)),
            "alias": lambda size=size: _aliased(engine, size, r == last),
            # -1 once stood for "no group" in the agreed rows: the last rank's [-1, -1] passed the
            # agreement against [None, None] and was planned as one bucket where the others had two
            "group": lambda size=size: engine.allreduce_batch(
                [np.ones(size, np.float32), np.ones(size // 2, np.float32)], groups=[-1, -1] if r == last else None),
        }
        for kind, call in calls.items():
            t0 = time.monotonic()
            try:
                call()
                message = ""
            except (RankMismatchError, ValueError) as exc:
                message = f"{type(exc).__name__}: {exc}"
            after = [engine.allreduce(np.full(size, 10 * k + r, np.float32)) for k in (1, 2)]
            out[f"{kind}-{size}"] = {"message": message, "elapsed_s": time.monotonic() - t0,
                                     "after": [float(a[0]) for a in after]}
    engine.close()
    return out


def _aliased(engine: Engine, size: int, alias: bool) -> list:
    """A batch of two whose second output is the first input when ``alias`` (else memory of its own)."""
    x, y = np.ones(size, np.float32), np.ones(size, np.float32)
    return engine.allreduce_batch([x, y], outs=[np.empty_like(x), x if alias else np.empty_like(y)])


def case_bad_requests(comm: MPI.Comm) -> dict:
    """Invalid requests raise the same clear error on every rank, without hanging."""
    engine = Engine(comm, load_engine_config(timeout_s=30))
    errors = {}
    for label, call in (("average-int", lambda: engine.allreduce(np.ones(4, np.int32), "average")),
                        ("dtype", lambda: engine.allreduce(np.ones(4, np.complex64))),
                        ("op", lambda: engine.allreduce(np.ones(4, np.float32), "product"))):
        try:
            call()
            errors[label] = ""
        except (TypeError, ValueError) as exc:
            errors[label] = str(exc)
    big = 1 << 20  # (4 MiB of float32: past a segment, where the two-shot's pieces once overwrote inputs)
    x = np.ones(big, np.float32)
    views = [x[:big // 2], x[1:big // 2 + 1]]
    for label, call in (("byteorder", lambda: engine.allreduce(np.ones(big, ">f4"))),
                        ("alias", lambda: _aliased(engine, big, True)),
                        ("twice", lambda: engine.allreduce_batch([x, x], outs=[x, x])),
                        ("shifted", lambda: engine.allreduce(x[:big // 2], out=x[1:big // 2 + 1])),
                        # two views of one buffer, each in place, overlapping: each would overwrite the other
                        ("views_in_place", lambda: engine.allreduce_batch(views, outs=views))):
        try:
            call()
            errors[label] = ""
        except (TypeError, ValueError) as exc:
            errors[label] = str(exc)
    # a read-only output is refused where it is submitted, and the coordinator goes on
    from tunelab.engine.coordinator import Coordinator

    coordinator = Coordinator(engine)
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    for label, call in (("readonly_one", lambda: coordinator.submit_one("ro", frozen, "sum")),
                        ("readonly_group", lambda: coordinator.submit_group(["ro2"], [np.ones(4, np.float32)],
                                                                             "sum", outs=[frozen]))):
        try:
            call()
            errors[label] = ""
        except ValueError as exc:
            errors[label] = str(exc)
    errors["after_readonly"] = coordinator.submit("ok", np.full(4, comm.rank + 1.0, np.float32)).wait(20).tolist()
    coordinator.shutdown()
    try:
        Engine(comm, load_engine_config(ranks_per_node=comm.size + 1))
        errors["rpn"] = ""
    except TopologyError as exc:
        errors["rpn"] = str(exc)
    engine.close()
    return errors


def case_skipped_call(comm: MPI.Comm, timeout_s: float = 3.0) -> dict:
    """The last rank never calls allreduce: the others fail with a timeout instead of hanging."""
    engine = Engine(comm, load_engine_config(timeout_s=timeout_s))
    result = {"message": "", "elapsed_s": 0.0}
    if comm.rank != comm.size - 1:
        t0 = time.monotonic()
        try:
            engine.allreduce(np.ones(10, np.float32))
        except CollectiveTimeoutError as exc:
            result = {"message": str(exc), "elapsed_s": time.monotonic() - t0}
    else:
        time.sleep(timeout_s + 3)
    return result | {"abort": True}  # the stuck collective cannot be finished: end the job


def _fail_the_next_copy_out(engine: Engine) -> None:
    """The next call's first bucket fails on this rank alone at its copy-out (the pack is the host path's
    first copy, the copy-out its second), after the bucket's last node barrier."""
    copy, calls = engine._host.copy, []

    def failing_copy(rows):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected: the copy-out failed on rank 1")
        copy(rows)

    engine._host.copy = failing_copy


def case_late_engine(comm: MPI.Comm, timeout_s: float = 3.0) -> dict:
    """The last rank makes its engine only after the others' timeout: they fail at once, with a timeout
    naming the engine's setup, instead of waiting for it for ever; it fails as well, when it comes (the
    others have gone), and every rank's next engine sums."""
    t0 = time.monotonic()
    if comm.rank == comm.size - 1:
        time.sleep(timeout_s + 2)
    try:
        Engine(comm, load_engine_config(timeout_s=timeout_s))
        message = "no error"
    except CollectiveTimeoutError as exc:
        message = str(exc)
    elapsed = time.monotonic() - t0
    comm.Barrier()
    with Engine(comm, load_engine_config(timeout_s=timeout_s)) as engine:
        total = engine.allreduce(np.full(3, comm.rank + 1.0)).tolist()
    return {"message": message, "elapsed_s": elapsed, "total": total}


def case_error_on_one_rank_before_the_staging_grows(comm: MPI.Comm, timeout_s: float = 3.0) -> dict:
    """Rank 1's copy-out of a call's first bucket fails on that rank alone (a kernel's error): the others
    go on to the second bucket, whose staging is larger.  Growing it is collective over the node: they
    must fail with a timeout, not wait in the allocation for ever.  After its error each rank's engine
    refuses further calls, saying why (its node barrier and windows may be out of step with the peers');
    a new engine sums.  Then a knob change whose one-shot staging cannot be allocated (after the old
    window was freed) stops the engine too, where a small call would have used the freed slots."""
    from tunelab.engine import shm

    out: dict = {}
    config = load_engine_config(timeout_s=timeout_s, oneshot_max_bytes=0, fusion_threshold_bytes=4096,
                                segment_bytes=1 << 20)
    engine = Engine(comm, config)
    first, second = np.ones(256, np.float32), np.ones(1 << 16, np.float32)  # 1 KiB, then 256 KiB: two buckets
    engine.allreduce_batch([np.ones(8, np.float32)])  # (a first call: the staging is made at 256 bytes)
    if comm.rank == 1:
        _fail_the_next_copy_out(engine)
    t0 = time.monotonic()
    try:
        engine.allreduce_batch([first, second])
        out["call"] = "no error"
    except Exception as exc:  # noqa: BLE001 (the error's type and text are the finding)
        out["call"] = f"{type(exc).__name__}: {exc}"
    out["call_s"] = time.monotonic() - t0
    try:
        engine.allreduce(np.ones(4, np.float32))
        out["next"] = "no error"
    except TunelabError as exc:
        out["next"] = str(exc)
    engine.close()  # (frees nothing the peers must free too: they may be anywhere)
    comm.Barrier()
    engine = Engine(comm, load_engine_config(timeout_s=timeout_s))
    out["total"] = engine.allreduce_batch([first * (comm.rank + 1), second])[0][:3].tolist()
    small = np.full(4, comm.rank + 1.0, np.float32)
    out["small"] = engine.allreduce(small).tolist()  # (its views on the one-shot staging are cached)
    slots = engine._host.slots

    def failing_ensure(half_bytes):  # the old window freed, the new one refused
        shm.SharedArena.free(slots)
        raise MemoryError("injected: no shared memory for the one-shot staging")

    slots.ensure = failing_ensure
    try:
        engine.set_knobs(oneshot_max_bytes=4 << 20)  # (past the default 1 MiB: the slots grow)
        out["knobs"] = "no error"
    except MemoryError as exc:
        out["knobs"] = str(exc)
    try:
        out["after_knobs"] = engine.allreduce(small).tolist()
    except TunelabError as exc:
        out["after_knobs"] = str(exc)
    engine.close()
    return out


def case_close_after_an_error_on_one_rank(comm: MPI.Comm, timeout_s: float = 3.0) -> dict:
    """Rank 1's copy-out of a call's only bucket fails on that rank alone, after the call's last node
    barrier: its engine stops, the others' do not.  Closing must not leave the healthy ranks in the
    shared windows' frees, which wait for every rank of the node (the stopped rank once freed nothing):
    every rank closing, they agree and free.  Then the last rank closes its next engine only after the
    others' timeout: they give up and free nothing (no wait for ever), and so does it."""
    out: dict = {}
    engine = Engine(comm, load_engine_config(timeout_s=timeout_s, oneshot_max_bytes=0))
    data = np.ones(256, np.float32)
    engine.allreduce_batch([data])
    if comm.rank == 1:
        _fail_the_next_copy_out(engine)
    try:
        out["call"] = engine.allreduce_batch([data])[0][:2].tolist()
    except RuntimeError as exc:
        out["call"] = str(exc)
    t0 = time.monotonic()
    engine.close()
    out["close_s"], out["freed"] = time.monotonic() - t0, engine.topology.world == MPI.COMM_NULL
    engine = Engine(comm, load_engine_config(timeout_s=timeout_s))
    engine.allreduce(np.ones(4, np.float32))
    if comm.rank == comm.size - 1:
        time.sleep(timeout_s + 2)
    t0 = time.monotonic()
    engine.close()
    out["late_close_s"], out["late_freed"] = time.monotonic() - t0, engine.topology.world == MPI.COMM_NULL
    comm.Barrier()
    with Engine(comm, load_engine_config(timeout_s=timeout_s)) as engine:
        out["total"] = engine.allreduce(np.full(3, comm.rank + 1.0)).tolist()
    return out


def case_runtime_one_rank_fails(comm: MPI.Comm, timeout_s: float = 3.0) -> dict:
    """Rank 1's coordinator fails on that rank alone (applying a knob change runs out of memory); the
    others time out.  Every rank's shutdown must return, raising its own error, without anyone freeing
    the engine's windows (rank 1 freeing alone waited for the others there for ever); a new runtime
    then sums."""
    from tunelab import runtime

    rt = runtime.init(comm, timeout_s=timeout_s, cycle_time_ms=200.0)
    rt.coordinator.submit("warm", np.ones(2, np.float32)).wait(20)
    if comm.rank == 1:
        def broken(knobs):
            raise MemoryError("injected: out of memory applying the knobs")

        rt.engine.set_knobs = broken
    comm.Barrier()
    if comm.rank == 0:
        rt.coordinator.set_knobs(cycle_time_ms=150.0)
    t0 = time.monotonic()
    while rt.coordinator._error is None and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    t1 = time.monotonic()
    try:
        runtime.shutdown()
        said = "no error"
    except Exception as exc:  # noqa: BLE001 (the error's type is the finding)
        said = type(exc).__name__
    out = {"coordinator": type(rt.coordinator._error).__name__, "shutdown": said,
           "shutdown_s": time.monotonic() - t1, "closed": rt.engine._closed}
    out["again"] = _second_shutdown(rt)
    comm.Barrier()
    rt = runtime.init(comm, timeout_s=timeout_s)
    out["total"] = rt.coordinator.submit("after", np.full(3, comm.rank + 1.0, np.float32)).wait(20).tolist()
    runtime.shutdown()
    out["healthy_again"] = _second_shutdown(rt)
    return out


def _second_shutdown(rt) -> str:
    """A runtime object's shutdown called once more (a user's own exit path after ``runtime.shutdown()``)."""
    try:
        rt.shutdown()
        return "ok"
    except Exception as exc:  # noqa: BLE001 (the error is the finding)
        return f"{type(exc).__name__}: {exc}"


def case_ring_stall(comm: MPI.Comm, timeout_s: float = 3.0, doubling: bool = False) -> dict:
    """Nodes of one rank (the ring between nodes, or recursive doubling); the last rank stalls in the
    middle of the call, inside MPI's blocking transfers, which nothing can interrupt: the others' watchdog
    ends the job with one line after the timeout, instead of a wait for ever."""
    from tunelab.engine import mpi_ring

    engine = Engine(comm, load_engine_config(timeout_s=timeout_s, ranks_per_node=1,
                                             doubling_max_bytes=(1 << 20) if doubling else 0))
    out = _CASE_OUT[0]  # the watchdog's line, kept where the test reads results (stderr may be lost)
    mpi_ring.on_fatal(lambda line: Path(out, f"rank{comm.rank}.json").write_text(json.dumps({"line": line})))
    if comm.rank == comm.size - 1:
        name = "_butterfly" if doubling else "_reduce_step"
        step = getattr(mpi_ring.RingAllreduce, name)

        def stalled(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(timeout_s + 30)
            return step(self, *args, **kwargs)

        setattr(mpi_ring.RingAllreduce, name, stalled)
    engine.allreduce(np.ones(1 << 16, np.float32))  # 256 KiB: recursive doubling up to 1 MiB, else the ring
    return {}


def case_skipped_collectives(comm: MPI.Comm) -> dict:
    """The last rank skips a collective of the runtime (a broadcast, an allgather, a barrier) and goes
    on to shut down, or shuts down while the others are in join(): the others are told it left, naming
    the call (not a hang, and not the timeout they waited out before), every rank's join or shutdown
    still finishes, and the job ends cleanly."""
    from tunelab import runtime
    from tunelab.errors import RankExitedError

    out: dict = {}
    for kind in ("broadcast", "allgather", "barrier", "join"):
        rt = runtime.init(comm, timeout_s=3)
        t0 = time.monotonic()
        message = ""
        if comm.rank != comm.size - 1:
            try:
                if kind == "broadcast":
                    rt.broadcast_(np.ones(4, np.float32), 0, "weights")
                elif kind == "allgather":
                    rt.allgather_object({"rank": comm.rank})
                elif kind == "barrier":
                    rt.barrier()
                else:
                    rt.coordinator.join()
            except (CollectiveTimeoutError, RankExitedError) as exc:
                message = f"{type(exc).__name__}: {exc}"
        runtime.shutdown()
        out[kind] = {"message": message, "elapsed_s": time.monotonic() - t0}
    return out


def case_skipped_then_next(comm: MPI.Comm) -> dict:
    """The last rank skips one of the runtime's collectives and goes on with the next call the others
    make: no rank may take the other call's data for its own (rank 0's first broadcast paired with the
    last rank's second one gave the last rank rank 0's first tensor); every call either returns the
    right result or raises, and the engine's allreduce still works afterwards."""
    from tunelab import runtime
    from tunelab.errors import TunelabError

    last = comm.rank == comm.size - 1
    out: dict = {}
    for kind in ("broadcast", "allgather_object", "barrier"):
        rt = runtime.init(comm, timeout_s=3)
        calls = []

        def first(rt=rt, kind=kind) -> object:
            if kind == "broadcast":
                a = np.full(3, 7.0)
                rt.broadcast_(a, 0, "A")
                return a.tolist()
            if kind == "allgather_object":
                return rt.allgather_object({"A": comm.rank}, "A")
            return rt.barrier()

        def second(rt=rt) -> object:
            b = np.full(3, 1.0 if comm.rank == 0 else -1.0)
            rt.broadcast_(b, 0, "B")
            return b.tolist()

        for name, call in ([] if last else [("first", first)]) + [("second", second)]:
            try:
                calls.append((name, "ok", call()))
            except TunelabError as exc:
                calls.append((name, type(exc).__name__, str(exc)))
        comm.Barrier()  # (the ranks left the failed calls at different times: meet before the engine's check)
        after = rt.engine.allreduce(np.full(4, 1.0, np.float32))
        try:
            runtime.shutdown()
        except TunelabError:
            pass
        out[kind] = {"calls": calls, "after": after.tolist()}
    return out


def case_dead_rank(comm: MPI.Comm) -> dict:
    """The last rank dies mid-run: the launcher must end the job (non-zero) instead of hanging."""
    engine = Engine(comm, load_engine_config(timeout_s=20))
    engine.allreduce(np.ones(10, np.float32))
    if comm.rank == comm.size - 1:
        os._exit(17)
    for _ in range(1000):
        engine.allreduce(np.ones(1 << 16, np.float32))
    return {}


def case_coordinator_stall(comm: MPI.Comm, stall_s: float = 3.0) -> dict:
    """Rank 0 submits a tensor nobody else does: every rank's coordinator must fail with a StallError
    naming it and the missing ranks, soon after the stall timeout."""
    from tunelab.engine.coordinator import Coordinator
    from tunelab.errors import StallError

    engine = Engine(comm, load_engine_config(timeout_s=30))
    coord = Coordinator(engine, stall_timeout_s=stall_s)
    both = coord.submit("both", np.ones(4, np.float32))
    both.wait(20)
    t0 = time.monotonic()
    message = ""
    if comm.rank == 0:
        try:
            coord.submit("lonely", np.ones(4, np.float32)).wait(60)
        except StallError as exc:
            message = str(exc)
    else:
        while time.monotonic() - t0 < 60 and not message:
            try:
                coord.submit(f"probe{time.monotonic()}", np.ones(1, np.float32))
                time.sleep(0.2)
            except StallError as exc:
                message = str(exc)
            except Exception as exc:  # noqa: BLE001 (any other error is the finding, reported as such)
                message = f"{type(exc).__name__}: {exc}"
    return {"message": message, "elapsed_s": time.monotonic() - t0}


def case_coordinator_timeline(comm: MPI.Comm, path: str = "") -> dict:
    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config())
    coord = Coordinator(engine, timeline_path=path)
    for step in range(3):
        if comm.rank == 0:
            coord.set_knobs(fusion_threshold_bytes=1024 * (step + 1))
        hs = [coord.submit(f"t{i}", np.full(300, comm.rank, np.float32)) for i in range(4)]
        for h in hs:
            h.wait(20)
    coord.shutdown()
    engine.close()
    return {"changes": [[c, k.fusion_threshold_bytes] for c, k in coord.knob_changes]}


def case_runtime_unwritable_timeline(comm: MPI.Comm, folder: str) -> dict:
    """A timeline rank 0 alone cannot write (a folder that is no folder): init() fails on every rank at
    once, naming it, and an init() after it, without the timeline, sums."""
    from tunelab import runtime

    out: dict = {}
    bad = f"{folder}/a-file/timeline.json"
    try:
        runtime.init(comm, timeline=bad, timeout_s=20)
        out["error"] = ""
    except Exception as exc:  # noqa: BLE001 (the error is the finding)
        out["error"] = f"{type(exc).__name__}: {exc}"
    rt = runtime.init(comm, timeout_s=20)
    got = rt.coordinator.submit("after", np.full(5, comm.rank + 1.0, np.float32)).wait(20)
    out["after"] = np.unique(got).tolist()
    runtime.shutdown()
    return out


def case_coordinator_fuses_a_cycle(comm: MPI.Comm, cycle_ms: float = 40.0, bursts: int = 3,
                                   tensors: int = 8, gap_s: float = 0.002) -> dict:
    """Bursts of tensors submitted ``gap_s`` apart, with the submitting thread asleep in between (as a
    framework's backward pass releases the GIL between gradients), each after an idle pause: the
    engine calls each burst took, and whether every result is the sum over ranks."""
    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config(cycle_time_ms=cycle_ms))
    coord = Coordinator(engine)
    calls, wrong = [], 0
    for b in range(bursts):
        time.sleep(5 * cycle_ms / 1000.0)  # long enough for the coordinator to go idle
        before = engine._calls
        handles = []
        for i in range(tensors):
            handles.append(coord.submit(f"b{b}.t{i}", np.full(64 + i, comm.rank + i, np.float32)))
            time.sleep(gap_s)
        for i, h in enumerate(handles):
            want = sum(r + i for r in range(comm.size))
            wrong += int(np.count_nonzero(h.wait(30) != want))
        calls.append(engine._calls - before)
    # a blocking allreduce (submit, then wait at once) does not wait for the grid: the waiter hurries
    # the cycle (synchronize() after backward, SyncBatchNorm's and metrics' allreduces)
    blocking = []
    for k in range(6):
        t0 = time.perf_counter()
        got = coord.submit(f"blocking{k}", np.full(8, comm.rank + 1.0, np.float32)).wait(30)
        blocking.append(time.perf_counter() - t0)
        wrong += int(np.count_nonzero(got != comm.size * (comm.size + 1) / 2))
    # ranks that reach a blocking call at different times: the first to wait keeps its coordinator
    # cycling, so the call completes when the last rank submits, not a cycle after it
    staggered = []
    for k in range(3):
        comm.Barrier()
        if comm.rank == comm.size - 1 and comm.size > 1:
            time.sleep(0.010)
        t0 = time.perf_counter()
        coord.submit(f"staggered{k}", np.ones(8, np.float32)).wait(30)
        staggered.append(time.perf_counter() - t0)
    # every rank blocked on a tensor no other rank submitted: the waiters do not make the coordinators
    # cycle back to back (each negotiation finds nothing: they fall back to the cycle time)
    stuck_cycles = 0
    if comm.size > 1:
        comm.Barrier()
        before = coord.cycles
        try:
            coord.submit(f"lonely{comm.rank}", np.ones(4, np.float32)).wait(0.5)
        except TimeoutError:
            pass
        stuck_cycles = coord.cycles - before
        handles = [coord.submit(f"lonely{r}", np.ones(4, np.float32)) for r in range(comm.size) if r != comm.rank]
        for h in handles:
            h.wait(30)
    coord.shutdown()
    engine.close()
    return {"calls": calls, "wrong": wrong, "blocking_s": blocking, "staggered_s": staggered,
            "stuck_cycles": stuck_cycles}


def case_coordinator_stays_awake_through_a_backward_pass(comm: MPI.Comm, cycle_ms: float = 20.0) -> dict:
    """Tensors submitted 5 ms apart for 0.3 s (a backward pass's gradients, closer than a cycle), then a
    pause of 8 cycles, then one more: how often a submit had to wake an idle coordinator in each part,
    and whether every result is the sum over ranks."""
    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config(cycle_time_ms=cycle_ms))
    coord = Coordinator(engine)
    coord.submit("warm", np.ones(16, np.float32)).wait(60)  # (a first call compiles its kernels)
    comm.Barrier()
    time.sleep(8 * cycle_ms / 1000.0)  # idle before the pass begins
    wakes0, cycles0, handles = coord.wakes, coord.cycles, []
    for i in range(60):
        handles.append(coord.submit(f"g{i}", np.full(16, comm.rank + i, np.float32)))
        time.sleep(0.005)
    wakes_pass, cycles_pass = coord.wakes - wakes0, coord.cycles - cycles0
    time.sleep(8 * cycle_ms / 1000.0)  # the pass is over: the coordinator goes idle again
    before = coord.wakes
    handles.append(coord.submit("after", np.full(16, comm.rank + 60, np.float32)))
    time.sleep(0.005)
    wakes_after = coord.wakes - before
    wrong = 0
    for i, h in enumerate(handles):
        wrong += int(np.count_nonzero(h.wait(30) != sum(r + i for r in range(comm.size))))
    coord.shutdown()
    engine.close()
    return {"wakes_pass": wakes_pass, "cycles_pass": cycles_pass, "wakes_after": wakes_after, "wrong": wrong}


def case_coordinator_changed_call(comm: MPI.Comm) -> dict:
    """A name reused with another shape: reduced at its new shape when every rank changed it alike (a
    joined rank's zeros too), rejected on every rank with RankMismatchError when they disagree; and
    calls the engine cannot reduce, or that name a tensor twice, refused where they are submitted.
    After each, the coordinator must go on serving: every result is checked against the sum over ranks."""
    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config(timeout_s=20, cycle_time_ms=2.0))
    coord = Coordinator(engine, stall_timeout_s=15)
    n, rank, out = comm.size, comm.rank, {"wrong": 0}

    def checked(key: str, count: int) -> None:
        got = coord.submit("m", np.full(count, rank + 1.0, np.float32)).wait(20)
        want = np.full(count, n * (n + 1) / 2, np.float32)
        out[key] = list(got.shape)
        out["wrong"] += int(got.shape != want.shape or np.count_nonzero(got != want))

    checked("first", 4)
    checked("grown", 6)  # every rank changed the shape alike
    try:  # the ranks disagree on the new shape
        coord.submit("m", np.ones(5 + (rank % 2), np.float32)).wait(20)
        out["mismatch"] = "no error"
    except Exception as exc:  # noqa: BLE001 (the error's type and text are the finding)
        out["mismatch"] = f"{type(exc).__name__}: {exc}"
    checked("after_mismatch", 3)
    # ranks disagree on a group's size (the last passes one tensor fewer): every member fails on every
    # rank within the stall timeout's fraction, none is reduced alone, and the coordinator goes on
    t0 = time.monotonic()
    size = 3 if rank < n - 1 else 2
    handles = coord.submit_group([f"g.{i}" for i in range(size)], [np.ones(4, np.float32)] * size, group="g")
    errors = []
    for h in handles:
        try:
            h.wait(20)
            errors.append("no error")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
    out["group_size"], out["group_size_s"] = errors, time.monotonic() - t0
    checked("after_group", 2)
    # a joined rank contributes zeros of the shape the others submit now, not of the one cached
    if rank == n - 1 and n > 1:
        out["last"] = coord.join()
    else:
        got = coord.submit("m", np.full(7, rank + 1.0, np.float32)).wait(20)
        want = np.full(7, sum(range(1, n)) if n > 1 else 1, np.float32)
        out["joined_shape"] = list(got.shape)
        out["wrong"] += int(got.shape != want.shape or np.count_nonzero(got != want))
        coord.join()
    for key, call in (("int_average", lambda: coord.submit("i", np.ones(4, np.int32), "average")),
                      ("int8", lambda: coord.submit("i8", np.ones(4, np.int8))),
                      ("twice", lambda: coord.submit_group(["a", "a"], [np.ones(2, np.float32)] * 2))):
        try:
            call()
            out[key] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[key] = f"{type(exc).__name__}: {exc}"
    checked("after_refusals", 2)
    done = coord.submit("w", np.ones(2, np.float32))
    done.wait(20)
    out["wait0"] = float(done.wait(0)[0])  # a finished handle returns at once, whatever the timeout
    out["wait_inf"] = float(done.wait(float("inf"))[0])
    # names used once (unnamed calls) do not pile up in the cache: past its capacity the least recently
    # reduced half is forgotten, alike on every rank; a name reduced often keeps its place
    coord.cache_capacity = 8
    for k in range(30):
        handles = [coord.submit(f"once{k}", np.full(3, rank + 1.0, np.float32))]
        if k % 3 == 0:
            handles.append(coord.submit("often", np.full(2, rank + 1.0, np.float32)))
        for h in handles:
            got = h.wait(20)
            out["wrong"] += int(np.count_nonzero(got != n * (n + 1) / 2))
        out["largest_cache"] = max(out.get("largest_cache", 0), len(coord._names))
    out["often_kept"] = "often" in coord._ids  # (used two calls ago; the once-used names around it go)
    # more names in use each step than half the cache (a large model's gradients): the cache grows
    # rather than forgetting them and negotiating them again every step
    for _ in range(4):
        handles = [coord.submit(f"w{j}", np.full(2, rank + 1.0, np.float32)) for j in range(10)]
        for h in handles:
            out["wrong"] += int(np.count_nonzero(h.wait(20) != n * (n + 1) / 2))
    coord.shutdown()
    out["capacity"] = coord.cache_capacity
    out["names"] = list(coord._names)  # (read once the coordinator's thread has ended)
    engine.close()
    return out


def case_coordinator_shared_memory_and_requests(comm: MPI.Comm) -> dict:
    """Separate submits of one cycle that share memory (one engine call fuses them): a tensor in place
    twice, in place and out of place, outputs that are each other's inputs; each gives the sum over ranks
    of what it held when submitted (8 MiB each: the two-shot, which writes results while later pieces
    are still to be read).  Two knob requests before a cycle both apply; a cached group with one member
    changed on one rank only fails whole; a 0-d tensor stays 0-d; a second shutdown does nothing."""
    from tunelab.engine.coordinator import Coordinator

    n, rank = comm.size, comm.rank
    engine = Engine(comm, load_engine_config(timeout_s=20, cycle_time_ms=50.0))
    coord = Coordinator(engine, stall_timeout_s=10)
    out: dict = {}
    total = n * (n + 1) / 2  # every rank submits rank + 1
    count = 2_000_000
    comm.Barrier()
    x = np.full(count, rank + 1.0, np.float32)
    handles = [coord.submit_one("twice.a", x, "sum"), coord.submit_one("twice.b", x, "sum")]
    out["twice"] = [np.unique(h.wait(20)).tolist() for h in handles]
    comm.Barrier()
    t = np.full(count, rank + 1.0, np.float32)
    handles = [coord.submit_one("inplace", t, "sum"), coord.submit("copy", t)]
    out["in_and_out"] = [np.unique(h.wait(20)).tolist() for h in handles]
    comm.Barrier()
    buf = np.empty(2 * count, np.float32)
    p, q = buf[:count], buf[count:]
    p[:], q[:] = rank + 1.0, 100.0 * (rank + 1)
    handles = [coord.submit("p", p, out=q), coord.submit("q", q, out=p)]
    out["swapped"] = [np.unique(h.wait(20)).tolist() for h in handles]
    out["want"] = [total, 100 * total]
    comm.Barrier()
    # one tensor whose output overlaps its input out of place: refused where it is submitted (the
    # two-shot would write results over input it has still to read)
    buf = np.full(count + 1000, rank + 1.0, np.float32)
    try:
        coord.submit("shifted", buf[:count], out=buf[1000:]).wait(20)
        out["shifted"] = ""
    except ValueError as exc:
        out["shifted"] = str(exc)
    comm.Barrier()
    y = np.full(count, rank + 1.0, np.float32)  # in place with one op, out of place with another
    handles = [coord.submit_one("ops.sum", y, "sum"), coord.submit("ops.max", y, op="max")]
    out["two_ops"] = [np.unique(h.wait(20)).tolist() for h in handles]
    comm.Barrier()
    y = np.full(count, rank + 1.0, np.float32)  # the other way round (whichever op's call runs first)
    handles = [coord.submit_one("ops2.max", y, "max"), coord.submit("ops2.sum", y)]
    out["two_ops"] += [np.unique(h.wait(20)).tolist() for h in handles]
    comm.Barrier()
    if rank == 0:  # a profile's knobs, then the user's own change, before the next cycle
        coord.set_knobs(cycle_time_ms=5.0)
        coord.set_knobs(fusion_threshold_bytes=1 << 20)
    coord.submit("k", np.ones(4, np.float32)).wait(20)
    out["knobs"] = [engine.knobs.cycle_time_ms, engine.knobs.fusion_threshold_bytes]

    def group(count_b: int) -> list[str]:
        handles = coord.submit_group(["g.a", "g.b"], [np.ones(4, np.float32), np.ones(count_b, np.float32)],
                                     group="G")
        said = []
        for h in handles:
            try:
                said.append(str(h.wait(20).tolist()))
            except Exception as exc:  # noqa: BLE001 (the error's type is the finding)
                said.append(type(exc).__name__)
        return said

    out["group_first"] = group(4)
    comm.Barrier()
    out["group_changed"] = group(5 if rank == 0 else 4)  # b changed on rank 0 only
    got = coord.submit("scalar", np.array(rank + 1.0, np.float32)).wait(20)
    out["scalar"] = [list(got.shape), float(got)]
    coord.shutdown()
    try:
        coord.shutdown()
        out["second_shutdown"] = "ok"
    except Exception as exc:  # noqa: BLE001
        out["second_shutdown"] = f"{type(exc).__name__}: {exc}"
    engine.close()
    return out


def case_coordinator_peer_stops(comm: MPI.Comm, timeout_s: float = 3.0) -> dict:
    """Rank 1's coordinator fails between two exchanges of one cycle (applying a knob change raises,
    as an out-of-memory staging buffer would), while rank 0 has a new name to negotiate in that cycle:
    rank 0 must fail with a timeout, not block for ever in the exchange of names."""
    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config(timeout_s=timeout_s, cycle_time_ms=200.0))
    coord = Coordinator(engine, stall_timeout_s=60)
    coord.submit("warm", np.ones(2, np.float32)).wait(20)
    if comm.rank == 1:
        def broken(knobs):
            raise MemoryError("injected: out of memory applying the knobs")

        engine.set_knobs = broken
    comm.Barrier()
    t0 = time.monotonic()
    message = ""
    if comm.rank == 0:
        coord.set_knobs(cycle_time_ms=150.0)  # the change and the new name go in the same cycle
        try:
            coord.submit("new", np.ones(2, np.float32)).wait(30)
            message = "no error"
        except Exception as exc:  # noqa: BLE001 (the error's type and text are the finding)
            message = f"{type(exc).__name__}: {exc}"
    elif comm.rank == 1:
        while coord._error is None and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        message = f"{type(coord._error).__name__}: {coord._error}"
        time.sleep(timeout_s + 10)  # (rank 0 times out and ends the job first)
    return {"message": message, "elapsed_s": time.monotonic() - t0, "abort": True}


def case_shutdown_after_a_timeout(comm: MPI.Comm, timeout_s: float = 2.0, stuck_s: int = 8) -> dict:
    """Rank 1 is stuck in C holding the GIL (its coordinator cannot cycle); rank 0's wait times out and
    it shuts the runtime down, as its exit hook would: that must return, raising the timeout, rather
    than wait in the collective frees for a rank that is not coming."""
    import ctypes

    from tunelab import runtime

    rt = runtime.init(comm, timeout_s=timeout_s)
    rt.coordinator.submit("warm", np.ones(4, np.float32)).wait(20)
    comm.Barrier()
    if comm.rank == 1:
        ctypes.PyDLL(None).sleep(stuck_s)
        return {"abort": True}
    try:
        rt.coordinator.submit("x", np.ones(4, np.float32)).wait(60)
        waited = "no error"
    except Exception as exc:  # noqa: BLE001 (the error's type is the finding)
        waited = type(exc).__name__
    t0 = time.monotonic()
    try:
        runtime.shutdown()
        said = "no error"
    except Exception as exc:  # noqa: BLE001
        said = type(exc).__name__
    return {"waited": waited, "shutdown": said, "shutdown_s": time.monotonic() - t0, "abort": True}


def case_topology(comm: MPI.Comm) -> dict:
    out = {}
    for k in [None, *range(1, comm.size + 1)]:
        engine = Engine(comm, load_engine_config(ranks_per_node=k))
        t = engine.topology
        out[str(k)] = [t.local_rank, t.local_size, t.cross_rank, t.cross_size, list(t.node_sizes), t.host_rank]
        engine.close()
    return out


def case_init_twice(comm: MPI.Comm) -> dict:
    """A second init(): with no settings, or the same ones, it returns the running runtime; with other
    settings it is refused with the settings named (they were dropped without a word)."""
    from tunelab import runtime

    rt = runtime.init(comm, timeout_s=20.0, cycle_time_ms=5.0)
    out = {"same": runtime.init(comm) is rt and runtime.init(comm, timeout_s=20.0, cycle_time_ms=5.0) is rt}
    try:
        runtime.init(comm, timeout_s=30.0, cycle_time_ms=7.0)
        out["other"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["other"] = f"{type(exc).__name__}: {exc}"
    try:  # the same values, one knob now pinned: named too (it was "other knobs pinned")
        runtime.init(comm, timeout_s=20.0, cycle_time_ms=5.0, segment_bytes=rt.config.knobs.segment_bytes)
        out["pinned"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["pinned"] = f"{type(exc).__name__}: {exc}"
    out["sum"] = rt.coordinator.submit("x", np.full(2, comm.rank + 1.0, np.float32)).wait(20).tolist()
    runtime.shutdown()
    return out


def case_fingerprint(comm: MPI.Comm) -> dict:
    """This rank's own CPU affinity and the job's fingerprint (hash, usable cores) as a tuning job sees it."""
    from tunelab import runtime

    rt = runtime.init(comm)
    fp = rt.fingerprint()
    out = {"own": len(os.sched_getaffinity(0)), "hash": fp.hash, "usable": fp.facts.get("cpu_usable"),
           "host_cores": rt.topology.host_cores}
    runtime.shutdown()
    return out


def case_refused_knobs_allocate_nothing(comm: MPI.Comm, ranks_per_node: int = 3) -> dict:
    """An engine asked for hierarchical on unequal nodes fails with TopologyError on every rank, having
    allocated no shared memory and freed the communicators it split; an engine made next works."""
    import tunelab.engine.engine as engine_module

    made, topologies = [], []
    barrier, build = engine_module.NodeBarrier, engine_module.build_topology

    def counting_barrier(*a, **k):
        made.append(1)
        return barrier(*a, **k)

    def keeping_topology(*a, **k):
        topologies.append(build(*a, **k))
        return topologies[-1]

    engine_module.NodeBarrier, engine_module.build_topology = counting_barrier, keeping_topology
    try:
        Engine(comm, load_engine_config(ranks_per_node=ranks_per_node, hierarchical=True))
        error = ""
    except TopologyError as exc:
        error = str(exc)
    finally:
        engine_module.NodeBarrier, engine_module.build_topology = barrier, build
    freed = [c == MPI.COMM_NULL for t in topologies for c in (t.world, t.local, t.cross)]
    with Engine(comm, load_engine_config(ranks_per_node=ranks_per_node)) as engine:
        total = engine.allreduce(np.full(3, comm.rank + 1.0, np.float64)).tolist()
    return {"error": error, "barriers": len(made), "freed": freed, "total": total}


def case_settings_that_differ(comm: MPI.Comm) -> dict:
    """Rank 0 made with another fusion threshold (a TUNELAB_* variable set on one rank), then rank 1 with
    another node layout: every rank refuses, naming what differs; the same settings then work."""
    out: dict = {}
    for name, mine in (("knob", {"fusion_threshold_bytes": 0 if comm.rank == 0 else None}),
                       ("layout", {"ranks_per_node": 1 if comm.rank == 1 else None})):
        try:
            Engine(comm, load_engine_config(**mine))
            out[name] = ""
        except RankMismatchError as exc:
            out[name] = str(exc)
    with Engine(comm, load_engine_config()) as engine:
        out["total"] = engine.allreduce(np.full(3, comm.rank + 1.0, np.float64)).tolist()
    return out


def case_emulated_link(comm: MPI.Comm, gbps: float = 0.5, count: int = 1 << 20, seed: int = 7) -> dict:
    """Allreduce through an emulated link between 2-rank nodes: exact results, the bytes each rank
    took through its node's link, and how long the call took."""
    dtype = np.dtype(np.float32)
    inputs = exact_inputs(count, dtype, comm.size, seed)
    want = reference(inputs, "sum")
    out: dict = {"failures": []}
    for hierarchical in (False, True):
        cfg = load_engine_config(ranks_per_node=2, link_gbps=gbps, hierarchical=hierarchical,
                                 segment_bytes="1MiB")
        engine = Engine(comm, cfg)
        engine.allreduce(inputs[comm.rank], "sum")  # warm-up: kernels, plans, arena
        before = engine.link.bytes_through
        comm.Barrier()
        t0 = time.perf_counter()
        got = engine.allreduce(inputs[comm.rank], "sum")
        elapsed = time.perf_counter() - t0
        if bit_mismatches(got, want):
            out["failures"].append(f"hierarchical={hierarchical}: {bit_mismatches(got, want)} wrong")
        key = "hierarchical" if hierarchical else "flat"
        out[key] = {"bytes": engine.link.bytes_through - before, "elapsed_s": elapsed}
        engine.close()
    plain = Engine(comm, load_engine_config(ranks_per_node=2))
    out["unlinked"] = plain.link is None
    plain.close()
    return out


def case_device_path(comm: MPI.Comm, seed: int = 11, backend: str = "numba-cuda", lazy: bool = False,
                     multi_rank_nodes: bool = False) -> dict:
    """The device data path on ``backend``: every layout, through the engine and the coordinator,
    against numpy references.  Under Numba's CUDA simulator device memory is host memory; on a GPU
    the ranks share one device and map each other's staging segments through CUDA IPC.  ``lazy``
    (simulator): launches run as late as a GPU may run them (tests/lazy_streams.py), and results
    are read as a framework reads them, after its own stream.  ``multi_rank_nodes``: only the layouts of
    emulated nodes of two ranks or more (what four ranks add to three's)."""
    if backend == "cupy":
        import cupy

        upload, download = cupy.asarray, cupy.asnumpy
    else:
        from numba import cuda

        upload, download = cuda.to_device, lambda a: a.copy_to_host()
    if lazy:
        from lazy_streams import LazyStreams
        from tunelab.kernels import get_backend, register_backend

        streams = LazyStreams(get_backend(backend))
        register_backend(backend, streams)
        copy_out = download

        def download(a):
            streams.stream_sync(0)  # the producer's stream: the simulator's "current stream"
            return copy_out(a)
    from tunelab.engine.coordinator import Coordinator

    out: dict = {"failures": [], "checks": 0, "direct": []}
    counts = (1, 7, 300, 2500)  # fused: several 4 KiB pipeline pieces
    chosen = [lay for lay in layouts(comm.size) if not multi_rank_nodes or (lay["ranks_per_node"] or 0) >= 2]
    for lay, oneshot in [(lay, oneshot) for lay in chosen for oneshot in (0, 1 << 18)]:
        # without one-shot, buffers between nodes go round the ring too (not only recursive doubling)
        engine = Engine(comm, load_engine_config(backend=backend, segment_bytes=4096, oneshot_max_bytes=oneshot,
                                                 doubling_max_bytes=oneshot and 32 << 10, **lay))
        tiny = exact_inputs(3, np.dtype(np.float32), comm.size, seed)  # small staging first: it must grow
        out["checks"] += 1
        if bit_mismatches(download(engine.allreduce(upload(tiny[comm.rank]), "sum")), reference(tiny, "sum")):
            out["failures"].append(f"{lay} tiny: wrong")
        for dtype_name, op in (("float32", "sum"), ("float16", "average"), ("int32", "max")):
            dtype = dtype_from_name(dtype_name)
            inputs = [exact_inputs(c, dtype, comm.size, seed + c) for c in counts]
            got = engine.allreduce_batch([upload(x[comm.rank]) for x in inputs], op)
            for c, g, x in zip(counts, got, inputs):
                out["checks"] += 1
                host = download(g).view(dtype)
                if bit_mismatches(host, reference(x, op)):
                    out["failures"].append(f"{lay} oneshot={oneshot} {dtype_name} {op} count={c}: "
                                           f"{bit_mismatches(host, reference(x, op))} wrong")
        top = [top_half_inputs(c, comm.size, seed) for c in counts]  # sums past float16's range
        got = engine.allreduce_batch([upload(x[comm.rank]) for x in top], "average")
        for c, g, x in zip(counts, got, top):
            out["checks"] += 1
            wrong = bit_mismatches(download(g).view(np.float16), reference(x, "average"))
            if wrong:
                out["failures"].append(f"{lay} oneshot={oneshot} float16 average near 65504 count={c}: {wrong} wrong")
        if engine.topology.num_nodes > 1 and oneshot:
            out["direct"].append(engine.direct_device_mpi)
        # In place, through the coordinator, as a framework adapter submits gradients.
        coord = Coordinator(engine)
        x = exact_inputs(513, np.dtype(np.float32), comm.size, seed)
        dev = upload(x[comm.rank])
        coord.submit("grad.w", dev, "sum", out=dev).wait(timeout=120)
        out["checks"] += 1
        if bit_mismatches(download(dev), reference(x, "sum")):
            out["failures"].append(f"{lay} coordinator in-place: wrong")
        # ...and through the single-tensor submit a gradient hook uses, an average
        x = exact_inputs(700, np.dtype(np.float32), comm.size, seed + 3)
        dev = upload(x[comm.rank])
        coord.submit_one("grad.v", dev, "average").wait(timeout=120)
        out["checks"] += 1
        if bit_mismatches(download(dev), reference(x, "average")):
            out["failures"].append(f"{lay} coordinator submit_one: wrong")
        coord.shutdown()
        if engine.topology.num_nodes == 1 and not oneshot:  # staging grown between calls, nothing read between
            steps = [({"oneshot_max_bytes": 1 << 10}, 40),   # one-shot: its last launch reads peers' slots
                     ({"oneshot_max_bytes": 1 << 16}, 9000),  # the slots grow: freed and mapped anew
                     ({"oneshot_max_bytes": 0}, 3000),        # two-shot in 4 KiB pieces: the last reads peers' segments
                     ({"segment_bytes": 1 << 16}, 30000)]     # the segments grow
            x = [exact_inputs(c, np.dtype(np.float32), comm.size, seed + 2 + c) for _, c in steps]
            got = []
            for (knobs, _), xi in zip(steps, x):
                engine.set_knobs(**knobs)
                got.append(engine.allreduce(upload(xi[comm.rank]), "sum"))
            for (knobs, _), g, xi in zip(steps, got, x):
                out["checks"] += 1
                if bit_mismatches(download(g), reference(xi, "sum")):
                    out["failures"].append(f"{lay} staging grown between calls, after {knobs}: wrong")
        engine.close()
    if lazy:
        out["deferred"] = streams.deferred  # launches the lazy back end held back (0: it was not in play)
    # Host and device tensors in one call each take their own path; results keep their side.
    engine = Engine(comm, load_engine_config(backend=backend, segment_bytes=4096))
    x = [exact_inputs(c, np.dtype(np.float32), comm.size, seed + 1 + c) for c in (5, 600, 40)]
    mixed = [x[0][comm.rank], upload(x[1][comm.rank]), x[2][comm.rank]]
    got = engine.allreduce_batch(mixed, "sum")
    out["mixed_kinds"] = [type(g).__name__ == "ndarray" for g in got]
    for i, (g, xi) in enumerate(zip(got, x)):
        out["checks"] += 1
        host = g if isinstance(g, np.ndarray) else download(g)
        if bit_mismatches(host, reference(xi, "sum")):
            out["failures"].append(f"mixed call, tensor {i}: wrong")
    # A rank that passes host memory where the others pass device memory: one clear error.
    y = np.ones(8, np.float32)
    try:
        engine.allreduce(y if comm.rank == 0 else upload(y), "sum")
        out["kind_mismatch"] = ""
    except RankMismatchError as exc:
        out["kind_mismatch"] = str(exc)
    engine.close()
    refusing = Engine(comm, load_engine_config(backend="cpu"))  # no GPU kernels: device tensors refused
    try:
        refusing.allreduce(upload(y), "sum")
        out["cpu_refuses"] = ""
    except TunelabError as exc:
        out["cpu_refuses"] = str(exc)
    refusing.close()
    return out


def case_device_marks(comm: MPI.Comm, seed: int = 17) -> dict:
    """Gradients submitted through the coordinator while the framework keeps queuing work, with launches
    run as late as a GPU may (tests/lazy_streams.py): the "backward" launch that writes a gradient is
    queued on the producer's stream before its submit, more work after it.  Every result is numpy's
    (the call waited for what wrote its input), and the work queued after the last submit has not run
    when the call is done (the call did not wait for it; work between submits may run: a fused call
    starts when its last member is ready).  That last is checked on rank 0, which submits 0.3 s before
    the others, so its call cannot start before its later work is queued."""
    from lazy_streams import LazyStreams
    from numba import cuda
    from tunelab.kernels import get_backend, register_backend

    from tunelab.engine.coordinator import Coordinator
    from tunelab.engine.device import device_buffer

    streams = LazyStreams(get_backend("numba-cuda"))
    register_backend("numba-cuda", streams)
    engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096))
    engine.allreduce(cuda.to_device(np.ones(4, np.float32)), "sum")  # the first device call makes the path
    streams.stream_sync(0)
    coord = Coordinator(engine)
    addr = lambda a: device_buffer(a).addr
    marker = cuda.to_device(np.full(4, 7.0, np.float32))
    inputs = [exact_inputs(c, np.dtype(np.float32), comm.size, seed + c) for c in (5, 300, 2000)]
    if comm.rank:
        time.sleep(0.3)
    grads, later, handles = [], [], []
    for i, x in enumerate(inputs):
        values = cuda.to_device(x[comm.rank])
        grad = cuda.to_device(np.zeros_like(x[comm.rank]))
        streams.copy_table(np.array([[addr(values), addr(grad), values.nbytes]], np.int64), stream=0)  # backward
        handles.append(coord.submit(f"grad.{i}", grad, "sum", out=grad))
        after = cuda.to_device(np.zeros(4, np.float32))
        streams.copy_table(np.array([[addr(marker), addr(after), 16]], np.int64), stream=0)  # backward goes on
        grads.append((grad, values))
        later.append(after)
    for h in handles:
        h.wait(timeout=120)
    not_run = [bool((a.copy_to_host() == 0).all()) for a in later]  # read as is: nothing waited for
    streams.stream_sync(0)  # the framework's next reads: after its stream
    failures = [f"grad.{i}: {bit_mismatches(g.copy_to_host(), reference(x, 'sum'))} wrong"
                for i, ((g, _), x) in enumerate(zip(grads, inputs))
                if bit_mismatches(g.copy_to_host(), reference(x, "sum"))]
    coord.shutdown()
    engine.close()
    return {"failures": failures, "later_not_run": not_run}


def case_device_mark_waits(comm: MPI.Comm, seed: int = 19) -> dict:
    """Six gradients written one after another, four on the default stream and one on a side stream
    from this thread, one on the default stream from another thread, each marked where it is
    submitted, then reduced in one fused call: the engine's stream waits on the last mark of each
    producer stream of each thread only (events on one stream complete in recording order; a
    default-stream handle may name a per-thread stream), so the call makes five stream waits (three in
    begin, two in end ordering both streams after the results) instead of one per gradient, and
    every result is numpy's with launches run as late as a GPU may (the last mark covers the writes
    before the earlier ones)."""
    from lazy_streams import LazyStreams
    from numba import cuda
    from tunelab.kernels import get_backend, register_backend

    from tunelab.engine import device as device_module
    from tunelab.engine.device import device_buffer

    streams = LazyStreams(get_backend("numba-cuda"))
    counting = CountingBackend(streams)
    register_backend("numba-cuda", counting)
    engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096, oneshot_max_bytes=1 << 18))
    engine.allreduce(cuda.to_device(np.ones(4, np.float32)), "sum")  # the first device call makes the path
    streams.stream_sync(0)
    current = {"handle": 0}
    device_module.producer_stream_handle = lambda owner: current["handle"]
    side = streams.external_stream(0x51DE)
    inputs = [exact_inputs(c, np.dtype(np.float32), comm.size, seed + c) for c in (5, 60, 300, 7, 1000)]
    grads, bufs = [], []
    for i, x in enumerate(inputs):
        on_side = i == 2
        current["handle"] = 0x51DE if on_side else 0
        values = cuda.to_device(x[comm.rank])
        grad = cuda.to_device(np.zeros_like(x[comm.rank]))
        table = np.array([[device_buffer(values).addr, device_buffer(grad).addr, values.nbytes]], np.int64)
        streams.copy_table(table, stream=side if on_side else 0)  # backward writes the gradient
        bufs.append(engine.mark_ready(device_buffer(grad)))
        grads.append((grad, values))
    # a sixth, marked from another thread on the same handle: a default-stream handle may name that
    # thread's own stream (per-thread default streams), so its mark is waited on too
    import threading

    x = exact_inputs(40, np.dtype(np.float32), comm.size, seed + 40)
    values, grad = cuda.to_device(x[comm.rank]), cuda.to_device(np.zeros_like(x[comm.rank]))
    table = np.array([[device_buffer(values).addr, device_buffer(grad).addr, values.nbytes]], np.int64)

    def submit_elsewhere() -> None:
        streams.copy_table(table, stream=0)
        bufs.append(engine.mark_ready(device_buffer(grad)))

    worker = threading.Thread(target=submit_elsewhere)
    worker.start()
    worker.join()
    inputs.append(x)
    grads.append((grad, values))
    current["handle"] = 0
    counting.counts.clear()
    engine.allreduce_batch(bufs, "sum", outs=bufs)
    waits = counting.counts["wait_event"]
    streams.stream_sync(0)
    streams.stream_sync(side)
    failures = [f"grad.{i}: {bit_mismatches(g.copy_to_host(), reference(x, 'sum'))} wrong"
                for i, ((g, _), x) in enumerate(zip(grads, inputs))
                if bit_mismatches(g.copy_to_host(), reference(x, "sum"))]
    engine.close()
    return {"failures": failures, "waits": waits, "marked": sum(b.ready is not None and b.ready[0] is not None
                                                                for b in bufs)}


def case_device_side_stream(comm: MPI.Comm, seed: int = 23) -> dict:
    """The framework works on a side stream (``with torch.cuda.stream(s):``): gradients are written there
    and submitted from the main thread, whose current stream is that side stream, while the
    coordinator's thread sees the default stream.  The first call is submitted before the device path
    exists (so unmarked), the second is marked.  Each call must wait for the side stream's write and
    order the side stream after its results: the framework then synchronises only its side stream and
    reads.  Launches run as late as a GPU may (tests/lazy_streams.py)."""
    import threading

    from lazy_streams import LazyStreams
    from numba import cuda
    from tunelab.kernels import get_backend, register_backend

    from tunelab.engine import device as device_module
    from tunelab.engine.coordinator import Coordinator
    from tunelab.engine.device import device_buffer

    streams = LazyStreams(get_backend("numba-cuda"))
    register_backend("numba-cuda", streams)
    handle, main = 0x5EED, threading.main_thread()
    device_module.producer_stream_handle = lambda owner: handle if threading.current_thread() is main else 0
    side = streams.external_stream(handle)
    engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096))
    coord = Coordinator(engine)
    failures = []
    for call in range(2):
        x = exact_inputs(700 + call, np.dtype(np.float32), comm.size, seed + call)
        values = cuda.to_device(x[comm.rank])
        grad = cuda.to_device(np.zeros_like(x[comm.rank]))
        table = np.array([[device_buffer(values).addr, device_buffer(grad).addr, values.nbytes]], np.int64)
        streams.copy_table(table, stream=side)  # backward writes the gradient on the side stream
        coord.submit(f"side.{call}", grad, "sum", out=grad).wait(timeout=120)
        streams.stream_sync(side)  # the framework's next reads: after its side stream only
        wrong = bit_mismatches(grad.copy_to_host(), reference(x, "sum"))
        if wrong:
            failures.append(f"call {call}: {wrong} wrong")
    coord.shutdown()
    engine.close()
    return {"failures": failures}

def case_device_back_to_back(comm: MPI.Comm, calls: int = 6) -> dict:
    """Direct one-shot device allreduces back to back, nothing read on the host between them, with
    launches run as late as a GPU may (tests/lazy_streams.py) and rank 1's GPU behind the others (its
    stream waits take 0.3 s longer to return).  A barrier only proves a peer has queued its reduce, so
    a rank must not refill the slot half a peer's queued reduce of the previous call still reads: with
    the half picked by the node barrier's parity (two barriers a call: the agreement and the ordering
    point), every call took the same half and rank 1 summed rank 0's next input."""
    import time as _time

    from lazy_streams import LazyStreams
    from numba import cuda
    from tunelab.kernels import get_backend, register_backend

    streams = LazyStreams(get_backend("numba-cuda"))
    if comm.rank == 1:
        inner_sync = streams.stream_sync

        def slow_sync(stream):
            _time.sleep(0.3)
            return inner_sync(stream)

        streams.stream_sync = slow_sync
    register_backend("numba-cuda", streams)
    engine = Engine(comm, load_engine_config(backend="numba-cuda", oneshot_max_bytes=1 << 16))
    inputs = [exact_inputs(64, np.dtype(np.float32), comm.size, 23 + i) for i in range(calls)]
    got = [engine.allreduce(cuda.to_device(x[comm.rank]), "sum") for x in inputs]
    streams.stream_sync(0)  # the framework reads after its own stream
    failures = [f"call {i}: {bit_mismatches(g.copy_to_host(), reference(x, 'sum'))} of 64 wrong"
                for i, (g, x) in enumerate(zip(got, inputs)) if bit_mismatches(g.copy_to_host(), reference(x, "sum"))]
    deferred = streams.deferred
    engine.close()
    return {"failures": failures, "deferred": deferred}


def _two_more_sums(comm: MPI.Comm, engine: Engine, x) -> list[str]:
    """After a failed first call: two more sums of ``x`` (every rank's ``rank + 1``), checked."""
    got = [engine.allreduce(x, op="sum").copy_to_host() for _ in range(2)]
    want = np.full(8, comm.size * (comm.size + 1) / 2, np.float32)
    return [f"call {i}: {bit_mismatches(g, want)} wrong" for i, g in enumerate(got) if bit_mismatches(g, want)]


def case_device_setup_retry(comm: MPI.Comm) -> dict:
    """The device path's first setup fails on every rank (its one-shot staging: out of device memory,
    injected); the call raises, and the next call sets the path up again and gives the sum over ranks."""
    from numba import cuda

    from tunelab.engine import device_path as dp

    engine = Engine(comm, load_engine_config(backend="numba-cuda", timeout_s=30))
    real, calls = dp.DevicePath.ensure_slots, []

    def flaky(self, nbytes):
        calls.append(nbytes)
        if len(calls) == 1:
            raise MemoryError("out of device memory (injected)")
        return real(self, nbytes)

    dp.DevicePath.ensure_slots = flaky
    x = cuda.to_device(np.full(8, comm.rank + 1.0, np.float32))
    out = {"failures": []}
    try:
        engine.allreduce(x)
        out["first"] = "no error"
    except MemoryError as exc:
        out["first"] = str(exc)
    out["failures"] = _two_more_sums(comm, engine, x)
    engine.close()
    return out


def case_device_per_thread_stream(comm: MPI.Comm) -> dict:
    """A device tensor submitted from a thread whose producer stream is the per-thread default stream
    (handle 2, injected): refused at its submit with one line, before the device path exists and after,
    and the next submits sum."""
    from numba import cuda

    from tunelab.engine import device
    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config(backend="numba-cuda", timeout_s=30))
    coord = Coordinator(engine)
    real = device.producer_stream_handle
    out: dict = {"refused": [], "sums": [], "failures": []}
    for k in range(2):
        device.producer_stream_handle = lambda owner: device.PER_THREAD_STREAM
        try:
            coord.submit(f"t{k}", cuda.to_device(np.ones(4, np.float32)))
            out["refused"].append("no error")
        except Exception as exc:  # noqa: BLE001 - the error is the result
            out["refused"].append(f"{type(exc).__name__}: {exc}")
        finally:
            device.producer_stream_handle = real
        x = cuda.to_device(np.full(4, comm.rank + 1.0, np.float32))
        out["sums"].append(coord.submit(f"u{k}", x).wait(60).copy_to_host().tolist())
    coord.shutdown()
    engine.close()
    return out


def case_device_slots_cannot_grow(comm: MPI.Comm) -> dict:
    """A knob change whose larger device one-shot staging cannot be allocated (out of device memory,
    injected on every rank) after the old staging was freed: the engine stops, so later calls are
    refused with one line instead of reading staging that is gone, and a new engine sums."""
    from numba import cuda

    from tunelab.engine import device_ipc

    engine = Engine(comm, load_engine_config(backend="numba-cuda", timeout_s=30))
    x = cuda.to_device(np.full(8, comm.rank + 1.0, np.float32))
    out: dict = {"failures": _two_more_sums(comm, engine, x)}
    real = device_ipc._SimulatedIpc.allocate

    def out_of_memory(self, nbytes):
        raise MemoryError("out of device memory (injected)")

    device_ipc._SimulatedIpc.allocate = out_of_memory
    try:
        engine.set_knobs(oneshot_max_bytes=8 << 20)
        out["knobs"] = "no error"
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        out["knobs"] = f"{type(exc).__name__}: {exc}"
    finally:
        device_ipc._SimulatedIpc.allocate = real
    try:
        engine.allreduce(x)
        out["after"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["after"] = f"{type(exc).__name__}: {exc}"
    engine.close()
    engine = Engine(comm, load_engine_config(backend="numba-cuda", timeout_s=30))
    out["failures"] += _two_more_sums(comm, engine, x)
    engine.close()
    return out


def case_device_setup_fails_on_one_rank(comm: MPI.Comm) -> dict:
    """The device path's setup fails on the last rank alone (its stream cannot be made: injected), as a
    rank's own device, driver or memory can: every rank raises at once, that rank its own error and the
    others one that names it, rather than the others waiting in the setup's next exchange; the next
    call sets the path up again on every rank and gives the sum."""
    import time

    from numba import cuda
    from tunelab.kernels import get_backend

    kernels = get_backend("numba-cuda")
    engine = Engine(comm, load_engine_config(backend="numba-cuda", timeout_s=60))
    real, calls = kernels.new_stream, []

    def flaky():
        calls.append(1)
        if comm.rank == comm.size - 1 and len(calls) == 1:
            raise RuntimeError("no stream on this GPU (injected)")
        return real()

    kernels.new_stream = flaky
    x = cuda.to_device(np.full(8, comm.rank + 1.0, np.float32))
    out: dict = {"failures": []}
    start = time.monotonic()
    try:
        engine.allreduce(x, op="sum")
        out["first"] = "no error"
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        out["first"] = f"{type(exc).__name__}: {exc}"
    out["first_s"] = time.monotonic() - start
    kernels.new_stream = real
    out["failures"] = _two_more_sums(comm, engine, x)
    engine.close()
    return out


def case_device_without_ipc(comm: MPI.Comm, seed: int = 31) -> dict:
    """A node whose GPUs cannot map each other's memory (MIG instances, no peer access; injected: the
    last local rank cannot open a peer's handle): every rank learns it at the device path's setup,
    every node then stages device buckets through host memory, rank 0 says so once, and results are
    numpy's, bit for bit, through the engine, the coordinator and a live knob change."""
    import warnings

    from numba import cuda

    from tunelab.engine import device_ipc
    from tunelab.engine.coordinator import Coordinator

    real_open = device_ipc._SimulatedIpc.open

    def open_(self, handle):
        if self._rank == self._arena.local.size - 1:
            raise OSError("peer access is not supported between these devices (injected)")
        return real_open(self, handle)

    device_ipc._SimulatedIpc.open = open_
    out: dict = {"failures": [], "checks": 0, "staged": [], "warned": []}
    chosen = [lay for lay in layouts(comm.size) if (lay["ranks_per_node"] or comm.size) >= 2]
    for lay, oneshot in [(lay, oneshot) for lay in chosen for oneshot in (0, 1 << 18)]:
        engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096,
                                                 oneshot_max_bytes=oneshot, **lay))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for dtype_name, op in (("float32", "sum"), ("float16", "average"), ("bfloat16", "average"),
                                   ("int32", "max")):
                dtype = dtype_from_name(dtype_name)
                inputs = [exact_inputs(c, dtype, comm.size, seed + c) for c in (1, 7, 300, 2500)]
                got = engine.allreduce_batch([cuda.to_device(x[comm.rank].view(np.uint16) if dtype_name == "bfloat16"
                                                             else x[comm.rank]) for x in inputs], op)
                for c, g, x in zip((1, 7, 300, 2500), got, inputs):
                    out["checks"] += 1
                    wrong = bit_mismatches(g.copy_to_host().view(dtype), reference(x, op))
                    if wrong:
                        out["failures"].append(f"{lay} oneshot={oneshot} {dtype_name} {op} count={c}: {wrong} wrong")
        out["warned"].append([str(w.message) for w in caught if "staged through host memory" in str(w.message)])
        out["staged"].append(engine._device.host_staged)
        # a live knob change and the coordinator's in-place submits, as a training step makes them
        engine.set_knobs(oneshot_max_bytes=1 << 19)
        coord = Coordinator(engine)
        x = exact_inputs(513, np.dtype(np.float32), comm.size, seed)
        dev = cuda.to_device(x[comm.rank])
        coord.submit("grad.w", dev, "average", out=dev).wait(timeout=120)
        out["checks"] += 1
        if bit_mismatches(dev.copy_to_host(), reference(x, "average")):
            out["failures"].append(f"{lay} oneshot={oneshot} coordinator: wrong")
        coord.shutdown()
        engine.close()
    # ranks that share one GPU: the leader would map its peers' tensors through CUDA IPC as well, so
    # staging through the host leaves that protocol too (shareable memory, and every call staged)
    import os

    from tunelab.engine.device_share import sim_device_array

    os.environ["TUNELAB_SHARED_GPU"] = "leader"
    engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096))
    x = exact_inputs(700, np.dtype(np.float32), comm.size, seed + 1)
    got = engine.allreduce(sim_device_array(x[comm.rank]), "sum")
    out["checks"] += 1
    if bit_mismatches(got.copy_to_host(), reference(x, "sum")):
        out["failures"].append("shared GPU: wrong")
    out["shared_left"] = engine._device.shared is None and engine._device.host_staged is not None
    engine.close()
    del os.environ["TUNELAB_SHARED_GPU"]
    device_ipc._SimulatedIpc.open = real_open
    return out


def case_device_events_not_shared(comm: MPI.Comm, seed: int = 37) -> dict:
    """The ordering chosen by default (interprocess events) cannot be set up on one rank (its event:
    injected on the last rank): every rank learns it in the same exchange and orders by stream syncs
    instead, the node's first rank says so once, and results are numpy's.  Asked for explicitly
    (``TUNELAB_DEVICE_ORDERING=ipc-events``), the same failure is an error on every rank."""
    import os
    import warnings

    from numba import cuda
    from tunelab.kernels import get_backend

    from tunelab.engine import device_path

    kernels = get_backend("numba-cuda")
    real_new_event, real_init = kernels.new_event, device_path.IpcEventOrdering.__init__
    making = []

    def new_event(*a, **k):
        if making and comm.rank == comm.size - 1:
            raise RuntimeError("no interprocess event on this GPU (injected)")
        return real_new_event(*a, **k)

    def init(self, *a, **k):
        making.append(1)
        try:
            real_init(self, *a, **k)
        finally:
            making.clear()

    kernels.new_event, device_path.IpcEventOrdering.__init__ = new_event, init
    out: dict = {"failures": [], "checks": 0}
    for ordering in ("auto", "ipc-events"):
        os.environ["TUNELAB_DEVICE_ORDERING"] = ordering
        engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096))
        x = exact_inputs(3000, np.dtype(np.float32), comm.size, seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got = engine.allreduce(cuda.to_device(x[comm.rank]), "sum").copy_to_host()
                out["checks"] += 1
                if bit_mismatches(got, reference(x, "sum")):
                    out["failures"].append(f"{ordering}: wrong")
                out[ordering] = engine._device.ordering.name
            except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
                out[ordering] = f"{type(exc).__name__}: {exc}"
        out[ordering + "_warned"] = [str(w.message) for w in caught if "interprocess CUDA events" in str(w.message)]
        engine.close()
    kernels.new_event, device_path.IpcEventOrdering.__init__ = real_new_event, real_init
    return out


def case_device_join(comm: MPI.Comm, seed: int = 29) -> dict:
    """Join with device tensors (simulator): every rank submits two device gradients once; then the
    last rank joins while the others run two more rounds of the same names, and joins after them.  The
    joined rank's share is zeros, so each result is the sum of the active ranks' inputs (numpy's), and
    ``join`` returns the last rank to join (the highest of those joining at the same cycle) on every rank."""
    from numba import cuda

    from tunelab.engine.coordinator import Coordinator

    engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096))
    made = []
    real_zeros = engine.device_zeros
    engine.device_zeros = lambda shape, dtype: made.append(shape) or real_zeros(shape, dtype)
    coord = Coordinator(engine)
    last = comm.size - 1
    counts = (7, 3000, 5)  # a one-shot bucket and a two-shot one; and bfloat16 (its zeros are uint16 bits)
    dtypes = (np.dtype(np.float32), np.dtype(np.float32), dtype_from_name("bfloat16"))
    failures, checks = [], 0
    for rnd in range(3):
        if rnd and comm.rank == last:
            break
        inputs = [exact_inputs(c, d, comm.size, seed + 10 * rnd + c) for c, d in zip(counts, dtypes)]
        active = comm.size if rnd == 0 else comm.size - 1
        grads = [cuda.to_device(x[comm.rank]) for x in inputs]
        handles = [coord.submit(f"grad.{i}", g, "sum", out=g) for i, g in enumerate(grads)]
        for h in handles:
            h.wait(timeout=120)
        for i, (g, x) in enumerate(zip(grads, inputs)):
            checks += 1
            wrong = bit_mismatches(g.copy_to_host(), reference(x[:active], "sum"))
            if wrong:
                failures.append(f"round {rnd} grad.{i}: {wrong} wrong")
    joined_last = coord.join()
    coord.shutdown()
    engine.close()
    return {"failures": failures, "checks": checks, "joined_last": joined_last, "zeros_made": len(made)}


class CountingBackend:
    """A kernel back end that counts what the engine asks of the real one: launches, table uploads
    (host-to-device transfers that allocate), allocations, stream and device-wide waits."""

    def __init__(self, inner) -> None:
        from collections import Counter

        self._inner, self.name, self.counts = inner, inner.name, Counter()

    def __getattr__(self, attr: str):
        from tunelab.kernels.base import DeviceTable

        fn = getattr(self._inner, attr)
        if not callable(fn):
            return fn

        def counted(*args, **kwargs):
            self.counts[attr] += 1
            table = args[1] if attr == "reduce" else args[0] if attr in ("copy_table", "scale_copy_table") else None
            if attr in ("copy_table", "scale_copy_table", "reduce") and not isinstance(table, DeviceTable):
                self.counts["upload_table"] += 1  # a host table: uploaded for this one launch
            return fn(*args, **kwargs)

        return counted


def case_device_structure(comm: MPI.Comm, calls: int = 3) -> dict:
    """What one warmed-up device allreduce costs in host<->device traffic, allocations and waits,
    counted through an instrumenting kernel back end (under the CUDA simulator), per layout and
    ordering; results are checked against numpy too."""
    from tunelab.kernels import get_backend, register_backend

    counting = CountingBackend(get_backend("numba-cuda"))
    register_backend("numba-cuda", counting)
    from numba import cuda

    out: dict = {"runs": [], "failures": []}
    inputs = [exact_inputs(c, np.dtype(np.float32), comm.size, 40 + c) for c in (3, 150, 1100)]
    for lay in layouts(comm.size):
        for oneshot in (0, 1 << 18):
            engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096,
                                                     oneshot_max_bytes=oneshot, **lay))
            dev_in = [cuda.to_device(x[comm.rank]) for x in inputs]
            dev_out = [cuda.device_array_like(x[comm.rank]) for x in inputs]
            engine.allreduce(dev_in[1], "average", out=dev_out[1])
            for _ in range(3):  # warm-up: staging, scratch, and the tables of both double-buffer phases
                engine.allreduce_batch(dev_in, "sum", outs=dev_out)
            counting.counts.clear()
            for _ in range(calls):
                engine.allreduce_batch(dev_in, "sum", outs=dev_out)
            per_call = {k: v / calls for k, v in counting.counts.items()}
            for x, o in zip(inputs, dev_out):
                if bit_mismatches(o.copy_to_host(), reference(x, "sum")):
                    out["failures"].append(f"{lay} oneshot={oneshot}: wrong result")
            path = engine._device
            out["runs"].append({"layout": lay, "oneshot": oneshot, "per_call": per_call,
                                "ordering": path.ordering.name, "nodes": engine.topology.num_nodes})
            engine.close()
            engine.close()  # (a second close does nothing)
            # what a closed engine still holds of the device: nothing it could free
            out["runs"][-1]["held_after_close"] = {
                "path": engine._device is not None, "tables": len(path.tables), "marks": len(path._free_marks),
                "staging": int(path.staging.array.nbytes),
                "shared_tables": len(path.shared._tables) if path.shared is not None else 0}
    from tunelab.engine.device import device_buffer

    # uint16 holds bfloat16 bits, for the simulator's arrays as for every array-interface buffer
    out["uint16_reads_as"] = device_buffer(cuda.to_device(np.zeros(3, np.uint16))).dtype.name
    return out


def case_shared_gpu(comm: MPI.Comm, seed: int = 5) -> dict:
    """Ranks sharing one GPU (simulated): the first rank reads every rank's tensors and writes every
    rank's outputs in one launch per dtype; the others launch nothing.  Against numpy, with the
    launches counted; memory that cannot be shared takes the staged algorithms, still exact."""
    from tunelab.kernels import get_backend, register_backend

    from tunelab.engine.device_share import sim_device_array

    counting = CountingBackend(get_backend("numba-cuda"))
    register_backend("numba-cuda", counting)
    from numba import cuda

    out: dict = {"failures": [], "checks": 0}
    engine = Engine(comm, load_engine_config(backend="numba-cuda", segment_bytes=4096))
    specs = [("float32", 300, "sum"), ("float16", 7, "average"), ("bfloat16", 1000, "average"),
             ("float32", 1, "min"), ("int32", 2500, "max"), ("float64", 0, "sum")]
    arrays = {}  # the same device tensors every round, as a training step's gradients are
    for rnd in range(4):
        if rnd == 3:
            counting.counts.clear()  # the warm round
        for dtype_name, count, op in specs:
            dtype = dtype_from_name(dtype_name)
            x = [exact_inputs(count, dtype, comm.size, seed + rnd + count), exact_inputs(3, dtype, comm.size, seed)]
            if dtype_name + op not in arrays:
                arrays[dtype_name + op] = ([sim_device_array(v[comm.rank]) for v in x],
                                           [sim_device_array(np.zeros_like(v[comm.rank])) for v in x])
            ins, fresh = arrays[dtype_name + op]
            for d, v in zip(ins, x):
                if v[comm.rank].size:  # (the simulator cannot copy an empty array)
                    d.copy_to_device(v[comm.rank])
            outs = ins if rnd % 2 else fresh  # in place every other round
            engine.allreduce_batch(ins, op, outs=outs)
            for o, v in zip(outs, x):
                out["checks"] += 1
                if bit_mismatches(o.copy_to_host(), reference(v, op)):
                    out["failures"].append(f"round {rnd} {dtype_name}[{count}] {op}: wrong")
    out["leader"] = engine._device.shared is not None and engine._device.shared.leader
    out["counts"] = dict(counting.counts)  # the last round: warm, one call per spec
    # float16 averages whose sums pass 65504 (the leader's kernel rounded the sum before scaling: inf)
    top = top_half_inputs(257, comm.size, seed)
    d_top, d_avg = sim_device_array(top[comm.rank]), sim_device_array(np.zeros_like(top[comm.rank]))
    engine.allreduce_batch([d_top], "average", outs=[d_avg])
    out["checks"] += 1
    if bit_mismatches(d_avg.copy_to_host(), reference(top, "average")):
        out["failures"].append(f"float16 average past 65504: {d_avg.copy_to_host()[:4]}")
    # Gradients as a framework submits them: through the coordinator thread, in place, averaged.
    from tunelab.engine.coordinator import Coordinator

    coord = Coordinator(engine)
    grads = [exact_inputs(c, np.dtype(np.float32), comm.size, seed + 3 * c) for c in (513, 8)]
    devs = [sim_device_array(g[comm.rank]) for g in grads]
    handles = [coord.submit(f"grad.{i}", d, "average", out=d) for i, d in enumerate(devs)]
    for h, d, g in zip(handles, devs, grads):
        h.wait(timeout=120)
        out["checks"] += 1
        if bit_mismatches(d.copy_to_host(), reference(g, "average")):
            out["failures"].append("coordinator: wrong")
    coord.shutdown()
    # Plain simulator arrays are private to their process: the call falls back to staging, exactly.
    x = exact_inputs(700, np.dtype(np.float32), comm.size, seed)
    got = engine.allreduce(cuda.to_device(x[comm.rank]), "sum")
    out["checks"] += 1
    if bit_mismatches(got.copy_to_host(), reference(x, "sum")):
        out["failures"].append("fallback: wrong")
    engine.close()
    return out


def case_staging_setup_fails(comm: MPI.Comm) -> dict:
    """Device staging segments (tunelab.engine.device_ipc) set up while one rank cannot allocate its
    segment (out of device memory), then while one rank cannot map a peer's: every rank must raise,
    naming the rank, none may wait for the others for good, each frees what it got, and the next setup
    works.  The CUDA calls are stand-ins (no GPU); the collective protocol around them is the code's."""
    from tunelab.engine.device_ipc import ExportRefused, _Ipc

    me = comm.rank
    log: list[str] = []

    class FakeIpc(_Ipc):
        fail = ""

        def allocate(self, nbytes):
            if FakeIpc.fail == "allocate" and me == comm.size - 1:
                raise MemoryError(f"out of memory allocating {nbytes} bytes (injected)")
            if FakeIpc.fail == "export" and me == comm.size - 1:  # allocated, given back, not exportable
                raise ExportRefused("cudaErrorNotSupported: operation not supported (injected)")
            log.append("allocate")
            return 0x1000 * (me + 1), me

        def open(self, handle):
            if FakeIpc.fail == "open" and me == 0 and handle == comm.size - 1:
                raise OSError("cannot open the handle (injected)")
            log.append(f"open {handle}")
            return 0x100000 + handle

        def close(self, addr):
            log.append(f"close {addr - 0x100000}")

        def release(self):
            log.append("release")

    ipc, out = FakeIpc(), {}
    for fail in ("allocate", "export", "open", ""):
        FakeIpc.fail = fail
        log.clear()
        try:
            out[fail or "ok"] = {"addrs": ipc.map(comm, 4096), "log": list(log)}
        except Exception as exc:  # noqa: BLE001 (what each rank was told is the result)
            out[fail or "ok"] = {"error": f"{type(exc).__name__}: {exc}", "log": list(log)}
    return out

def case_shared_gpu_leader_fails(comm: MPI.Comm, seed: int = 5, fail_at: str = "launch") -> dict:
    """Ranks sharing one GPU (simulated), the first rank doing the device work: on the second call its
    launch fails (``fail_at="launch"``), or opening a peer's new allocation does (``"open"``; the second
    and third calls use new arrays).  Every rank must hear of it at once (the peers wait for the leader
    at a barrier: they must not sit there until the engine's timeout), and the call after it works
    (after a failed open, the peers' handles reach the leader again)."""
    import time as _time

    from tunelab.kernels import get_backend, register_backend

    from tunelab.engine import device_share
    from tunelab.engine.device_share import sim_device_array

    if fail_at == "open" and comm.rank == 0:
        real_add = device_share.Importer.add
        opened = []

        def add_failing_once(self, rank, key, handle):
            opened.append(key)
            if len(opened) == 3:  # the first allocation of the second call (two in the first)
                raise device_share.NotShareable("cannot open the handle (injected)")
            return real_add(self, rank, key, handle)

        device_share.Importer.add = add_failing_once

    inner = get_backend("numba-cuda")

    class FailingOnce:
        name, calls = inner.name, 0

        def __getattr__(self, attr):
            return getattr(inner, attr)

        def reduce_bcast(self, *args, **kwargs):
            FailingOnce.calls += 1
            if FailingOnce.calls == 2 and fail_at == "launch":
                raise RuntimeError("launch failed (injected)")
            return inner.reduce_bcast(*args, **kwargs)

    register_backend("numba-cuda", FailingOnce())
    engine = Engine(comm, load_engine_config(backend="numba-cuda", timeout_s=60))
    x = exact_inputs(300, np.dtype(np.float32), comm.size, seed)
    dev = sim_device_array(x[comm.rank])
    out = sim_device_array(np.zeros_like(x[comm.rank]))
    results = []
    for call in range(3):
        if call == 1 and fail_at == "open":
            dev, out = sim_device_array(x[comm.rank]), sim_device_array(np.zeros_like(x[comm.rank]))
        t0 = _time.monotonic()
        try:
            engine.allreduce_batch([dev], "sum", outs=[out])
            error = ""
        except Exception as exc:  # noqa: BLE001 (what each rank was told is the result)
            error = f"{type(exc).__name__}: {exc}"
        results.append({"error": error, "seconds": _time.monotonic() - t0,
                        "right": not bit_mismatches(out.copy_to_host(), reference(x, "sum"))})
        out.copy_to_device(np.zeros_like(x[comm.rank]))
    leader = engine._device.shared is not None and engine._device.shared.leader
    engine.close()
    return {"calls": results, "leader": leader}


def _find_case(name: str):
    if name in globals():
        return globals()[name]
    module = "mpi_tf_cases" if name.startswith("case_tf_") else "mpi_torch_cases"
    if name.startswith("case_replay_"):
        module = "mpi_replay_cases"  # no framework needed
    return getattr(__import__(module), name)  # framework cases import their framework only when used


_CASE_OUT: list[str] = []  # the launch's output folder (rank<r>.json), for cases that end the job themselves


def _small_simulated_grids() -> None:
    """Under the simulator every thread of a block is a Python thread: launches of 32-thread blocks,
    at most 4 a grid (as the kernel tests use), cost a fraction of the default 256-thread blocks' time
    and still stride: counts past 32 x 4 x 4 words take several passes of the grid."""
    from tunelab.kernels import register_backend
    from tunelab.kernels.numba_cuda import NumbaCudaBackend

    register_backend("numba-cuda", NumbaCudaBackend(block=32, max_blocks=4))


def main(argv: list[str]) -> int:
    case, params, outdir = argv
    _CASE_OUT.append(outdir)
    comm = MPI.COMM_WORLD
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and os.environ.get("TUNELAB_TEST_FULL_GRID") != "1":
        _small_simulated_grids()
    try:
        result = _find_case("case_" + case)(comm, **json.loads(params))
    except Exception:  # noqa: BLE001 (a failing case must abort every rank, not hang them)
        traceback.print_exc()
        comm.Abort(1)
        return 1
    Path(outdir, f"rank{comm.rank}.json").write_text(json.dumps(result))
    if result.get("abort"):
        sys.stdout.flush()
        comm.Abort(3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
