"""Horovod-parity cases for tunelab.torch (launched through mpi_cases.py, re-exported by mpi_torch_cases).

Every rank regenerates every rank's inputs from seeds, so references are single-process torch or numpy
computations of the same function, independent of the code under test.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import torch

import tunelab.torch as tl
from tunelab.errors import TunelabError


def _inputs(n: int, shape_of, seed: int, dtype=torch.float64) -> list[torch.Tensor]:
    return [torch.randn(*shape_of(r), generator=torch.Generator().manual_seed(seed * 100 + r), dtype=dtype)
            for r in range(n)]


def _err(fn) -> str:
    try:
        fn()
    except TunelabError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def errors_then_success(r: int, n: int) -> dict:
    """Each failed call raises from that call on every rank; the next call works."""
    last = r == n - 1
    out = {
        "shape": _err(lambda: tl.allreduce(torch.ones(3 + last), name="e.shape")),
        "dtype": _err(lambda: tl.allreduce(torch.ones(3, dtype=torch.float64 if last else torch.float32),
                                           name="e.dtype")),
        "op": _err(lambda: tl.allreduce(torch.ones(3), name="e.op", op=tl.Max if last else tl.Sum)),
        "grouped": _err(lambda: tl.grouped_allreduce([torch.ones(2), torch.ones(2 + last)], name="e.group")),
        "root": _err(lambda: tl.broadcast(torch.ones(2), root_rank=int(last), name="e.root")),
        "bshape": _err(lambda: tl.broadcast(torch.ones(2 + last), root_rank=0, name="e.bshape")),
        "bobject": _err(lambda: tl.broadcast_object(r, root_rank=int(last))),
        "gather": _err(lambda: tl.allgather(torch.ones(2, 2 + last))),
    }
    for key, call in (("broot", lambda: tl.broadcast(torch.ones(2), root_rank=n if last else 0)),
                      ("splits", lambda: tl.alltoall(torch.ones(n), splits=[1] * (n + last))),
                      ("equal", lambda: tl.alltoall(torch.ones(n + last)))):  # no splits: n + 1 rows
        try:  # a bad argument on one rank fails the call on every rank (nobody is left waiting)
            call()
            out[key] = ""
        except ValueError as exc:
            out[key] = str(exc)
    out["after"] = tl.allreduce(torch.full((3,), float(r)), name="e.after", op=tl.Sum).tolist()
    out["after_bcast"] = tl.broadcast(torch.full((2,), float(r)), root_rank=n - 1).tolist()
    return out


def autograd_vs_single_process(r: int, n: int) -> dict:
    """Gradients through collectives on each rank against one process's autograd of the same objective."""
    diffs = {}
    ws = _inputs(n, lambda q: (5,), seed=2)
    for op in (tl.Sum, tl.Average, tl.Max):
        xs = _inputs(n, lambda q: (5,), seed=1)
        mine = xs[r].clone().requires_grad_()
        (ws[r] * tl.allreduce(mine, op=op, name=f"ag.{op}")).sum().backward()
        if op == tl.Max:  # Horovod: the gradient is the same reduction (max) of every rank's gradient
            expected = torch.stack(ws).max(0).values
        else:  # the gradient of sum_q L_q, each L_q = <w_q, reduce(x)>, in one process
            ref = [x.clone().requires_grad_() for x in xs]
            y = torch.stack(ref).sum(0) if op == tl.Sum else torch.stack(ref).mean(0)
            sum((w * y).sum() for w in ws).backward()
            expected = ref[r].grad
        diffs[f"allreduce_{op}"] = float((mine.grad - expected).abs().max())
    # grouped: two tensors, average
    xa, xb = _inputs(n, lambda q: (4,), seed=3), _inputs(n, lambda q: (2, 3), seed=4)
    wa, wb = _inputs(n, lambda q: (4,), seed=5), _inputs(n, lambda q: (2, 3), seed=6)
    a, b = xa[r].clone().requires_grad_(), xb[r].clone().requires_grad_()
    ya, yb = tl.grouped_allreduce([a, b], name="ag.grouped")
    ((wa[r] * ya).sum() + (wb[r] * yb).sum()).backward()
    ra, rb = [x.clone().requires_grad_() for x in xa], [x.clone().requires_grad_() for x in xb]
    ma, mb = torch.stack(ra).mean(0), torch.stack(rb).mean(0)
    sum((wa[q] * ma).sum() + (wb[q] * mb).sum() for q in range(n)).backward()
    diffs["grouped"] = max(float((a.grad - ra[r].grad).abs().max()), float((b.grad - rb[r].grad).abs().max()))
    # allgather (rows differ per rank): Horovod 0.28 averages the gradient -> objective mean_q L_q
    xs = _inputs(n, lambda q: (q + 1, 3), seed=7)
    total = sum(q + 1 for q in range(n))
    ws3 = _inputs(n, lambda q: (total, 3), seed=8)
    mine = xs[r].clone().requires_grad_()
    (ws3[r] * tl.allgather(mine, name="ag.gather")).sum().backward()
    ref = [x.clone().requires_grad_() for x in xs]
    (sum((ws3[q] * torch.cat(ref)).sum() for q in range(n)) / n).backward()
    diffs["allgather"] = float((mine.grad - ref[r].grad).abs().max())
    # broadcast from the last rank: the averaged gradient on the root, zero elsewhere
    root = n - 1
    xs, ws4 = _inputs(n, lambda q: (4,), seed=9), _inputs(n, lambda q: (4,), seed=10)
    mine = xs[r].clone().requires_grad_()
    (ws4[r] * tl.broadcast(mine, root_rank=root, name="ag.bcast")).sum().backward()
    ref = [x.clone().requires_grad_() for x in xs]
    (sum((ws4[q] * ref[root]).sum() for q in range(n)) / n).backward()
    expected = ref[r].grad if ref[r].grad is not None else torch.zeros(4, dtype=torch.float64)
    diffs["broadcast"] = float((mine.grad - expected).abs().max())
    # alltoall with splits: rank q sends (q + j) % 3 rows to rank j
    splits = [[(q + j) % 3 for j in range(n)] for q in range(n)]
    xs = _inputs(n, lambda q: (sum(splits[q]), 2), seed=11)
    mine = xs[r].clone().requires_grad_()
    got, counts = tl.alltoall(mine, splits=torch.tensor(splits[r]), name="ag.a2a")
    ws5 = _inputs(n, lambda q: (sum(splits[s][q] for s in range(n)), 2), seed=12)
    (ws5[r] * got).sum().backward()
    ref = [x.clone().requires_grad_() for x in xs]

    def received(q: int) -> torch.Tensor:
        return torch.cat([ref[s][sum(splits[s][:q]):sum(splits[s][:q + 1])] for s in range(n)])

    sum((ws5[q] * received(q)).sum() for q in range(n)).backward()
    diffs["alltoall"] = float((mine.grad - ref[r].grad).abs().max())
    diffs["alltoall_values"] = float((got.detach() - received(r).detach()).abs().max())
    diffs["alltoall_counts"] = counts.tolist() == [splits[s][r] for s in range(n)]
    return diffs


def _jacobians(f, x: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(autograd Jacobian by vector-Jacobian products, central-difference Jacobian) of f at x, with the
    same sequence of collective calls on every rank (torch's gradcheck orders its calls its own way)."""
    out = f(x)
    rows = []
    for j in range(out.numel()):
        seed = torch.zeros(out.numel(), dtype=out.dtype)
        seed[j] = 1.0
        rows.append(torch.autograd.grad(out, x, seed.reshape(out.shape), retain_graph=True)[0].reshape(-1))
    cols = []
    with torch.no_grad():
        for i in range(x.numel()):
            step = torch.zeros(x.numel(), dtype=x.dtype)
            step[i] = eps
            step = step.reshape(x.shape)
            cols.append(((f(x + step) - f(x - step)) / (2 * eps)).reshape(-1))
    return torch.stack(rows), torch.stack(cols, dim=1)


def gradchecks(r: int, n: int) -> dict:
    """A float64 gradient check where Horovod's gradients are local Jacobians: allgather and broadcast,
    when only rank p's input moves (the other ranks feed a constant that ignores the perturbation).
    An allreduce's Horovod gradient is the gradient of the sum of every rank's loss, not a local Jacobian,
    so it is checked against single-process autograd instead."""
    out = {}
    for kind in ("allgather", "broadcast"):
        for p in range(n):
            x = torch.randn(2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(r)).requires_grad_()
            const = x.detach().clone()

            def f(inp: torch.Tensor, kind=kind, p=p, const=const) -> torch.Tensor:
                src = inp if r == p else const + 0 * inp
                return tl.allgather(src) if kind == "allgather" else tl.broadcast(src, root_rank=p)

            analytical, numerical = _jacobians(f, x)
            out[f"{kind}_{p}"] = float((analytical - numerical).abs().max()) if r == p else 0.0
            out[f"{kind}_{p}_nonzero"] = bool(numerical.abs().sum() > 0) if r == p else True
    return out


def integer_average(r: int, n: int) -> dict:
    """Horovod: the sum times 1.0/size in double, truncated toward zero."""
    base = np.array([-7, -6, -5, -4, -2, -1, 0, 1, 4, 5, 7, 11, -11])  # negative odd sums: trunc != floor
    vals = [base * (q + 1) + (q == 0) for q in range(n)]
    sums = np.sum(vals, axis=0)
    expected = [int(s // n) if s >= 0 else -int((-s) // n) for s in sums]  # exact rational, toward zero
    out = {"expected": expected}
    out["int32"] = tl.allreduce(torch.tensor(vals[r], dtype=torch.int32), name="ia.32").tolist()
    t = torch.tensor(vals[r], dtype=torch.int64)
    tl.allreduce_(t, average=True, name="ia.64")
    out["int64_inplace"] = t.tolist()
    h = tl.allreduce_async(torch.tensor(vals[r], dtype=torch.int32), name="ia.twice")
    out["synchronized_twice"] = [tl.synchronize(h).tolist(), tl.synchronize(h).tolist()]  # divided once
    out["grouped"] = [x.tolist() for x in tl.grouped_allreduce(
        [torch.tensor(vals[r], dtype=torch.int32), torch.tensor(vals[r][:3], dtype=torch.int64)], name="ia.g")]
    return out


def sparse_and_options(r: int, n: int) -> dict:
    """Embedding gradients (sparse, and sparse_as_dense), predivide, num_groups, clipping with
    skip_synchronize: weights after 3 steps against one process on the concatenated batches."""
    def model_and_data(seed: int):
        torch.manual_seed(seed)
        emb = torch.nn.Embedding(11, 3, sparse=True)
        head = torch.nn.Linear(3, 2)
        return torch.nn.ModuleDict({"emb": emb, "head": head})

    def batch(step: int, q: int):
        g = torch.Generator().manual_seed(50 + step * 10 + q)
        return torch.randint(0, 11, (4,), generator=g), torch.randn(4, 2, generator=g)

    def loss(m, idx, y):
        return ((m["head"](m["emb"](idx)) - y) ** 2).mean()

    def run(dist: bool, clip: bool = False, micro: int = 1, **kw) -> list[torch.Tensor]:
        m = model_and_data(0)
        opt = torch.optim.SGD(m.parameters(), lr=0.2)
        if dist:
            opt = tl.DistributedOptimizer(opt, named_parameters=m.named_parameters(), load_profile=False,
                                          backward_passes_per_step=micro, **kw)
        for step in range(3):
            opt.zero_grad()
            if dist:  # (in micro-batches: the sum of their mean losses / micro is the batch's mean loss)
                idx, y = batch(step, r)
                for q in range(micro):
                    part = slice(q * len(idx) // micro, (q + 1) * len(idx) // micro)
                    (loss(m, idx[part], y[part]) / micro).backward()  # (Horovod's recipe: passes add up)
            else:  # mean of the ranks' mean losses = the distributed average of gradients
                (sum(loss(m, *batch(step, q)) for q in range(n)) / n).backward()
            if clip:
                if dist:
                    opt.synchronize()
                for p in m.parameters():
                    p.grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                if dist:
                    with opt.skip_synchronize():
                        opt.step()
                    continue
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    def diff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    ref = run(False)
    out = {"sparse": diff(run(True), ref), "sparse_as_dense": diff(run(True, sparse_as_dense=True), ref),
           "predivide": diff(run(True, gradient_predivide_factor=2.0), ref),
           "num_groups": diff(run(True, num_groups=2, sparse_as_dense=True), ref),
           # a sparse gradient in a group: it is allgathered, and its group's dense members still go out
           "sparse_grouped": diff(run(True, num_groups=1), ref),
           "sparse_bpps2": diff(run(True, micro=2), ref),
           "clip": diff(run(True, clip=True, sparse_as_dense=True), run(False, clip=True))}
    out["clip_moved"] = diff(run(False, clip=True), ref) > 1e-4  # clipping changed the result
    try:
        tl.DistributedOptimizer(torch.optim.SGD(model_and_data(0).parameters(), lr=0.1), op=tl.Sum,
                                gradient_predivide_factor=2.0, load_profile=False)
        out["predivide_sum"] = ""
    except ValueError as exc:
        out["predivide_sum"] = str(exc)
    return out


def join_uneven(r: int, n: int) -> dict:
    """Rank q has 2 + q batches; ranks that ran out join and contribute zeros; averages divide by n."""
    def model():
        torch.manual_seed(3)
        return torch.nn.Linear(4, 2)

    def batch(step: int, q: int):
        g = torch.Generator().manual_seed(700 + step * 10 + q)
        return torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)

    def loss(m, x, y):
        return ((m(x) - y) ** 2).mean()

    m = model()
    opt = tl.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), load_profile=False)
    for step in range(2 + r):
        opt.zero_grad()
        loss(m, *batch(step, r)).backward()
        opt.step()
    last = tl.join()
    after = tl.allreduce(torch.ones(2), name="join.after", op=tl.Sum).tolist()  # everyone back in step
    ref = model()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2 + r):
        ropt.zero_grad()
        (sum(loss(ref, *batch(step, q)) for q in range(n) if step < 2 + q) / n).backward()
        ropt.step()
    return {"last": last, "after": after,
            "diff": max(float((a - b).abs().max()) for a, b in zip(m.parameters(), ref.parameters()))}


def collectives_vs_numpy(r: int, n: int) -> dict:
    rows = 2 * n + 1
    xs = [np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) * (q + 1) for q in range(n)]
    total = np.sum(xs, axis=0)
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    mine = slice(start, start + base + (r < extra))
    out = {"rs_sum": float(np.abs(tl.reducescatter(torch.from_numpy(xs[r]), op=tl.Sum).numpy()
                                  - total[mine]).max()),
           "rs_avg": float(np.abs(tl.reducescatter(torch.from_numpy(xs[r])).numpy() - total[mine] / n).max()),
           "rs_rows": tl.reducescatter(torch.from_numpy(xs[r]), op=tl.Sum).shape[0] == base + (r < extra)}
    g = tl.grouped_reducescatter([torch.from_numpy(xs[r]), torch.from_numpy(xs[r][:n].copy())], op=tl.Sum)
    out["grs"] = float(max(np.abs(g[0].numpy() - total[mine]).max(),
                           np.abs(g[1].numpy() - total[:n][r:r + 1]).max()))
    ys = [np.arange(2 * n, dtype=np.int64) + 100 * q for q in range(n)]
    a2a = tl.alltoall(torch.from_numpy(ys[r]))  # equal splits: 2 each, no counts returned
    out["a2a_equal"] = a2a.tolist() == np.concatenate([ys[q][2 * r:2 * r + 2] for q in range(n)]).tolist()
    out["objects"] = tl.allgather_object({"rank": r}) == [{"rank": q} for q in range(n)]
    scalar = tl.allreduce(torch.tensor(float(r)), name="scalar")  # Horovod's metric_average pattern
    out["scalar"] = [list(scalar.shape), float(scalar)]
    out["built"] = [tl.mpi_threads_supported(), tl.mpi_built(), tl.gloo_built(), tl.nccl_built()]
    if r == 0:
        time.sleep(0.4)
    t0 = time.monotonic()
    tl.barrier()
    out["barrier_waited"] = time.monotonic() - t0
    return out


def sync_batch_norm(r: int, n: int) -> dict:
    xs = _inputs(n, lambda q: (q + 2, 3, 4, 4), seed=20, dtype=torch.float32)
    ws = _inputs(n, lambda q: (q + 2, 3, 4, 4), seed=21, dtype=torch.float32)
    bn = tl.SyncBatchNorm(3, momentum=0.3)
    ref_bn = torch.nn.BatchNorm2d(3, momentum=0.3)
    with torch.no_grad():
        for m in (bn, ref_bn):
            m.weight.copy_(torch.tensor([1.5, 0.5, -1.0]))
            m.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    mine = xs[r].clone().requires_grad_()
    y = bn(mine)
    (ws[r] * y).sum().backward()
    ref_in = [x.clone().requires_grad_() for x in xs]
    ref_y = ref_bn(torch.cat(ref_in))
    (torch.cat(ws) * ref_y).sum().backward()
    offset = sum(q + 2 for q in range(r))
    wgrad = tl.allreduce(bn.weight.grad, op=tl.Sum, name="bn.wgrad")
    half = {}
    # Half precision, as a .half() model or autocast hands it over: more than 65504 values a channel over
    # the ranks (float16's largest number), statistics kept in float32, against float32's batch norm of
    # the same (rounded) global batch.
    big = _inputs(n, lambda q: (q + 2, 3, 120, 120), seed=22, dtype=torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        low = tl.SyncBatchNorm(3).to(dtype)
        got = low(big[r].to(dtype))
        ref = torch.nn.BatchNorm2d(3)(torch.cat([x.to(dtype).float() for x in big]))
        start = sum((q + 2) for q in range(r))
        half[str(dtype).split(".")[1]] = {
            "dtype": str(got.dtype), "finite": bool(torch.isfinite(got).all()),
            "out": float((got.float() - ref[start:start + r + 2]).abs().max()),
            "running_finite": bool(torch.isfinite(low.running_mean).all() and torch.isfinite(low.running_var).all())}
    bn.eval()
    ref_bn.eval()
    return {"half": half, "out": float((y - ref_y[offset:offset + r + 2]).abs().max()),
            "in_grad": float((mine.grad - ref_in[r].grad).abs().max()),
            "w_grad": float((wgrad - ref_bn.weight.grad).abs().max()),
            "running": float(max((bn.running_mean - ref_bn.running_mean).abs().max(),
                                 (bn.running_var - ref_bn.running_var).abs().max())),
            "eval": float((bn(xs[r]) - ref_bn(xs[r])).abs().max())}


def timeline(r: int, n: int, path: str) -> dict:
    tl.start_timeline(path)
    tl.allreduce(torch.ones(4), name="traced.tensor")
    tl.stop_timeline()
    tl.allreduce(torch.ones(4), name="untraced.tensor")
    if r != 0:
        return {}
    with open(path) as f:
        events = json.load(f)
    return {"spans": sum(e.get("name") == "allreduce" for e in events), "valid": True}


def case_torch_optimizer_options(comm) -> dict:
    """The optimizer's options alone (sparse gradients, predivide, groups, clipping), on any world size."""
    torch.set_num_threads(1)
    tl.init(comm)
    out = sparse_and_options(tl.rank(), tl.size())
    tl.shutdown()
    return out


def case_torch_parity(comm) -> dict:
    import tempfile

    torch.set_num_threads(1)
    tl.init(comm)
    r, n = tl.rank(), tl.size()
    scratch = tempfile.mkdtemp(prefix="tunelab-tl-") if r == 0 else None  # (one, removed below)
    trace = tl.broadcast_object(os.path.join(scratch, "trace.json") if r == 0 else None, 0)
    try:
        out = {"errors": errors_then_success(r, n), "autograd": autograd_vs_single_process(r, n),
               "gradcheck": gradchecks(r, n),
               "int_avg": integer_average(r, n), "optimizer": sparse_and_options(r, n),
               "join": join_uneven(r, n), "collectives": collectives_vs_numpy(r, n),
               "syncbn": sync_batch_norm(r, n),
               "timeline": timeline(r, n, trace)}
        tl.shutdown()  # raises if any error above had poisoned the coordinator
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def case_torch_optimizer_lifecycle(comm) -> dict:
    """The wrapped optimizer across its life, each against plain torch arithmetic (lr 1, SGD, so a step
    subtracts the averaged gradient): step hooks after broadcast_optimizer_state run once, on reduced
    gradients; an LR scheduler made before wrapping still drives the rate after a state load; a
    second synchronize() changes nothing; backward_passes_per_step adds the passes up (Horovod);
    add_param_group's parameters are reduced; a newer wrapper over the same parameters takes over;
    broadcast_parameters takes a list of tensors; an unpicklable broadcast_object fails on every rank
    at once and the next one works."""
    torch.set_num_threads(1)
    tl.init(comm)
    r, n = tl.rank(), tl.size()
    mean_w = sum(range(1, n + 1)) / n  # rank r's gradient of (w * (r + 1)).sum() is r + 1: the average
    out: dict = {}

    def param(value: float = 0.0) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.full((2,), value))

    # step hooks after broadcast_optimizer_state: once per step, seeing the reduced gradient
    w = param()
    opt = tl.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], load_profile=False)
    tl.broadcast_optimizer_state(opt, root_rank=0)
    seen: list = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(w.grad.tolist()))
    (w * (r + 1)).sum().backward()
    opt.step()
    out["hook_calls"], out["hook_saw_mean"] = len(seen), seen == [[mean_w, mean_w]]
    out["w_after_one_step"] = w.tolist() == [-mean_w, -mean_w]

    # an LR scheduler made on the optimizer before wrapping, after a broadcast of its state
    w = param()
    base = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.1)
    opt = tl.DistributedOptimizer(base, named_parameters=[("w2", w)], load_profile=False)
    tl.broadcast_optimizer_state(opt, root_rank=0)
    rates = []
    for _ in range(3):
        opt.zero_grad()
        (w * (r + 1)).sum().backward()
        opt.step()
        rates.append(opt.param_groups[0]["lr"])
        sched.step()
    out["rates"] = rates  # torch alone: 1.0, 0.1, 0.01 (read after each step, before the scheduler's)
    out["w_scheduled"] = abs(w[0].item() + mean_w * 1.11) < 1e-6

    # synchronize() twice, then step() inside skip_synchronize(), with 2 passes adding up
    w = param()
    opt = tl.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w3", w)],
                                  backward_passes_per_step=2, load_profile=False)
    for _ in range(2):
        (w * (r + 1)).sum().backward()
    opt.synchronize()
    first = w.grad.tolist()
    opt.synchronize()
    with opt.skip_synchronize():
        opt.step()
    out["passes_add_up"] = first == [2 * mean_w, 2 * mean_w]
    out["second_sync_same"] = w.grad.tolist() == first and w.tolist() == [-2 * mean_w, -2 * mean_w]

    # a parameter group added after wrapping is reduced
    a, b = param(), param()
    opt = tl.DistributedOptimizer(torch.optim.SGD([a], lr=1.0), named_parameters=[("a", a)], load_profile=False)
    opt.add_param_group({"params": [b]})
    ((a + b) * (r + 1)).sum().backward()
    opt.step()
    out["added_group_reduced"] = a.tolist() == b.tolist() == [-mean_w, -mean_w]

    # a newer wrapper over the same parameters (the old one still referenced) takes them over
    w = param()
    old = tl.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w4", w)], load_profile=False)
    (w * (r + 1)).sum().backward()
    old.step()
    old.zero_grad()
    new = tl.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w4", w)], load_profile=False)
    (w * (r + 1)).sum().backward()
    new.step()
    out["rewrapped"] = w.tolist() == [-2 * mean_w, -2 * mean_w]
    try:
        old.step()
        out["old_refused"] = ""
    except RuntimeError as exc:
        out["old_refused"] = str(exc)

    # broadcast_parameters of a bare list of tensors
    ts = [torch.full((3,), float(r)), torch.full((2, 2), float(r) + 10)]
    tl.broadcast_parameters(ts, root_rank=n - 1)
    out["list_broadcast"] = [t.flatten().tolist() for t in ts] == [[n - 1.0] * 3, [n + 9.0] * 4]

    # an object root cannot pickle: every rank raises at once, and the next broadcast works
    t0 = time.monotonic()
    try:
        tl.broadcast_object((lambda x: x) if r == 0 else None, root_rank=0)
        out["unpicklable"] = ""
    except Exception as exc:  # noqa: BLE001 (the type is part of what is checked)
        out["unpicklable"] = type(exc).__name__
    out["unpicklable_s"] = time.monotonic() - t0
    out["next_object"] = tl.broadcast_object({"x": r}, root_rank=0)
    tl.shutdown()
    return out


def case_torch_inplace_autograd(comm) -> dict:
    """In-place collectives on tensors a backward pass saved: each raises torch's own "modified by an
    inplace operation" at backward, as ``w.mul_(2)`` would, instead of a gradient computed with the
    reduced values (the engine writes through views torch does not see).  A parameter broadcast through
    ``broadcast_parameters`` (its ``.data``) and gradients reduced in place leave backward alone, and the
    gradient is then autograd's own, 2w with w from rank 0."""
    torch.set_num_threads(1)
    tl.init(comm)
    r = tl.rank()
    out: dict = {}

    def saved_then(write) -> str:
        w = torch.full((3,), float(r + 1), requires_grad=True)
        y = (w * w).sum()  # saves w
        with torch.no_grad():
            write(w)
        try:
            y.backward()
        except RuntimeError as exc:
            return str(exc).split(":")[0]
        return f"no error: grad {w.grad.tolist()}"

    out["allreduce_"] = saved_then(lambda w: tl.allreduce_(w, op=tl.Sum, name="w.allreduce"))
    out["grouped_allreduce_"] = saved_then(lambda w: tl.grouped_allreduce_([w], op=tl.Sum, name="w.grouped"))
    out["allreduce_scaled"] = saved_then(lambda w: tl.allreduce_(w, op=tl.Sum, name="w.scaled", postscale_factor=0.5))
    out["broadcast_"] = saved_then(lambda w: tl.broadcast_(w, 0, name="w.broadcast"))
    out["torch_mul_"] = saved_then(lambda w: w.mul_(2))  # (the reference: torch's own in-place op)
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(float(r + 1))
    x = torch.ones(1, 2)
    tl.broadcast_parameters(model.named_parameters(), 0)
    out["parameters_after_broadcast"] = model.weight.tolist()
    model.zero_grad()
    loss = (model(x) ** 2).sum()
    loss.backward()
    tl.allreduce_(model.weight.grad, op=tl.Average, name="grad.w")
    out["grad_after_allreduce_"] = model.weight.grad.tolist()
    tl.shutdown()
    return out
