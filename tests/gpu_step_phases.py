"""Where a training step's host time goes, plain torch against tunelab's DistributedOptimizer
(a diagnostic for GPU machines, not a test).

    python tests/gpu_step_phases.py plain|tunelab [--switch-us US] [--steps N] [--batch B] [--image S]

One rank, ResNet-50 on the GPU.  Each step is timed on the host in phases: zero_grad, the first
layer's forward, the rest of the forward, backward, the optimizer step, and the wait for the device at
the end; the medians are printed (ms), and for tunelab the engine calls a step took (its gradients
fused into that many allreduces), the host time its gradient hooks took (their sum per step, and per
gradient) and the coordinator's engine calls took (per step), and the coordinator's cycles per step with
the CPU time (not wall time, which includes waits for the GIL) each cycle spends besides its calls.  ``--switch-us`` sets Python's GIL switch
interval first; ``--knob NAME=VALUE`` (repeatable) sets a knob before the first step, e.g.
``--knob cycle_time_ms=100``: with a cycle longer than backward, the gradients wait for ``step()``
and the hooks run with no coordinator work beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np


def main() -> int:
    import torch

    from tunelab.workloads.torch_models import resnet50

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("plain", "tunelab"))
    p.add_argument("--switch-us", type=float, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--device", default="cuda")
    p.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--profile", type=int, default=0, metavar="TOP",
                   help="after the table, the TOP functions the hooks and the coordinator's engine calls "
                        "spend their own time in (cProfile in each thread; it slows them, so not with timings)")
    a = p.parse_args()
    if a.switch_us is not None:
        sys.setswitchinterval(a.switch_us * 1e-6)
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model = resnet50().to(dev)
    x = torch.randn(a.batch, 3, a.image, a.image, device=dev)
    y = torch.randint(0, 1000, (a.batch,), device=dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    spent = {"hook": 0.0, "hooks": 0, "engine": 0.0, "cycles": 0, "cycle_cpu": 0.0, "execute_cpu": 0.0}
    if a.mode == "tunelab":
        import tunelab.torch as tl
        from tunelab import runtime as _rt
        from tunelab.knobs import SPECS
        from tunelab.torch.optimizer import _DistributedMixin

        hook = _DistributedMixin._tl_hook
        # one profiler per thread; from Python 3.12 cProfile watches every thread at once (one tool of
        # sys.monitoring per process), so there one profile covers the measured steps, all threads
        per_thread = a.profile and sys.version_info < (3, 12)
        profiles = {"hooks": cProfile.Profile(), "engine calls": cProfile.Profile()} if per_thread else {}

        def timed_hook(self, p):  # (patched before the optimizer registers its hooks)
            t0 = time.perf_counter()
            prof = profiles.get("hooks")
            if prof is not None:
                prof.enable()  # (this thread's: the autograd thread's)
            try:
                return hook(self, p)
            finally:
                if prof is not None:
                    prof.disable()
                spent["hook"] += time.perf_counter() - t0
                spent["hooks"] += 1

        _DistributedMixin._tl_hook = timed_hook
        from tunelab.engine.coordinator import Coordinator

        cycle, execute = Coordinator._cycle, Coordinator._execute

        def timed_cycle(self):  # the coordinator thread's CPU time (not wall: it waits for the GIL)
            t0 = time.thread_time()
            try:
                return cycle(self)
            finally:
                spent["cycle_cpu"] += time.thread_time() - t0
                spent["cycles"] += 1

        def timed_execute(self, ids):
            t0 = time.thread_time()
            prof = profiles.get("engine calls")
            if prof is not None:
                prof.enable()  # (the coordinator thread's)
            try:
                return execute(self, ids)
            finally:
                if prof is not None:
                    prof.disable()
                spent["execute_cpu"] += time.thread_time() - t0

        Coordinator._cycle, Coordinator._execute = timed_cycle, timed_execute
        tl.init()
        opt = tl.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        # At one rank the optimizer sends nothing (a gradient is its own allreduce); this diagnostic times
        # the coordinator's host cost, what every rank of a larger job pays, so it sends them all the same.
        opt._tl_skip_alone = False
        engine = _rt.current().engine
        batch = engine.allreduce_batch

        def timed_batch(*args, **kwargs):  # (the coordinator's thread looks it up on every call)
            t0 = time.perf_counter()
            try:
                return batch(*args, **kwargs)
            finally:
                spent["engine"] += time.perf_counter() - t0

        engine.allreduce_batch = timed_batch
        if a.knob:
            changes = {}
            for text in a.knob:
                name, _, value = text.partition("=")
                kind = SPECS[name].kind
                changes[name] = value.lower() in ("1", "true", "on") if kind is bool else kind(float(value))
            _rt.current().coordinator.set_knobs(**changes)
    first, rest = model[0], model[1:]

    def step() -> list[float]:
        t = [time.perf_counter()]
        opt.zero_grad()
        t.append(time.perf_counter())
        h = first(x)
        t.append(time.perf_counter())
        loss = torch.nn.functional.cross_entropy(rest(h), y)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t.append(time.perf_counter())
        return list(np.diff(t) * 1e3)

    for _ in range(5):
        step()
    engine = _rt.current().engine if a.mode == "tunelab" else None
    calls = engine._calls if engine is not None else 0
    spent.update(hook=0.0, hooks=0, engine=0.0, cycles=0, cycle_cpu=0.0, execute_cpu=0.0)
    everything = cProfile.Profile() if a.profile and a.mode == "tunelab" and not profiles else None
    if everything is not None:
        everything.enable()
    phases = np.array([step() for _ in range(a.steps)])
    if everything is not None:
        everything.disable()
        profiles["steps (every thread)"] = everything
    med = np.median(phases, axis=0)
    names = ("zero_grad", "first_layer", "forward_rest", "backward", "opt_step", "device_wait")
    fused = ""
    if engine is not None:
        fused = (f"  engine calls/step {(engine._calls - calls) / a.steps:.1f}"
                 f"  hooks/step {spent['hook'] * 1e3 / a.steps:.1f} ms"
                 f" ({spent['hook'] * 1e6 / max(spent['hooks'], 1):.0f} us each)"
                 f"  engine/step {spent['engine'] * 1e3 / a.steps:.1f} ms"
                 f"  cycles/step {spent['cycles'] / a.steps:.1f}"
                 f" ({(spent['cycle_cpu'] - spent['execute_cpu']) * 1e6 / max(spent['cycles'], 1):.0f} us CPU each"
                 " besides the calls)")
        if a.knob:
            fused += "  knobs " + " ".join(a.knob)
    print(f"{a.mode:8s} switch={sys.getswitchinterval() * 1e6:.0f}us  total {np.median(phases.sum(1)):6.1f} ms  "
          + "  ".join(f"{n} {v:5.1f}" for n, v in zip(names, med)) + fused)
    if a.mode == "tunelab":
        tl.shutdown()
        for what, prof in profiles.items():
            _print_profile(what, prof, a.profile, a.steps if what.startswith("steps") else None)
    return 0


def _print_profile(what: str, prof: cProfile.Profile, top: int, entries: int | None) -> None:
    """The ``top`` functions by own time, in microseconds per call of what was profiled (``entries``,
    else its calls counted as the profile's calls of the patched entry point)."""
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # (cc, nc, tottime, cumtime, callers)
    if entries is None:
        entries = max((nc for (_, _, name), (_, nc, *_) in stats.stats.items()
                       if name in ("_tl_hook", "_execute")), default=1)
    total = sum(v[2] for _, v in rows)
    print(f"# {what}: {entries} profiled, {total * 1e6 / entries:.1f} us own time each (under cProfile)")
    for (file, line, name), (_, nc, tt, ct, _) in rows[:top]:
        print(f"  {tt * 1e6 / entries:7.2f} us  {nc / entries:5.1f} calls  {name}  "
              f"{os.path.basename(file)}:{line}")


if __name__ == "__main__":
    sys.exit(main())
