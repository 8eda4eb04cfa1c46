"""Torch training cases for mpi_cases.py: distributed runs against a single-process reference."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

import tunelab.torch as tl


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))


def batches(step: int, world: int, micro: int, per_rank: int = 4):
    """Deterministic data: the global batch of one step, split as [rank][micro] chunks."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * micro * per_rank, 3, 8, 8, generator=g)
    y = torch.randint(0, 5, (world * micro * per_rank,), generator=g)
    return [[(x[(r * micro + m) * per_rank:(r * micro + m + 1) * per_rank],
              y[(r * micro + m) * per_rank:(r * micro + m + 1) * per_rank]) for m in range(micro)]
            for r in range(world)]


def reference_weights(steps: int, world: int, micro: int) -> list[torch.Tensor]:
    """One process, plain SGD on every rank's samples of each step at once."""
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        chunks = [c for per_rank in batches(step, world, micro) for c in per_rank]
        x = torch.cat([c[0] for c in chunks])
        y = torch.cat([c[1] for c in chunks])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def distributed_weights(steps: int, micro: int, device: str = "cpu", **opt_kwargs) -> list[torch.Tensor]:
    model = tiny_model(seed=tl.rank()).to(device)  # different init per rank: broadcast must fix it
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tl.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = tl.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  backward_passes_per_step=micro, **opt_kwargs)
    tl.broadcast_optimizer_state(opt, root_rank=0)
    for step in range(steps):
        opt.zero_grad()
        for x, y in batches(step, tl.size(), micro)[tl.rank()]:
            # Horovod's recipe: the passes' gradients add up, so each pass's loss is divided by their count
            (torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)) / micro).backward()
        opt.step()
    return [p.detach().cpu().clone() for p in model.parameters()]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def case_torch_training(comm, steps: int = 6) -> dict:
    torch.set_num_threads(1)
    tl.init(comm)
    out = {}
    from tunelab import runtime

    coordinator = runtime.current().coordinator
    enqueue, gradients = coordinator._enqueue, []  # count the gradients handed to the coordinator

    def counting(reqs):
        gradients.extend(r.name for r in reqs if r.name.startswith("grad."))
        return enqueue(reqs)

    coordinator._enqueue = counting
    for mode, micro, kwargs in (("plain", 1, {}), ("bpps2", 2, {}),
                                ("fp16", 1, {"compression": tl.Compression.fp16}), ("groups2", 1, {"groups": 2}),
                                ("predivide4", 1, {"gradient_predivide_factor": 4.0})):
        gradients.clear()
        mine = distributed_weights(steps, micro, **kwargs)
        ref = reference_weights(steps, tl.size(), micro)
        out[mode] = {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(mine, ref)),
                     "digest": digest(mine), "gradients_submitted": len(gradients)}
    coordinator._enqueue = enqueue
    model = tiny_model()
    groups = [list(model.parameters())[:2], list(model.parameters())[4:]]
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=groups)
    for x, y in batches(0, tl.size(), 1)[tl.rank()]:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    out["explicit_groups_digest"] = digest([p.detach() for p in model.parameters()])
    tl.shutdown()
    return out


def case_torch_training_cuda(comm, steps: int = 6) -> dict:
    """CUDA gradients through the device path (every rank on GPU 0: IPC between processes)."""
    tl.init(comm, backend="auto")
    out = {}
    for mode, micro, kwargs in (("plain", 1, {}), ("bpps2", 2, {})):
        mine = distributed_weights(steps, micro, device="cuda", **kwargs)
        ref = reference_weights(steps, tl.size(), micro)
        out[mode] = {"max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(mine, ref)),
                     "digest": digest(mine)}
    tl.shutdown()
    return out


def case_torch_optimizer_state(comm, device: str = "cpu") -> dict:
    """Adam after a step on each rank's own data (so every rank's moments differ), then root 1's state
    broadcast: every rank ends with root's moments and step counts, on its own parameters' device,
    and what travels between ranks is in host memory."""
    torch.set_num_threads(1)
    tl.init(comm)
    root = 1 % comm.size
    model = tiny_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = batches(0, comm.size, 1)[comm.rank][0]
    torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
    opt.step()
    opt.step()  # (two steps: the step counts differ from a fresh optimizer's too)
    mine = [[t.detach().cpu().clone() for _, t in sorted(s.items())] for s in opt.state_dict()["state"].values()]
    roots = comm.allgather(mine)[root]
    sent = []
    real = tl._rt.current().broadcast_object

    def watched(obj, root_rank):
        sent.append(obj)
        return real(obj, root_rank)

    tl._rt.current().broadcast_object = watched
    try:
        tl.broadcast_optimizer_state(opt, root_rank=root)
    finally:
        del tl._rt.current().broadcast_object
    after = opt.state_dict()["state"]
    out = {"equal_to_root": all(torch.equal(a.cpu(), b) for s, r in zip(after.values(), roots)
                                for a, b in zip((t for _, t in sorted(s.items())), r)),
           "differed_before": any(not torch.equal(a, b) for m, r in zip(mine, roots) for a, b in zip(m, r)),
           "moments_on_param_device": all(str(s[k].device) == str(p.device)
                                          for p, s in zip(model.parameters(), after.values())
                                          for k in ("exp_avg", "exp_avg_sq")),
           "sent_devices": sorted({str(t.device) for obj in sent for t in _tensors(obj)}),
           "states": len(after)}
    tl.shutdown()
    return out


def _tensors(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def case_torch_collectives(comm) -> dict:
    torch.set_num_threads(1)
    tl.init(comm)
    r, n = tl.rank(), tl.size()
    res = {}
    x = torch.arange(10, dtype=torch.float32) + r
    res["allreduce_avg"] = tl.allreduce(x).tolist()
    res["allreduce_sum_bf16"] = tl.allreduce(x.to(torch.bfloat16), op=tl.Sum).float().tolist()
    y = x.clone()
    tl.allreduce_(y, op=tl.Max)
    res["allreduce_inplace_max"] = y.tolist()
    h = tl.allreduce_async(torch.full((3,), float(r)), name="async.a", op=tl.Sum)
    res["async"] = tl.synchronize(h).tolist()
    g = tl.grouped_allreduce([torch.ones(2) * r, torch.ones(3, dtype=torch.float64) * r], op=tl.Sum)
    res["grouped"] = [t.tolist() for t in g]
    res["allgather"] = tl.allgather(torch.full((r + 1, 2), r, dtype=torch.int64)).tolist()
    b = torch.full((4,), float(r))
    tl.broadcast_(b, root_rank=n - 1)
    res["broadcast"] = b.tolist()
    res["broadcast_obj"] = tl.broadcast_object({"rank": r}, root_rank=0)
    nc = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous, in place
    tl.allreduce_(nc, op=tl.Sum)
    res["noncontig"] = nc.tolist()
    res["topology"] = [tl.size(), tl.local_size(), tl.local_rank(), tl.cross_size()]
    # Horovod's prescale and postscale factors
    res["scaled"] = tl.allreduce(x, op=tl.Sum, prescale_factor=2.0, postscale_factor=0.25).tolist()
    z = x.clone()
    tl.allreduce_(z, prescale_factor=3.0)
    res["scaled_inplace"] = z.tolist()
    z = x.clone()  # reduced in place straight into z (no copy), then scaled
    tl.allreduce_(z, op=tl.Sum, postscale_factor=0.5)
    res["postscaled_inplace"] = z.tolist()
    zi = torch.arange(5, dtype=torch.int64) + int(r == 0)  # in place, an integer average: the truncated mean
    tl.allreduce_(zi)
    res["int_avg_inplace"] = zi.tolist()
    z0 = torch.tensor(float(r + 1))  # 0-d, in place
    tl.allreduce_(z0, op=tl.Sum)
    res["scalar_inplace"] = z0.item()
    res["inplace_returns_it"] = [tl.allreduce_(t, op=tl.Sum) is t for t in (z0, torch.ones(2))]
    leaf = torch.full((3,), float(r), requires_grad=True)  # a leaf that requires grad, reduced in place
    with torch.no_grad():
        tl.allreduce_(leaf, op=tl.Sum, name="leaf.inplace")
    res["leaf_inplace"] = [leaf.tolist(), leaf.requires_grad]
    zs = [torch.ones(2) * r, torch.ones(3) * r]
    tl.grouped_allreduce_(zs, op=tl.Sum, postscale_factor=2.0)
    res["postscaled_grouped_inplace"] = [t.tolist() for t in zs]
    res["scaled_int"] = tl.allreduce(torch.arange(5, dtype=torch.int64) + r, op=tl.Sum,
                                     postscale_factor=0.5).tolist()
    res["scaled_grouped"] = [t.tolist() for t in tl.grouped_allreduce([torch.ones(2) * r, torch.ones(1) * r],
                                                                      op=tl.Sum, postscale_factor=2.0)]
    # Horovod's positional order: allreduce(t, average, name, compression, op, pre, post), the in-place
    # and async ones (t, average, name, op, pre, post) (a positional 2.0 was taken for a compression)
    one = torch.ones(2)
    res["positional"] = [tl.allreduce(one, None, "pos.a", tl.Compression.none, tl.Sum, 2.0, 0.5).tolist(),
                         tl.allreduce_(one.clone(), None, "pos.b", tl.Sum, 2.0).tolist(),
                         tl.synchronize(tl.allreduce_async(one, None, "pos.c", tl.Sum, 1.0, 3.0)).tolist(),
                         [t.tolist() for t in tl.grouped_allreduce([one], None, "pos.d", tl.Compression.none,
                                                                   tl.Sum, 2.0)]]
    # two threads synchronizing one handle: an integer average is finished once (it was divided twice)
    import threading

    for _ in range(5):
        handle = tl.allreduce_async(torch.tensor([10, 20, 30]) * (r + 1))
        got: list = []
        threads = [threading.Thread(target=lambda h=handle, out=got: out.append(tl.synchronize(h)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        res.setdefault("threads", []).append([g.tolist() for g in got])
    w = torch.ones(3, requires_grad=True)
    tl.allreduce(w, op=tl.Sum, name="scaled.grad", prescale_factor=2.0, postscale_factor=3.0).sum().backward()
    res["scaled_grad"] = w.grad.tolist()
    try:
        tl.allreduce(x, average=True, op=tl.Sum)
        res["both_ops"] = ""
    except ValueError as exc:
        res["both_ops"] = str(exc)
    from tunelab.errors import TunelabError

    try:
        tl.allreduce(torch.ones(3 + (r == n - 1)), name="bad.shape")
        res["mismatch"] = ""
    except TunelabError as exc:
        res["mismatch"] = f"{type(exc).__name__}: {exc}"
    res["after_mismatch"] = tl.allreduce(torch.ones(2), name="good.after", op=tl.Sum).tolist()
    tl.shutdown()  # the mismatch failed only its own call: nothing left to report
    return res


def _step_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    """This rank's loss on its share of step ``step``'s batch."""
    x, y = batches(step, tl.size(), 1)[tl.rank()][0]
    return torch.nn.functional.cross_entropy(model(x), y)


def _same_weights(comm, model: torch.nn.Module) -> bool:
    """Whether every rank holds the same weights, bit for bit."""
    return len(set(comm.allgather(digest([p.detach().clone() for p in model.parameters()])))) == 1


def case_torch_optimizer_misuse(comm) -> dict:
    """The DistributedOptimizer's refusals, each followed by a correct step on the same optimizer: a
    gradient computed twice before step() (ungrouped, and grouped), zero_grad() while gradients are
    being reduced; and step() after 1 of 2 accumulated passes, which Horovod allows (the gradient is
    what was accumulated, divided by 2).  Returns each error and, after each, whether a normal step left
    every rank with the same weights."""
    torch.set_num_threads(1)
    tl.init(comm)
    out: dict = {"errors": {}, "same_after": {}}

    loss, same = _step_loss, functools.partial(_same_weights, comm)

    def attempt(key: str, action) -> None:
        try:
            action()
            out["errors"][key] = ""
        except RuntimeError as exc:
            out["errors"][key] = str(exc)

    # (a sum keeps Horovod's wait in step(): a second backward or a zero_grad() before it is refused; an
    # average waits when each backward pass ends, and a second pass adds to the reduced gradients)
    for key, kwargs in (("twice", {"op": tl.Sum}), ("twice_grouped", {"groups": 1, "op": tl.Sum}),
                        ("zero_grad", {"op": tl.Sum}), ("twice_average", {}),
                        ("partial", {"backward_passes_per_step": 2}), ("submit_fails", {}),
                        ("group_submit_fails", {"groups": 1}),
                        ("predivided_submit_fails", {"gradient_predivide_factor": 2.0}),
                        ("accumulated_submit_fails", {"backward_passes_per_step": 2})):
        model = tiny_model()
        opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), load_profile=False, **kwargs)
        passes = kwargs.get("backward_passes_per_step", 1)
        if key in ("twice", "twice_grouped"):
            loss(model, 0).backward()
            attempt(key, lambda m=model: loss(m, 1).backward())
            opt.synchronize()  # what was submitted is reduced; the optimizer starts clean
            opt.step()
            # The refused pass had already added its gradient into a tensor being reduced in place (a
            # post-accumulate hook runs after the sum), before or after this rank's engine read or
            # wrote it: the misused step's weights may differ between ranks.  A script that goes on
            # re-broadcasts them; what is checked is that the next step reduces alike everywhere.
            tl.broadcast_parameters(model.state_dict(), root_rank=0)
        elif key.endswith("submit_fails"):  # the first submit raises: step() must submit it again
            import tunelab.torch.optimizer as optimizer_module

            name = "grouped_allreduce_async" if key.startswith("group") else "allreduce_async_"
            real, calls = getattr(optimizer_module, name), []

            def flaky(*args, real=real, calls=calls, **kw):
                calls.append([t.data_ptr() for t in (args[0] if isinstance(args[0], list) else [args[0]])])
                if len(calls) == 1:
                    raise RuntimeError("injected submit failure")
                return real(*args, **kw)

            setattr(optimizer_module, name, flaky)
            # a plain gradient goes straight to the coordinator's single-tensor submit: fail that too
            from tunelab import runtime as tl_runtime

            coordinator = tl_runtime.current().coordinator
            real_one = coordinator.submit_one

            def flaky_one(name, view, op, real=real_one, calls=calls):
                calls.append([view.__array_interface__["data"][0]])
                if len(calls) == 1:
                    raise RuntimeError("injected submit failure")
                return real(name, view, op)

            coordinator.submit_one = flaky_one
            try:
                if passes > 1:  # the failure ends the last pass early: that step is refused, zero_grad starts over
                    loss(model, 0).backward()
                attempt(key, lambda m=model: loss(m, 0).backward())
                if passes > 1:
                    out["errors"][key + "_step"] = ""
                    try:
                        opt.step()
                    except RuntimeError as exc:
                        out["errors"][key + "_step"] = str(exc)
                    opt.zero_grad()
                else:
                    opt.synchronize()  # the failed gradient goes out again, scaled once
                    out["grads_averaged"] = out.get("grads_averaged", {})
                    out["grads_averaged"][key] = _averaged(comm, model, loss, calls[0])
                    opt.step()
            finally:
                setattr(optimizer_module, name, real)
                del coordinator.submit_one
            out["same_after"][key + "_first"] = same(model)
        elif key == "twice_average":  # both passes' gradients, averaged: the mean of their sums over ranks
            twin = [a + b for a, b in zip(_averaged_grads(comm, model, 0), _averaged_grads(comm, model, 1))]
            loss(model, 0).backward()
            attempt(key, lambda m=model: loss(m, 1).backward())
            out["twice_average_reduced"] = all(torch.allclose(p.grad, w, rtol=1e-5, atol=1e-7)
                                               for p, w in zip(model.parameters(), twin))
            opt.step()
        elif key == "zero_grad":
            loss(model, 0).backward()
            attempt(key, opt.zero_grad)
            opt.step()
        else:  # partial: step() after 1 of 2 passes reduces what was accumulated (Horovod: not rescaled)
            import copy

            twin = copy.deepcopy(model)
            loss(model, 0).backward()
            attempt(key, opt.synchronize)
            loss(twin, 0).backward()
            everyone = comm.allgather([q.grad.clone() for q in twin.parameters()])
            want = [sum(g[i] for g in everyone) / len(everyone) for i in range(len(everyone[0]))]
            out["partial_reduced"] = all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
            opt.step()
        opt.zero_grad()
        for _ in range(passes):
            loss(model, 2).backward()
        opt.step()
        out["same_after"][key] = same(model)
    tl.shutdown()
    return out


def case_torch_optimizer_recovery(comm) -> dict:
    """What a training script meets besides misuse, each followed by a normal step that must leave every
    rank with the same weights: an LR scheduler made before the optimizer is wrapped (the scheduler
    patches the optimizer's ``step``); a step skipped after an explicit synchronize() (a GradScaler that
    found inf); a reduction whose wait raises; a layer that one of 2 accumulated passes skips.  (A 50 ms
    cycle: a step that does not wait for its reductions reads gradients still being reduced.)"""
    torch.set_num_threads(1)
    tl.init(comm, cycle_time_ms=50.0)
    out: dict = {"errors": {}, "same_after": {}}

    loss, same = _step_loss, functools.partial(_same_weights, comm)

    def wrap(model: torch.nn.Module, base: torch.optim.Optimizer, **kwargs):
        return tl.DistributedOptimizer(base, named_parameters=model.named_parameters(), load_profile=False, **kwargs)

    # an LR scheduler made on the optimizer before wrapping it
    import warnings

    model = tiny_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(base, 1, gamma=0.5)
    opt = wrap(model, base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            loss(model, step).backward()
            opt.step()
            sched.step()
            out["same_after"][f"scheduler_{step}"] = same(model)
    out["scheduler_lr"] = opt.param_groups[0]["lr"]
    out["scheduler_warnings"] = [str(w.message) for w in caught]

    # synchronize(), the step skipped, zero_grad(): the next step must reduce its own gradients
    model = tiny_model()
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss(model, 0).backward()
    opt.synchronize()
    opt.zero_grad()  # (no step: a GradScaler skips it when the gradients hold inf)
    loss(model, 1).backward()
    opt.step()
    out["same_after"]["skipped_step"] = same(model)

    # a reduction whose wait raises on every rank (as a RankMismatchError does): step() raises once, and
    # the optimizer takes the next step
    # (injected where the hooks hand gradients over: the coordinator's single-tensor submit)
    from tunelab import runtime as tl_runtime

    model = tiny_model()
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    coordinator = tl_runtime.current().coordinator
    real, calls = coordinator.submit_one, []

    class Failing:
        def wait(self):
            raise RuntimeError("injected reduction failure")

    def flaky(*args, **kw):
        calls.append(1)
        return Failing() if len(calls) == 1 else real(*args, **kw)

    coordinator.submit_one = flaky
    try:
        where = "backward"  # (an average's reductions are waited for when the backward pass ends)
        try:
            loss(model, 0).backward()
            where = "step"
            opt.step()
            out["errors"]["failed_wait"] = ""
        except RuntimeError as exc:
            out["errors"]["failed_wait"] = str(exc)
            out["errors"]["failed_wait_from"] = where
    finally:
        del coordinator.submit_one
    out["errors"]["failed_wait_calls"] = len(calls)
    opt.zero_grad()
    loss(model, 1).backward()
    opt.step()
    out["same_after"]["failed_wait"] = same(model)

    # a layer that the second of 2 accumulated passes skips (its gradient: the first pass's)
    model = tiny_model()
    opt = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
    name, first = next(iter(model.named_parameters()))
    loss(model, 0).backward()
    x, y = batches(1, tl.size(), 1)[tl.rank()][0]  # the second pass with the first layer's weight detached
    skipped = torch.func.functional_call(model, {name: first.detach()}, (x,))
    torch.nn.functional.cross_entropy(skipped, y).backward()
    opt.step()
    out["same_after"]["skipped_layer"] = same(model)
    # ... and frozen for the second pass (its first pass's gradient is sent when that pass ends)
    opt.zero_grad()
    loss(model, 0).backward()
    first.requires_grad_(False)
    loss(model, 1).backward()
    first.requires_grad_(True)
    opt.step()
    out["same_after"]["frozen_layer"] = same(model)
    opt.zero_grad()
    for step in range(2):
        loss(model, step).backward()
    opt.step()
    out["same_after"]["after_skipped_layer"] = same(model)
    tl.shutdown()
    return out


def _averaged(comm, model: torch.nn.Module, loss, failed: list[int]) -> bool:
    """Whether the reduced gradients whose submit failed (by address) are the average over ranks of the
    local gradients of the same step (recomputed on a copy; with 2 ranks the average is exact)."""
    import copy

    twin = copy.deepcopy(model)
    for q in twin.parameters():
        q.grad = None
    loss(twin, 0).backward()
    everyone = comm.allgather([q.grad.clone() for q in twin.parameters()])
    want = [sum(g[i] for g in everyone) / len(everyone) for i in range(len(everyone[0]))]
    mine = [(p.grad, w) for p, w in zip(model.parameters(), want) if p.grad.data_ptr() in failed]
    return bool(mine) and all(torch.equal(g, w) for g, w in mine)


def case_knob_churn(comm, steps: int = 200, ranks_per_node: int | None = None) -> dict:
    """Deterministic mode (one group, no group fusion): gradients while rank 0 changes knobs every
    step must be bitwise those of a fixed-knob run."""
    torch.set_num_threads(1)
    digests = {}
    rng = np.random.default_rng(5)
    for churn in (False, True):
        tl.init(comm, group_fusion=False, ranks_per_node=ranks_per_node, segment_bytes=4096)
        model = tiny_model()
        opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      groups=[list(model.parameters())])
        h = hashlib.sha256()
        for step in range(steps):
            if churn and tl.rank() == 0:
                tl.set_knobs(fusion_threshold_bytes=int(rng.choice([0, 256, 4096, 1 << 20])),
                             cycle_time_ms=float(rng.choice([0.1, 0.5, 2.0])),
                             segment_bytes=int(rng.choice([4096, 8192, 1 << 20])),
                             oneshot_max_bytes=int(rng.choice([0, 1 << 20])))
            opt.zero_grad()
            for x, y in batches(step % 7, tl.size(), 1)[tl.rank()]:
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.synchronize()
            for p in model.parameters():
                h.update(p.grad.numpy().tobytes())
            opt.step()
        changes = len(tl._rt.current().coordinator.knob_changes)
        tl.shutdown()
        digests["churn" if churn else "fixed"] = h.hexdigest()
        digests[f"changes_{churn}"] = changes
    return digests


def case_torch_dead_rank(comm) -> dict:
    """The last rank dies in the middle of training; the others must not hang."""
    import os

    torch.set_num_threads(1)
    tl.init(comm, timeout_s=20)
    model = tiny_model()
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(10_000):
        if step == 3 and tl.rank() == tl.size() - 1:
            os._exit(9)
        opt.zero_grad()
        for x, y in batches(step % 5, tl.size(), 1)[tl.rank()]:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {}


def case_torch_autoload(comm, env_home: str) -> dict:
    """A job without a profile logs that; after a profile is stored, a new optimizer loads it."""
    import contextlib
    import io
    import os

    os.environ["TUNELAB_HOME"] = env_home
    torch.set_num_threads(1)
    logs = []
    for attempt in range(2):  # two jobs: the second starts after a profile was stored
        tl.init(comm, cycle_time_ms=7.0)  # pinned explicitly: must survive the profile
        rt = tl._rt.current()
        model = tiny_model()  # a fresh model each time (same shapes, so the same signature)
        if attempt == 1 and tl.rank() == 0:
            from tunelab.profiles import ProfileStore

            store = ProfileStore()
            key = rt.profile_key(tl.model_signature(model), "torch")
            pid = store.upsert_profile(key, "test hardware", {}, "tiny")
            store.set_best(pid, {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0,
                                 "segment_bytes": 1 << 16}, 125.0, 100.0, 0.01, "test")
        comm.Barrier()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model_name="tiny")
        logs.append(buf.getvalue().strip())
        for x, y in batches(0, tl.size(), 1)[tl.rank()]:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()  # a step later, the knobs have been applied at a cycle
        knobs = rt.engine.knobs.as_dict()
        again = io.StringIO()
        with contextlib.redirect_stdout(again):  # the same model again in this job: no second lookup
            tl.DistributedOptimizer(torch.optim.SGD(tiny_model().parameters(), lr=0.1), model_name="tiny")
        logs.append(again.getvalue().strip())
        tl.shutdown()
    return {"first": logs[0], "second": logs[2], "repeat": logs[3], "knobs": knobs}


def case_torch_retune(comm, env_home: str) -> dict:
    """A job that loads its profile with the retune setting, whose loaded knobs turn slow after a while
    (every step under them sleeps): the watch re-opens the search, locks again, and writes that lock and
    its blocks back to the store for the next job."""
    import contextlib
    import io
    import os
    import time

    os.environ["TUNELAB_HOME"] = env_home
    torch.set_num_threads(1)
    loaded = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    import dataclasses

    from tunelab.tuning import watch
    # this job's steps take milliseconds: watched blocks of a second would outlast the test, so it
    # keeps the plan's 3-step blocks
    watch.WATCH_PLAN = dataclasses.replace(watch.WATCH_PLAN, block_seconds=None)
    tl.init(comm, retune=True)
    rt = tl._rt.current()
    model = tiny_model()
    if tl.rank() == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        pid = store.upsert_profile(rt.profile_key(tl.model_signature(model), "torch"), "test hardware", {}, "tiny")
        store.set_best(pid, loaded, 125.0, 100.0, 0.01, "tune-run", gain_interval=(1.25, 1.1, 1.4))
        # the tune run's default, measured at 4 samples a step: 400 samples/s over 10 steps in 0.1 s
        store.record_trial(pid, rt.config.knobs.as_dict(), 400.0, 0.01, 10, 0.1, "tune-run", "default")
    comm.Barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model_name="tiny")
        for step in range(400):
            opt.zero_grad()
            for x, y in batches(step % 5, tl.size(), 1)[tl.rank()]:
                torch.nn.functional.cross_entropy(model(x), y).backward()
            knobs = rt.engine.knobs
            if step >= 30 and all(getattr(knobs, k) == v for k, v in loaded.items()):
                time.sleep(0.03)  # the loaded configuration has become slow
            else:
                time.sleep(0.005)
            opt.step()
            watch = rt._watch  # rank 0's: every rank stops at the same step
            if comm.bcast(watch is not None and len(watch.driver.decisions) >= 2, root=0):
                break
    result = {"log": out.getvalue(), "steps": step + 1}
    if tl.rank() == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        best = store.best(rt.profile_key(tl.model_signature(model), "torch"))
        mine = [t for t in store.trials(best.profile_id) if t.run_id == best.run_id]
        result.update(best=best.knobs, outcome=best.outcome, run_id=best.run_id, trials=len(mine),
                      decisions=len(rt._watch.driver.decisions),
                      # a block's samples a step as its stored score tells them (the geometric mean rate
                      # times the mean step time: a little over the real number)
                      per_step=[t.score * t.seconds / t.steps for t in mine])
    tl.shutdown()
    return result


def case_torch_retune_edges(comm, env_home: str) -> dict:
    """The retune watch where it must not get in the way (each part trains on every rank and must not
    hang): a profile whose trials are damaged (the watch does not start: one line), a job of two models
    of which one has a profile (only its steps are timed), a second profile loaded while watching (the
    watch ends: one line), and an error inside the watch (one line; training goes on)."""
    import contextlib
    import io
    import os
    import sqlite3

    os.environ["TUNELAB_HOME"] = env_home
    torch.set_num_threads(1)
    tl.init(comm, retune=True)
    rt = tl._rt.current()
    loaded = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    a, b, c = tiny_model(0), torch.nn.Linear(7, 3), torch.nn.Linear(5, 2)
    if tl.rank() == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        for model, name in ((a, "a"), (c, "c")):
            pid = store.upsert_profile(rt.profile_key(tl.model_signature(model), "torch"), "test hardware", {}, name)
            store.set_best(pid, loaded if name == "a" else {**loaded, "cycle_time_ms": 5.0}, 125.0, 100.0, 0.01,
                           "tune-run", gain_interval=(1.25, 1.1, 1.4))
            store.record_trial(pid, loaded, 100.0, 0.01, 3, 0.1, "tune-run", "default")
    comm.Barrier()

    def train(opts: list, models: list, steps: int) -> None:
        for step in range(steps):
            for opt, model in zip(opts, models):
                opt.zero_grad()
                if isinstance(model, torch.nn.Sequential):
                    x, y = batches(step % 5, tl.size(), 1)[tl.rank()][0]
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                else:
                    model(torch.ones(2, model.in_features)).sum().backward()
                opt.step()

    logs, counted = [], []
    if tl.rank() == 0:  # damage a's trial: the watch cannot read them
        with sqlite3.connect(Path(env_home) / "profiles.sqlite") as conn:
            conn.execute("UPDATE trials SET score = -1")
    comm.Barrier()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        opt_a = tl.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), model_name="a")
        train([opt_a], [a], 3)
    logs.append(out.getvalue())
    watched = rt._watch is not None
    if tl.rank() == 0:
        with sqlite3.connect(Path(env_home) / "profiles.sqlite") as conn:
            conn.execute("UPDATE trials SET score = 100.0")
    comm.Barrier()
    rt._profiles_loaded.clear()  # as a new job would: look a up again, now with readable trials
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        a = tiny_model(0)  # (a model of its own for each part: the hooks of an optimizer stay on its model)
        opt_a = tl.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), model_name="a")
        opt_b = tl.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), model_name="b")  # no profile
        train([opt_a, opt_b], [a, b], 12)
        counted.append(rt._watch.steps if rt._watch is not None else None)
        tl.DistributedOptimizer(torch.optim.SGD(c.parameters(), lr=0.1), model_name="c")  # its knobs win
        counted.append(rt._watch is None)
    logs.append(out.getvalue())
    rt._profiles_loaded.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        a = tiny_model(0)
        opt_a = tl.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), model_name="a")
        if rt._watch is not None:
            def broken(elapsed: float) -> None:
                raise RuntimeError("a fault inside the watch")

            rt._watch.driver.step_done = broken
        train([opt_a], [a], 4)
        counted.append(rt._watch is None)
    logs.append(out.getvalue())
    result = {"logs": logs, "counted": counted, "watched_damaged": watched}
    tl.shutdown()
    return result


def case_torch_profile_keys(comm, env_home: str) -> dict:
    """Which stored profile a job finds, and what it says: a model tuned as ``tune`` sees it, trained
    with its parameters in other groups (decay apart from the biases); a profile stored under the
    ordered key of tunelab before 2026-11-28; a best whose interval is damaged; a lookup that raises on
    rank 0 alone (every rank must raise, none wait)."""
    import contextlib
    import io
    import os
    import sqlite3

    from tunelab.torch.optimizer import ordered_model_signature, ordered_parameters_signature

    os.environ["TUNELAB_HOME"] = env_home
    torch.set_num_threads(1)
    tl.init(comm)
    rt = tl._rt.current()
    knobs = {"fusion_threshold_bytes": 1 << 20, "cycle_time_ms": 3.0, "segment_bytes": 1 << 16}
    grouped, old, bad = tiny_model(0), torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(3, 1)), \
        torch.nn.Linear(5, 2)
    if tl.rank() == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        for model, key, name in ((grouped, tl.model_signature(grouped), "grouped"),
                                 (old, ordered_model_signature(old), "old"), (bad, tl.model_signature(bad), "bad")):
            pid = store.upsert_profile(rt.profile_key(key, "torch"), "test hardware", {}, name)
            store.set_best(pid, knobs, 125.0, 100.0, 0.01, "tune-run", gain_interval=(1.25, 1.1, 1.4))
        with sqlite3.connect(Path(env_home) / "profiles.sqlite") as conn:
            conn.execute("UPDATE best SET gain_low = 'x' WHERE profile_id = ?", (pid,))
    comm.Barrier()
    decay = [p for n, p in grouped.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in grouped.named_parameters() if n.endswith("bias")]
    out: dict = {"groups_reorder": ordered_parameters_signature(no_decay + decay) != ordered_model_signature(grouped),
                 "old_keys_differ": tl.model_signature(old) != ordered_model_signature(old)}
    logs = []
    for model, params, name in ((grouped, [{"params": no_decay, "weight_decay": 0.0}, {"params": decay}], "grouped"),
                                (old, old.parameters(), "old"), (bad, bad.parameters(), "bad")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            tl.DistributedOptimizer(torch.optim.SGD(params, lr=0.1, weight_decay=1e-4), model_name=name)
        logs.append(buf.getvalue().strip())
    out["logs"] = logs
    tl.allreduce(torch.ones(2), name="apply")  # (set knobs take effect at the coordinator's next cycle)
    out["knobs"] = {k: v for k, v in rt.engine.knobs.as_dict().items() if k in knobs}
    from tunelab import profiles

    real = profiles.ProfileStore.best
    if tl.rank() == 0:
        def broken(self, key):
            raise RuntimeError("a fault in the store's reader")

        profiles.ProfileStore.best = broken
    try:
        tl.DistributedOptimizer(torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1), model_name="raises")
        out["raised"] = None
    except Exception as exc:  # noqa: BLE001
        out["raised"] = f"{type(exc).__name__}: {exc}"
    profiles.ProfileStore.best = real
    out["after"] = tl.allreduce(torch.ones(2) * (tl.rank() + 1), op=tl.Sum).tolist()  # still usable
    tl.shutdown()
    return out


def case_torch_api_edges(comm) -> dict:
    """Horovod's semantics where they are easy to miss: an integer average with a postscale (one factor,
    one truncation), and reducescatter's gradient (each row's from the rank that kept it)."""
    torch.set_num_threads(1)
    tl.init(comm)
    r = tl.rank()
    out = {}
    x = torch.tensor([7, -7]) if r == 0 else torch.zeros(2, dtype=torch.int64)
    out["int_avg_post"] = tl.allreduce(x, op=tl.Average, postscale_factor=2.0).tolist()
    for op, name in ((tl.Sum, "sum"), (tl.Average, "avg")):
        y = (torch.arange(4.0) + r).requires_grad_()
        z = tl.reducescatter(y, op=op)
        (z * (r + 1)).sum().backward()
        out["rs_" + name] = [z.tolist(), y.grad.tolist()]
    # two sparse embeddings of one shape that backward reaches in another order on each rank (a
    # data-dependent forward): each gathers with its own peer, not with the other embedding
    torch.manual_seed(5)
    e1, e2 = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Embedding(10, 4, sparse=True)
    opt = tl.DistributedOptimizer(torch.optim.SGD([*e1.parameters(), *e2.parameters()], lr=0.1), load_profile=False)

    def loss_of(rank: int, a: torch.nn.Module, b: torch.nn.Module) -> torch.Tensor:
        i1, i2 = torch.tensor([rank, 3]), torch.tensor([7 - rank])
        first, second = (a(i1) * 2.0, b(i2) * 3.0) if rank == 0 else (b(i2) * 3.0, a(i1) * 2.0)
        return first.sum() + second.sum()

    loss_of(r, e1, e2).backward()
    opt.synchronize()
    got = [e1.weight.grad.to_dense(), e2.weight.grad.to_dense()]
    want = [torch.zeros(10, 4), torch.zeros(10, 4)]
    for q in range(tl.size()):  # each rank's own gradients, by autograd in this process, averaged
        a, b = torch.nn.Embedding(10, 4), torch.nn.Embedding(10, 4)
        loss_of(q, a, b).backward()
        want[0] += a.weight.grad / tl.size()
        want[1] += b.weight.grad / tl.size()
    out["sparse_order_diff"] = max(float((g - w).abs().max()) for g, w in zip(got, want))
    tl.shutdown()
    return out


def _averaged_grads(comm, model: torch.nn.Module, step: int) -> list[torch.Tensor | None]:
    """The average over ranks of each trainable parameter's gradient of this rank's loss at ``step``,
    computed by autograd on a copy of ``model`` (None for a frozen one); with 2 ranks the average is exact."""
    import copy

    twin = copy.deepcopy(model)
    for q in twin.parameters():
        q.grad = None
    _step_loss(twin, step).backward()
    everyone = comm.allgather([None if q.grad is None else q.grad.clone() for q in twin.parameters()])
    return [None if g[0] is None else sum(e[i] for e in everyone) / len(everyone)
            for i, g in enumerate(zip(*everyone))]


def _grads_are(model: torch.nn.Module, want: list[torch.Tensor | None]) -> bool:
    return all((w is None and p.grad is None) or (w is not None and p.grad is not None and torch.equal(p.grad, w))
               for p, w in zip(model.parameters(), want))


def case_torch_parameters_that_change(comm) -> dict:
    """What a fine-tuning script does to the parameters after wrapping, against autograd's gradients
    averaged over ranks: a layer frozen (left alone, as plain torch leaves a parameter without a
    gradient: momentum and weight decay do not move it), a layer unfrozen (reduced from then on); an
    encoder's and a decoder's optimizer, no names given, stepping after one backward; a sparse gather
    that fails; and the constructor's refusals.  (A 50 ms cycle: a second submit of a name in flight is
    refused, so two optimizers that sent the same names would fail every time.)"""
    torch.set_num_threads(1)
    tl.init(comm, cycle_time_ms=50.0)
    out: dict = {"errors": {}, "ok": {}}
    same = functools.partial(_same_weights, comm)

    # a layer frozen after wrapping, with momentum and weight decay in play
    model = tiny_model()
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
                                  load_profile=False)
    _step_loss(model, 0).backward()
    opt.step()
    frozen = list(model[0].parameters())
    for p in frozen:
        p.requires_grad_(False)
    before = [p.detach().clone() for p in frozen]
    opt.zero_grad()
    want = _averaged_grads(comm, model, 1)
    _step_loss(model, 1).backward()
    opt.synchronize()
    out["ok"]["frozen_grads"] = _grads_are(model, want)
    opt.step()
    out["ok"]["frozen_unmoved"] = all(torch.equal(p, b) for p, b in zip(frozen, before))
    out["ok"]["frozen_same"] = same(model)

    # a layer frozen when the optimizer is made and unfrozen later (named: its name is used)
    model = tiny_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  load_profile=False)
    _step_loss(model, 0).backward()
    opt.step()
    for p in model[0].parameters():
        p.requires_grad_(True)
    for step in (1, 2):  # the step it is unfrozen in (no hook yet), and the next (hooked)
        opt.zero_grad()
        want = _averaged_grads(comm, model, step)
        _step_loss(model, step).backward()
        opt.synchronize()
        out["ok"][f"unfrozen_grads_{step}"] = _grads_are(model, want)
        opt.step()
    out["ok"]["unfrozen_same"] = same(model)

    # an encoder's and a decoder's optimizer over one model, neither given names
    model = tiny_model()
    enc, dec = model[:3], model[3:]
    opt_enc = tl.DistributedOptimizer(torch.optim.SGD(enc.parameters(), lr=0.1), load_profile=False)
    opt_dec = tl.DistributedOptimizer(torch.optim.SGD(dec.parameters(), lr=0.1), load_profile=False)
    try:
        for step in range(2):
            opt_enc.zero_grad()
            opt_dec.zero_grad()
            want = _averaged_grads(comm, model, step)
            _step_loss(model, step).backward()
            opt_enc.synchronize()
            opt_dec.synchronize()
            out["ok"][f"two_optimizers_grads_{step}"] = _grads_are(model, want)
            opt_enc.step()
            opt_dec.step()
        out["errors"]["two_optimizers"] = ""
    except RuntimeError as exc:
        out["errors"]["two_optimizers"] = str(exc)
    out["ok"]["two_optimizers_same"] = same(model)
    del opt_enc, opt_dec

    # a sparse gather that fails on every rank: step() raises, and the optimizer takes the next step
    import tunelab.torch.optimizer as tl_optimizer

    torch.manual_seed(3)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = tl.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), load_profile=False)
    real = tl_optimizer.allgather

    def failing(*args, **kwargs):
        raise RuntimeError("injected gather failure")

    tl_optimizer.allgather = failing
    try:
        try:  # (an average's gathers run when the backward pass ends)
            emb(torch.tensor([tl.rank(), 4])).sum().backward()
            opt.step()
            out["errors"]["sparse_gather"] = ""
        except RuntimeError as exc:
            out["errors"]["sparse_gather"] = str(exc)
    finally:
        tl_optimizer.allgather = real
    try:
        opt.zero_grad()
        out["errors"]["zero_grad_after_failed_gather"] = ""
    except RuntimeError as exc:
        out["errors"]["zero_grad_after_failed_gather"] = str(exc)
    emb(torch.tensor([tl.rank() + 5])).sum().backward()
    opt.synchronize()
    want = torch.zeros(10, 4)
    for q in range(tl.size()):
        want[q + 5] += 1.0 / tl.size()
    out["ok"]["sparse_after_failure"] = torch.equal(opt.param_groups[0]["params"][0].grad.to_dense(), want)
    opt.step()

    # the constructor's refusals, and names as a dict
    model = tiny_model()
    for key, kwargs in (("names_not_pairs", {"named_parameters": model.parameters()}),
                        ("names_of_strings", {"named_parameters": ["0.weight", "0.bias"]})):
        try:
            tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), load_profile=False, **kwargs)
            out["errors"][key] = ""
        except TypeError as exc:
            out["errors"][key] = str(exc)
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), load_profile=False,
                                  named_parameters=dict(model.named_parameters()))
    try:
        tl.DistributedOptimizer(opt, load_profile=False)
        out["errors"]["wrapped_twice"] = ""
    except TypeError as exc:
        out["errors"]["wrapped_twice"] = str(exc)
    want = _averaged_grads(comm, model, 0)
    _step_loss(model, 0).backward()
    opt.synchronize()
    out["ok"]["names_as_dict"] = _grads_are(model, want)
    opt.step()
    tl.shutdown()
    return out


def case_torch_between_backward_and_step(comm) -> dict:
    """Code that reads the gradients between ``backward()`` and ``step()``, as plain torch scripts do,
    against autograd's gradients averaged over ranks: torch.amp's GradScaler (an inf on one rank makes
    every rank skip that step and lower its scale alike; its unscale_ reads the reduced gradients), a
    closure's backward (SGD, and LBFGS calling it several times), and a GAN's two optimizers, whose
    generator pass sends gradients of the discriminator's parameters too."""
    torch.set_num_threads(1)
    tl.init(comm, timeout_s=20.0)
    out: dict = {"errors": {}, "ok": {}}
    same = functools.partial(_same_weights, comm)

    model = tiny_model()
    opt = tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), load_profile=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    try:
        for step in range(3):
            opt.zero_grad()
            before = [p.detach().clone() for p in model.parameters()]
            want = _averaged_grads(comm, model, step)
            loss = _step_loss(model, step)
            if step == 1 and tl.rank() == 1:
                loss = loss * float("inf")  # (this rank's gradients overflow)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if step != 1:
                out["ok"][f"amp_unscaled_grads_{step}"] = all(
                    torch.allclose(p.grad, w, rtol=1e-5, atol=1e-7) for p, w in zip(model.parameters(), want))
            scaler.step(opt)
            scaler.update()
            moved = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
            out["ok"][f"amp_step_{step}"] = moved == (step != 1) and same(model)
            out["ok"][f"amp_scale_{step}"] = len(set(comm.allgather(scaler.get_scale()))) == 1
        out["amp_scale"] = scaler.get_scale()
        out["errors"]["amp"] = ""
    except Exception as exc:  # noqa: BLE001 - the error is the result
        out["errors"]["amp"] = f"{type(exc).__name__}: {exc}"

    for name in ("sgd", "lbfgs"):
        model = tiny_model()
        base = (torch.optim.SGD(model.parameters(), lr=0.1) if name == "sgd"
                else torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3))
        opt = tl.DistributedOptimizer(base, load_profile=False)
        try:
            for step in range(2):
                want = _averaged_grads(comm, model, step)
                seen = []

                def closure(step=step, model=model, opt=opt, seen=seen):
                    opt.zero_grad()
                    loss = _step_loss(model, step)
                    loss.backward()
                    seen.append([p.grad.clone() for p in model.parameters()])
                    return loss

                before = [p.detach().clone() for p in model.parameters()]
                opt.step(closure)
                if name == "sgd":  # one closure call: the step is the averaged gradient's
                    out["ok"][f"closure_sgd_{step}"] = all(
                        torch.allclose(b - 0.1 * w, p, rtol=1e-5, atol=1e-6)
                        for b, w, p in zip(before, want, model.parameters()))
                else:  # the first call's gradients (at the weights before the step) are the average
                    out["ok"][f"closure_lbfgs_{step}"] = all(
                        torch.allclose(g, w, rtol=1e-5, atol=1e-7) for g, w in zip(seen[0], want))
                out["ok"][f"closure_{name}_same_{step}"] = same(model)
            out["errors"][f"closure_{name}"] = ""
        except Exception as exc:  # noqa: BLE001
            out["errors"][f"closure_{name}"] = f"{type(exc).__name__}: {exc}"

    torch.manual_seed(5)
    gen, disc = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    opt_g = tl.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), load_profile=False)
    opt_d = tl.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1), load_profile=False)
    try:
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + tl.rank())
            noise, real = torch.randn(4, 3, generator=g), torch.randn(4, 4, generator=g)
            opt_d.zero_grad()
            (disc(gen(noise).detach()).mean() - disc(real).mean()).backward()
            opt_d.step()
            opt_g.zero_grad()
            (-disc(gen(noise)).mean()).backward()  # (reaches the discriminator's parameters too)
            opt_g.step()
        out["ok"]["gan_same"] = same(gen) and same(disc)
        out["errors"]["gan"] = ""
    except Exception as exc:  # noqa: BLE001
        out["errors"]["gan"] = f"{type(exc).__name__}: {exc}"

    # two optimizers, each with a layer no rank uses, whose blocks the ranks run in different orders, or
    # one of which a rank does not run at all: every optimizer sends its rest before any waits (each
    # waiting in turn, a rank waited for zeros its peer sent only after its own first wait)
    torch.manual_seed(7)
    blocks = [torch.nn.Linear(4, 4) for _ in range(4)]
    opts = [tl.DistributedOptimizer(torch.optim.SGD([*blocks[2 * i].parameters(), *blocks[2 * i + 1].parameters()],
                                                    lr=0.1), load_profile=False) for i in range(2)]
    for layout in ("crossed", "skipped"):
        try:
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(tl.rank()))
            a, b = blocks[0], blocks[2]
            y = (b(a(x)) if tl.rank() == 0 else a(b(x))) if layout == "crossed" else (b(x) if tl.rank() == 0 else a(b(x)))
            y.sum().backward()
            for o in opts:
                o.step()
                o.zero_grad()
            out["ok"][f"two_optimizers_{layout}"] = all(same(m) for m in blocks)
            out["errors"][f"two_optimizers_{layout}"] = ""
        except Exception as exc:  # noqa: BLE001
            out["errors"][f"two_optimizers_{layout}"] = f"{type(exc).__name__}: {exc}"

    # an embedding with sparse gradients that rank 1 does not use in step 1: it sends an empty sparse
    # gradient (dense zeros there met the other rank's gathers, and stalled), and the step gets rank 0's
    # gradient over 2, as autograd computes it
    import copy

    torch.manual_seed(6)
    emb, head = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1)
    opt = tl.DistributedOptimizer(torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1),
                                  load_profile=False)
    try:
        for step in range(3):
            opt.zero_grad()
            skip = step == 1 and tl.rank() == 1
            twin, twin_head = copy.deepcopy(emb), copy.deepcopy(head)
            if not skip:
                twin_head(twin(torch.tensor([1, 2 + tl.rank()]))).sum().backward()
            local = torch.zeros(10, 3) if skip else twin.weight.grad.to_dense()
            want = sum(comm.allgather(local)) / tl.size()
            h = torch.ones(2, 3) if skip else emb(torch.tensor([1, 2 + tl.rank()]))
            head(h).sum().backward()
            got = emb.weight.grad
            out["ok"][f"sparse_{step}"] = got.is_sparse and torch.allclose(got.to_dense(), want)
            opt.step()
        out["ok"]["sparse_same"] = same(emb)
        out["errors"]["sparse"] = ""
    except Exception as exc:  # noqa: BLE001
        out["errors"]["sparse"] = f"{type(exc).__name__}: {exc}"
    tl.shutdown()
    return out


from mpi_torch_parity_cases import (  # noqa: F401  (dispatched by mpi_cases.py)
    case_torch_inplace_autograd,
    case_torch_optimizer_lifecycle,
    case_torch_optimizer_options,
    case_torch_parity,
)


def case_torch_profile_setting(comm, env_home: str) -> dict:
    """Jobs with nowhere to look for the store (no HOME, no passwd entry, no TUNELAB_HOME), and jobs under
    each profile setting: an id of another world size's profile, an id of another model's profile,
    ``load_profile=False`` with an id, and off (from TUNELAB_PROFILE) with the job's own profile stored."""
    import contextlib
    import io
    import os
    import pwd
    import time

    from tunelab.knobs import Knobs
    from tunelab.profiles import ProfileKey

    torch.set_num_threads(1)
    out: dict = {}

    def build(model, name, **kwargs):
        """(rank 0's log, what was raised) of building the model's optimizer, and the knobs after a cycle."""
        buf = io.StringIO()
        raised = None
        with contextlib.redirect_stdout(buf):
            try:
                tl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model_name=name, **kwargs)
            except Exception as exc:  # noqa: BLE001
                raised = f"{type(exc).__name__}: {exc}"
        tl.allreduce(torch.ones(1), name=f"apply.{name}")  # (set knobs take effect at the coordinator's next cycle)
        knobs = tl._rt.current().engine.knobs.as_dict()
        return buf.getvalue().strip(), raised, {k: knobs[k] for k in ("cycle_time_ms", "segment_bytes")}

    # no home to find the store under: a warning on rank 0, default knobs, no rank fails
    saved = {k: os.environ.pop(k) for k in ("HOME", "TUNELAB_HOME", "XDG_DATA_HOME", "TUNELAB_PROFILE")
             if k in os.environ}
    real_getpwuid = pwd.getpwuid

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    pwd.getpwuid = no_entry
    try:
        tl.init(comm)
        out["no_home"] = build(tiny_model(), "tiny")
        tl.shutdown()
    finally:
        pwd.getpwuid = real_getpwuid
        os.environ.update(saved)
    os.environ["TUNELAB_HOME"] = env_home

    model = tiny_model()
    tl.init(comm)
    rt = tl._rt.current()
    signature = tl.model_signature(model)
    ids = {}
    if tl.rank() == 0:
        from tunelab.profiles import ProfileStore

        store = ProfileStore()
        for name, key, knobs in (
                ("bigger", ProfileKey(rt.profile_key(signature, "torch").hardware_hash, signature, "torch", 4),
                 Knobs(cycle_time_ms=2.0)),
                ("other", rt.profile_key("other-model-sig", "torch"), Knobs(cycle_time_ms=3.0, segment_bytes=1 << 16)),
                ("own", rt.profile_key(signature, "torch"), Knobs(cycle_time_ms=5.0))):
            ids[name] = store.upsert_profile(key, "test hardware", {}, name)
            store.set_best(ids[name], knobs.as_dict(), 125.0, 100.0, 0.01, "tune-run", gain_interval=(1.25, 1.1, 1.4))
    ids = comm.bcast(ids, root=0)
    out["ids"] = ids
    tl.shutdown()

    start = time.monotonic()
    tl.init(comm, profile=ids["bigger"])  # another world size's: refused on every rank, at once
    out["bigger"] = build(model, "tiny")
    out["bigger_s"] = time.monotonic() - start
    tl.shutdown()

    tl.init(comm, profile=ids["other"])  # another model's: warned, loaded; load_profile=False still wins
    out["not_loaded"] = build(tiny_model(1), "tiny", load_profile=False)
    out["other"] = build(model, "tiny")
    out["other_again"] = build(torch.nn.Linear(3, 2), "second")  # (once a job)
    tl.shutdown()

    os.environ["TUNELAB_PROFILE"] = "off"  # the job's own profile is stored: not looked up
    try:
        tl.init(comm)
        out["off"] = build(model, "tiny")
        out["off_again"] = build(torch.nn.Linear(3, 2), "second")
        tl.shutdown()
    finally:
        del os.environ["TUNELAB_PROFILE"]
    return out
