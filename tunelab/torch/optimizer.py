"""``tunelab.torch.DistributedOptimizer``: gradient allreduce overlapped with backward.

The returned optimizer is an instance of a subclass of the user's optimizer class (so
``isinstance`` checks and LR schedulers keep working).  A post-accumulate-grad hook on
every parameter counts backward passes; on the ``backward_passes_per_step``-th it
submits that gradient's allreduce right away (or, for parameters in a group, the whole
group once its last member is ready).  ``step()`` waits for the reductions, then runs the
wrapped optimizer.  Gradients are averaged over ranks *and* over the accumulated passes,
so an update equals the one a single process would make on all the samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import torch as tt


class _DistributedMixin:
    def _tl_setup(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
                  compression: type, backward_passes_per_step: int, op: str,
                  groups: int | Sequence[Sequence[torch.nn.Parameter]] | None) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._tl_names = _parameter_names(params, named_parameters)
        self._tl_groups = _parameter_groups(params, groups)
        self._tl_group_of = {p: gi for gi, members in enumerate(self._tl_groups) for p in members}
        self._tl_params = params
        self._tl_compression = compression
        self._tl_passes = backward_passes_per_step
        self._tl_op = op
        self._tl_counts = {p: 0 for p in params}
        self._tl_handles: dict[torch.nn.Parameter, tt.Handle] = {}
        self._tl_waiting: dict[int, set[torch.nn.Parameter]] = {gi: set() for gi in range(len(self._tl_groups))}
        self._tl_synchronized = False
        self._tl_hooks = [p.register_post_accumulate_grad_hook(self._tl_hook) for p in params]

    def _tl_hook(self, p: torch.nn.Parameter) -> None:
        if p in self._tl_handles:
            raise RuntimeError(f"gradient of {self._tl_names[p]!r} computed more than "
                               f"backward_passes_per_step={self._tl_passes} times before step()")
        self._tl_counts[p] += 1
        if self._tl_counts[p] == self._tl_passes:
            self._tl_submit(p)

    def _tl_submit(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if self._tl_passes > 1:
            p.grad.div_(self._tl_passes)
        gi = self._tl_group_of.get(p)
        if gi is None:
            self._tl_handles[p] = tt.allreduce_async_(p.grad, name=f"grad.{self._tl_names[p]}",
                                                      op=self._tl_op, compression=self._tl_compression)
            return
        waiting = self._tl_waiting[gi]
        waiting.add(p)
        members = self._tl_groups[gi]
        if len(waiting) == len(members):
            handle = tt.grouped_allreduce_async([q.grad for q in members], name=f"grad.group{gi}",
                                                op=self._tl_op, compression=self._tl_compression, inplace=True)
            for q in members:
                self._tl_handles[q] = handle
            waiting.clear()

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce.  Parameters that got no gradient this step are reduced
        as zeros, so every rank reduces the same tensors."""
        for p in self._tl_params:
            if p in self._tl_handles:
                continue
            if self._tl_counts[p] not in (0, self._tl_passes):
                raise RuntimeError(f"step() after {self._tl_counts[p]} of backward_passes_per_step="
                                   f"{self._tl_passes} backward passes for {self._tl_names[p]!r}")
            self._tl_counts[p] = self._tl_passes
            self._tl_submit(p)
        for handle in {id(h): h for h in self._tl_handles.values()}.values():
            handle.wait()
        self._tl_handles.clear()
        self._tl_counts = {p: 0 for p in self._tl_params}
        self._tl_synchronized = True

    def step(self, closure: Any = None) -> Any:
        if not self._tl_synchronized:
            self.synchronize()
        self._tl_synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._tl_handles:
            raise RuntimeError("zero_grad() called after backward() but before step() or synchronize(): "
                               "gradients are still being reduced")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def _parameter_names(params: list[torch.nn.Parameter],
                     named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None) -> dict:
    if named_parameters is None:
        return {p: f"param.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("named_parameters contains duplicate names")
    by_param = {p: n for n, p in named}
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameters are not in named_parameters "
                         f"(first: index {missing[0]})")
    return {p: by_param[p] for p in params}


def _parameter_groups(params: list[torch.nn.Parameter],
                      groups: int | Sequence[Sequence[torch.nn.Parameter]] | None) -> list[list]:
    if groups is None:
        return []
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        k = min(groups, len(params))
        return [params[i * len(params) // k:(i + 1) * len(params) // k] for i in range(k)]
    known = set(params)
    out = [list(g) for g in groups]
    seen: set = set()
    for g in out:
        for p in g:
            if p not in known:
                raise ValueError("groups contain a tensor that is not a trainable parameter of the optimizer")
            if p in seen:
                raise ValueError("a parameter appears in more than one group")
            seen.add(p)
    return [g for g in out if g]


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: type = tt.Compression.none, backward_passes_per_step: int = 1,
                         op: str = tt.Average,
                         groups: int | Sequence[Sequence[torch.nn.Parameter]] | None = None,
                         load_profile: bool = True, model_name: str = "") -> Any:
    """Wrap ``optimizer`` so gradients are allreduced across ranks before each ``step()``.

    With ``load_profile`` (collective), the best knobs stored by ``tunelab tune`` for this hardware,
    model (its parameters' shapes) and world size are applied, logged in one line on rank 0;
    knobs set explicitly or through ``TUNELAB_*`` variables win."""
    base = optimizer.__class__
    body = {k: v for k, v in _DistributedMixin.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(base.__name__, (base,), body)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # same param groups, state and hyper-parameters
    wrapped._tl_setup(named_parameters, compression, backward_passes_per_step, op, groups)
    if load_profile:
        from . import runtime

        runtime.current().load_profile(tt.parameters_signature(wrapped._tl_params), "torch", model_name)
    return wrapped
