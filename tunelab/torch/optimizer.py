"""``tunelab.torch.DistributedOptimizer``: gradient allreduce overlapped with backward.

The returned optimizer is an instance of a subclass of the user's optimizer class (so
``isinstance`` checks and LR schedulers keep working).  A post-accumulate-grad hook on
every parameter counts backward passes; on the ``backward_passes_per_step``-th it
submits that gradient's allreduce right away (or, for parameters in a group, the whole
group once its last member is ready).  With ``op=Average`` (the default) the reductions are waited
for when the backward pass that sent them ends, as torch DDP does, so code between ``backward()``
and ``step()`` (GradScaler's inf check, gradient clipping, a closure's loss) reads reduced gradients;
with ``op=Sum`` ``step()`` waits for them, as in Horovod.  Then ``step()`` runs the wrapped
optimizer.  Gradients are averaged over ranks; the accumulated passes add up, as in Horovod (whose
recipe divides each sub-batch's loss by their count).

Horovod's options: ``gradient_predivide_factor`` f divides gradients by f before the sum and
multiplies by f / size() after it (Average only); ``sparse_as_dense`` turns sparse gradients
(``nn.Embedding(sparse=True)``) dense before the allreduce, and without it they are reduced as Horovod
does, by allgathering their indices and values; ``num_groups`` is ``groups`` as a number;
``skip_synchronize()`` lets ``step()`` follow an explicit ``synchronize()`` (for gradient clipping).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .. import runtime as _rt
from ..reduce_ops import Average, Sum, check_process_set, predivide_factor, resolve_op
from ._convert import Compression, engine_view
from .collectives import allgather
from .ops import Handle, allreduce_async_, grouped_allreduce_async


class _DistributedMixin:
    def _tl_setup(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
                  compression: type, backward_passes_per_step: int, op: str,
                  groups: int | Sequence[Sequence[torch.nn.Parameter]] | None,
                  predivide: float = 1.0, sparse_as_dense: bool = False) -> None:
        op = resolve_op(op)  # (None: Average, as everywhere)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self._tl_predivide = predivide_factor(predivide, op)
        self._tl_sparse_as_dense, self._tl_skip = sparse_as_dense, False
        self._tl_sparse: list[torch.nn.Parameter] = []
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._tl_given_names = _given_names(named_parameters)
        self._tl_names = _parameter_names(params, self._tl_given_names)
        # Every name this optimizer sends starts with this: "grad." for the first DistributedOptimizer a
        # process makes, "grad.opt<k>." for the k-th (an encoder's and a decoder's optimizer stepping after
        # one backward would otherwise both send "grad.param.0", and the engine would pair the two).  Every
        # rank makes its optimizers in the same order, so every rank counts the same k.
        made = self._tl_made = next(_MADE)
        self._tl_prefix = "grad." if made == 1 else f"grad.opt{made}."
        self._tl_groups = _parameter_groups(params, groups)
        self._tl_group_of = {p: gi for gi, members in enumerate(self._tl_groups) for p in members}
        self._tl_params = params
        # the parameters frozen now, which synchronize() checks for a later unfreezing (only these: the
        # check runs every step)
        trainable = set(params)
        self._tl_untracked = [p for g in self.param_groups for p in g["params"] if p not in trainable]
        self._tl_signature = parameters_signature(params)  # the model's, for profiles and the retune watch
        self._tl_compression = compression
        # gradients sent as they are (no compression, no factor on the way): the hook's direct path
        self._tl_direct = compression is Compression.none and self._tl_predivide == 1.0
        self._tl_passes = backward_passes_per_step
        self._tl_op = op
        # An average is linear: a backward pass after the reduction (a second loss before step(), a
        # GAN's generator pass reaching the discriminator's parameters) adds local gradients to
        # reduced ones, and reducing that sum again gives the average of all the passes.  So the
        # reductions are waited for when each backward pass ends (queued on autograd's engine once a
        # pass), and code before step() reads reduced gradients.  A sum is not (the reduced part
        # would be counted once per rank): it keeps Horovod's wait in step().
        self._tl_at_backward_end = op == Average
        self._tl_end_task: int | None = None  # the backward pass (autograd graph task) it ends with
        # One rank in all: the allreduce of a gradient is the gradient (a sum or an average over one
        # rank), so nothing goes to the coordinator.  On a GPU a rank of its own pays for every engine
        # call in host time during backward (the coordinator's thread holds the GIL that the autograd
        # thread needs); here it pays for the hooks' bookkeeping alone.  (Read again at every submit,
        # :meth:`_tl_sends_nothing`: an optimizer may outlive a shutdown and an init of another size.)
        self._tl_skip_alone = True
        # One record per parameter, looked up once per hook (a tensor's hash runs in Python)
        self._tl_slots = {p: _Slot(self._tl_prefix + self._tl_names[p], self._tl_group_of.get(p)) for p in params}
        self._tl_waiting: dict[int, set[torch.nn.Parameter]] = {gi: set() for gi in range(len(self._tl_groups))}
        self._tl_synchronized = False
        self._tl_superseded = False
        self._tl_hooks: list = []
        weakref.finalize(self, _remove_hooks, self._tl_hooks)  # (the list, not self: filled below)
        _take_over(self, params)
        self._tl_hook_all(params)

    def _tl_hook_all(self, params: list[torch.nn.Parameter]) -> None:
        """A post-accumulate-grad hook on each of ``params``, holding this optimizer weakly: the
        parameters outlive it, and a hook holding it would keep a dropped optimizer reducing."""
        me = weakref.ref(self)

        def hook(p: torch.nn.Parameter) -> None:
            opt = me()
            if opt is not None:
                opt._tl_hook(p)

        self._tl_hooks.extend(p.register_post_accumulate_grad_hook(hook) for p in params)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and the new group's trainable parameters are reduced like the others (named
        ``param.<i>`` by their place among the optimizer's parameters unless ``named_parameters``
        named them: every rank must add the same groups)."""
        super(self.__class__, self).add_param_group(param_group)
        added = self.param_groups[-1]["params"]
        self._tl_untracked.extend(p for p in added if not p.requires_grad and p not in self._tl_slots)
        self._tl_adopt([p for p in added if p.requires_grad and p not in self._tl_slots])

    def _tl_adopt(self, new: list[torch.nn.Parameter]) -> None:
        """Reduce the gradients of ``new`` parameters too (a group added, a layer unfrozen): named as
        ``named_parameters`` named them, else ``param.<i>`` by the order they join in."""
        if not new:
            return
        adopted = set(new)
        self._tl_untracked = [p for p in self._tl_untracked if p not in adopted]
        for p in new:
            self._tl_names.setdefault(p, (self._tl_given_names or {}).get(p, f"param.{len(self._tl_params)}"))
            self._tl_params.append(p)
            self._tl_slots[p] = _Slot(self._tl_prefix + self._tl_names[p], None)
        _take_over(self, new)
        self._tl_hook_all(new)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, but into the same ``param_groups`` dicts and ``state`` mapping: an LR scheduler made
        on the optimizer before it was wrapped edits those (torch's would give the wrapper new ones,
        and the scheduler's changes would reach nothing)."""
        if any(slot.submitted for slot in self._tl_slots.values()):
            raise RuntimeError("load_state_dict() called after backward() but before step() or synchronize(): "
                               "gradients are still being reduced")
        groups, state = self.param_groups, self.state
        super(self.__class__, self).load_state_dict(state_dict)
        if len(groups) == len(self.param_groups):
            for old, new in zip(groups, self.param_groups):
                old.clear()
                old.update(new)  # (its "params" is the old group's list)
            self.param_groups = groups
        loaded = dict(self.state)
        state.clear()
        state.update(loaded)
        self.state = state
        self._tl_reset()

    def _tl_hook(self, p: torch.nn.Parameter) -> None:
        slot = self._tl_slots.get(p)
        if slot is None:  # (a parameter a newer optimizer took over: its hook is removed already)
            return
        if slot.submitted or slot.count >= self._tl_passes:  # (the second: its submit raised)
            raise RuntimeError(f"gradient of {self._tl_names[p]!r} computed more than "
                               f"backward_passes_per_step={self._tl_passes} times before step()")
        slot.count += 1
        self._tl_synchronized = False  # a new backward pass: an earlier synchronize() is not this step's
        if self._tl_at_backward_end:
            task = torch._C._current_graph_task_id()
            if self._tl_end_task != task:
                _end_with_backward(self, task)
                self._tl_end_task = task
        if slot.count == self._tl_passes:
            self._tl_submit(p, slot)

    def _tl_submit(self, p: torch.nn.Parameter, slot: _Slot) -> None:
        """Hand ``p``'s gradient over (marked as sent only once it is: a submit that raised is tried
        again by synchronize())."""
        if p.grad is None:  # (no gradient this step: zeros, of the layout its gradients have had)
            p.grad = torch.zeros_like(p) if slot.sparse is None else _empty_sparse(p, *slot.sparse)
        elif p.grad.is_sparse:
            slot.sparse = (p.grad.sparse_dim(), p.grad.dense_dim())
        op = self._tl_sent_op()
        if self._tl_sends_nothing():
            if p.grad.is_sparse and self._tl_sparse_as_dense:
                p.grad = p.grad.to_dense()  # (what the optimizer is given does not depend on the world size)
            if p.grad.is_sparse:  # (coalesced, as the allgather of several ranks leaves it)
                p.grad = p.grad.coalesce()
            slot.submitted = True  # (no predivide factor: it would divide and multiply back by the same f)
            return
        if p.grad.is_sparse:
            if not self._tl_sparse_as_dense:
                self._tl_sparse.append(p)  # reduced by allgather in synchronize(), in parameter order
                slot.submitted = True
                if slot.group is not None:  # its group's dense members go out without it
                    self._tl_group_member(p, slot.group, op)
                return
            p.grad = p.grad.to_dense()
        if self._tl_predivide != 1.0 and not slot.scaled:
            p.grad.div_(self._tl_predivide)
            slot.scaled = True  # (once, if the submit below raises and synchronize() tries again)
        if slot.group is None:
            g = p.grad
            if self._tl_direct and g.dim() and g.is_contiguous():
                # the common case, for every gradient of every step: reduced in place with nothing to
                # undo, so straight to the coordinator (the hook runs on the autograd thread, which
                # on a GPU waits for nothing else: its host time is the step's)
                slot.handle = _rt.current().coordinator.submit_one(slot.name, engine_view(g), op)
            else:
                slot.handle = allreduce_async_(g, name=slot.name, op=op, compression=self._tl_compression)
            slot.submitted = True
            return
        slot.submitted = True  # (its group goes out with its last member)
        self._tl_group_member(p, slot.group, op)

    def _tl_sent_op(self) -> str:
        """The op gradients go out with: a sum where a predivide factor scales them (averaged after)."""
        return Sum if self._tl_predivide != 1.0 else self._tl_op

    def _tl_sends_nothing(self) -> bool:
        """Whether this job has one rank in all, so a gradient is its own allreduce and goes nowhere
        (``_tl_skip_alone`` False sends them all the same: a diagnostic of the coordinator's cost)."""
        return self._tl_skip_alone and _rt.current().topology.size == 1

    def _tl_group_member(self, p: torch.nn.Parameter, gi: int, op: str) -> None:
        """``p`` of group ``gi`` is ready; with the last member, the group's dense gradients go out."""
        waiting = self._tl_waiting[gi]
        waiting.add(p)
        members = self._tl_groups[gi]
        if len(waiting) < len(members):
            return
        dense = [q for q in members if not self._tl_slots[q].frozen and not q.grad.is_sparse]
        if dense:
            try:
                handle = grouped_allreduce_async([q.grad for q in dense], name=f"{self._tl_prefix}group{gi}",
                                                 op=op, compression=self._tl_compression, inplace=True)
            except BaseException:
                for q in dense:  # not sent: synchronize() submits them again (sparse ones stay set aside)
                    self._tl_slots[q].submitted = False
                waiting.difference_update(dense)
                raise
            for q in dense:
                self._tl_slots[q].handle = handle
        waiting.clear()

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce.  Parameters that got no gradient this step are reduced
        as zeros, and those that got fewer than ``backward_passes_per_step`` passes (a layer some
        micro-batches skip, an epoch's last partial accumulation) as what they accumulated, as Horovod
        does: every rank reduces the same tensors.  Parameters frozen since the optimizer was made
        (``requires_grad`` False) are left out, with no gradient made up (the optimizer skips them, as
        without tunelab), and those unfrozen since are reduced from this step on: every rank must freeze
        and unfreeze the same ones.  A reduction that fails raises here once every other one is waited
        for, and leaves the optimizer ready for the next step.  Called again before another backward
        pass, it does nothing (the gradients are reduced already)."""
        self._tl_check_current()
        if self._tl_synchronized:
            return
        self._tl_send_rest()
        self._tl_finish()

    def _tl_send_rest(self) -> None:
        """Submit every gradient not sent yet (synchronize's first half: where several optimizers end a
        backward pass together, each sends its rest before any waits, so no rank waits for a peer that
        waits on another optimizer first)."""
        if any(p.requires_grad for p in self._tl_untracked):
            self._tl_adopt([p for p in self._tl_untracked if p.requires_grad])
        slots = self._tl_slots
        try:
            for p in self._tl_params:
                slot = slots[p]
                if slot.submitted:
                    continue
                if not p.requires_grad and slot.count == 0:  # (frozen; one that counted passes this step
                    slot.submitted = slot.frozen = True  # before its layer was frozen sends what it has)
                    if slot.group is not None:  # its group goes out without it
                        self._tl_group_member(p, slot.group, self._tl_sent_op())
                    continue
                slot.count = self._tl_passes
                self._tl_submit(p, slot)
        except BaseException:
            # what did go out is waited for (a failure of its own resets the step); the submit's error is
            # the one raised, and step() or synchronize() submits what it could not send again
            with contextlib.suppress(BaseException):
                self._tl_drain()
            raise

    def _tl_finish(self) -> None:
        """Wait for the step's reductions and finish them (synchronize's second half)."""
        slots = self._tl_slots
        self._tl_drain()
        try:
            if self._tl_predivide != 1.0 and not self._tl_sends_nothing():
                post = self._tl_predivide / _rt.current().topology.size
                sparse = {id(q) for q in self._tl_sparse}
                for p in self._tl_params:
                    if id(p) not in sparse and not slots[p].frozen:
                        p.grad.mul_(post)
            # in parameter order: the hooks fire in the order backward reaches the parameters, which a
            # data-dependent forward may change from rank to rank (each gather would pair with another's)
            order = {id(q): i for i, q in enumerate(self._tl_params)}
            for p in sorted(self._tl_sparse, key=lambda q: order[id(q)]):
                p.grad = self._tl_sparse_reduce(p)
        finally:  # (a gather that failed leaves the optimizer ready for the next step, as a failed reduction does)
            self._tl_reset()
        self._tl_synchronized = True

    def _tl_drain(self) -> None:
        """Wait for every handle of this step.  If any failed, the first error is raised after all are
        waited for, and the optimizer is reset first (a failed reduction does not leave the next step
        refused); else the caller finishes the step and resets."""
        error: BaseException | None = None
        for handle in {id(s.handle): s.handle for s in self._tl_slots.values() if s.handle is not None}.values():
            try:
                handle.wait()
            except BaseException as exc:  # noqa: BLE001 (re-raised below, after the others)
                error = error or exc
        if error is not None:
            self._tl_reset()
            raise error

    def _tl_reset(self) -> None:
        """Every parameter back to no backward pass counted, nothing sent."""
        self._tl_sparse.clear()
        for slot in self._tl_slots.values():
            slot.count, slot.submitted, slot.scaled, slot.frozen, slot.handle = 0, False, False, False, None
        for waiting in self._tl_waiting.values():
            waiting.clear()

    def _tl_sparse_reduce(self, p: torch.nn.Parameter) -> torch.Tensor:
        """Horovod's sparse allreduce: every rank's (index, value) pairs, gathered; duplicates add up."""
        g = p.grad.coalesce()
        name = self._tl_slots[p].name
        indices = allgather(g.indices().t().contiguous(), name=f"{name}.indices").t()
        values = allgather(g.values().contiguous(), name=f"{name}.values")
        if self._tl_op == Average:
            values = values / _rt.current().topology.size
        return torch.sparse_coo_tensor(indices, values, g.shape, check_invariants=True).coalesce()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize: call ``synchronize()`` yourself first
        (e.g. to clip the reduced gradients)."""
        self._tl_skip = True
        try:
            yield
        finally:
            self._tl_skip = False

    def _tl_check_current(self) -> None:
        if self._tl_superseded:
            raise RuntimeError("this DistributedOptimizer no longer reduces its gradients: a newer one was made "
                               "over the same parameters (use that one)")

    def step(self, closure: Any = None) -> Any:
        """Wait for the step's reductions, then step the wrapped optimizer.  With a ``closure`` (LBFGS),
        the gradients it computes are reduced before the wrapped optimizer reads them, each time it
        calls it."""
        self._tl_check_current()
        if closure is not None:
            closure = _reducing_closure(self, closure)
        elif not self._tl_synchronized and not self._tl_skip:
            self.synchronize()
        self._tl_synchronized = False
        result = super(self.__class__, self).step(closure)
        # the retune watch of this model's loaded profile times its steps (else a no-op)
        _rt.current().step_done(self._tl_signature, "torch")
        return result

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if any(slot.submitted for slot in self._tl_slots.values()):  # (once a step: derived, not counted)
            raise RuntimeError("zero_grad() called after backward() but before step() or synchronize(): "
                               "gradients are still being reduced")
        self._tl_reset()  # the passes counted so far are zeroed with the gradients they summed
        return super(self.__class__, self).zero_grad(*args, **kwargs)


# The optimizers whose gradients the running backward pass counted (held weakly), and whether the one
# callback that ends it is queued.  One callback for all: each optimizer waiting in a callback of its own,
# in the order its first hook fired, could wait on one rank for a peer waiting on another optimizer,
# whose unused parameters' zeros that peer sends only when that wait ends.
_ENDING: list[weakref.ref] = []
_END_TASK: list[int | None] = [None]  # the graph task whose end is queued (a pass that raised never ends)


def _end_with_backward(opt: Any, task: int) -> None:
    """Wait for ``opt``'s reductions when the running backward pass, graph task ``task``, ends
    (autograd's final callbacks, before ``backward()`` returns)."""
    if _END_TASK[0] != task:
        _ENDING.clear()  # (left by a pass that raised: its optimizers' steps were reset or are refused)
        torch.autograd.Variable._execution_engine.queue_callback(_backward_ended)
        _END_TASK[0] = task
    _ENDING.append(weakref.ref(opt))


def _backward_ended() -> None:
    """The backward pass ended: every optimizer it sent gradients of (its last accumulated pass) sends
    the rest of them, and only then waits, all in the order they were made (the same on every rank: a
    sparse gradient's gathers are collectives).  The first error raises from ``backward()``, after the
    others are waited for."""
    opts = [o for o in (ref() for ref in _ENDING) if o is not None]
    _ENDING.clear()
    _END_TASK[0] = None
    ending = []
    for o in sorted({id(o): o for o in opts}.values(), key=lambda o: o._tl_made):
        o._tl_end_task = None
        if not o._tl_superseded and not o._tl_synchronized and any(s.submitted for s in o._tl_slots.values()):
            ending.append(o)
    error: BaseException | None = None
    failed: set[int] = set()
    for stage in ("_tl_send_rest", "_tl_finish"):
        for o in ending:
            if id(o) in failed:
                continue
            try:
                getattr(o, stage)()
            except BaseException as exc:  # noqa: BLE001 (raised below, after every other optimizer's)
                error = error or exc
                failed.add(id(o))  # (its step was reset: the next one starts clean)
    if error is not None:
        raise error


def _reducing_closure(opt: Any, closure: Any) -> Any:
    """``closure`` followed by the wait for the gradients its backward pass sent."""
    def reduced() -> Any:
        loss = closure()
        opt.synchronize()
        return loss

    return reduced


# Each parameter's DistributedOptimizer, by the parameter's id: (the parameter, the optimizer), both held
# weakly (a tensor cannot key a WeakKeyDictionary: its == is elementwise).  A newer optimizer over the
# same parameters takes them over, so re-running ``opt = DistributedOptimizer(...)`` does not leave two
# reducing every gradient.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_MADE = itertools.count(1)  # DistributedOptimizers made in this process (their names' prefix)


def _owner(p: torch.nn.Parameter) -> Any:
    entry = _OWNERS.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def _take_over(opt: Any, params: list[torch.nn.Parameter]) -> None:
    """Make ``opt`` the owner of ``params``; an older optimizer that owned any of them stops reducing
    (its hooks go, and its ``step()`` says why).  Refused while the older one has gradients in flight."""
    older = {id(o): o for o in map(_owner, params) if o is not None and o is not opt}
    for other in older.values():
        if any(slot.submitted for slot in other._tl_slots.values()):
            raise RuntimeError("another DistributedOptimizer over these parameters has gradients in flight: "
                               "call its step() or synchronize() first")
    for other in older.values():
        _remove_hooks(other._tl_hooks)
        other._tl_slots.clear()
        other._tl_params.clear()
        other._tl_superseded = True
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]
    me = weakref.ref(opt)
    for p in params:
        _OWNERS[id(p)] = (weakref.ref(p), me)


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


# torch's load_state_dict() (through __setstate__) wraps a class's ``step`` in its hook runner unless it is
# marked: the wrapped optimizer's own ``step`` runs the step hooks already, after synchronize()
_DistributedMixin.step.hooked = True


class _Slot:
    """A parameter's state between two synchronizations: its allreduce's name and group, the backward
    passes counted, whether its gradient was scaled and went out (submitted, or set aside as sparse, or
    left out as frozen), its handle."""

    __slots__ = ("count", "frozen", "group", "handle", "name", "scaled", "sparse", "submitted")

    def __init__(self, name: str, group: int | None) -> None:
        self.name, self.group = name, group
        self.count, self.submitted, self.scaled, self.frozen = 0, False, False, False
        self.handle: Handle | None = None
        # (sparse dims, dense dims) of its sparse gradients once it has had one (an embedding's): a step
        # that gives it none sends an empty sparse gradient, which the other ranks' gathers expect
        self.sparse: tuple[int, int] | None = None


def _empty_sparse(p: torch.nn.Parameter, sparse_dim: int, dense_dim: int) -> torch.Tensor:
    """A sparse gradient of ``p`` with no entries, laid out as its earlier ones."""
    indices = torch.empty((sparse_dim, 0), dtype=torch.long, device=p.device)
    values = torch.empty((0, *p.shape[sparse_dim:sparse_dim + dense_dim]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=True)


def _given_names(named_parameters: Any) -> dict | None:
    """``named_parameters`` (pairs of a name and a parameter, as ``model.named_parameters()`` gives them,
    or a mapping of names to parameters) as a mapping of parameters to names; None for None."""
    if named_parameters is None:
        return None
    if isinstance(named_parameters, Mapping):
        named_parameters = named_parameters.items()
    usage = ("named_parameters must be (name, parameter) pairs, as model.named_parameters() gives them, "
             "or a dict of names to parameters")
    if isinstance(named_parameters, torch.Tensor | str) or not isinstance(named_parameters, Iterable):
        raise TypeError(f"{usage}; got {type(named_parameters).__name__}")
    named = list(named_parameters)
    for item in named:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"{usage}; got an item of type {type(item).__name__}"
                            + (f" ({type(item[0]).__name__}, {type(item[1]).__name__})"
                               if isinstance(item, tuple | list) and len(item) == 2 else ""))
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("named_parameters contains duplicate names")
    return {p: n for n, p in named}


def _parameter_names(params: list[torch.nn.Parameter], by_param: dict | None) -> dict:
    """Each of ``params``' name: the one given (``by_param``, which must name every one), else
    ``param.<i>`` by its place."""
    if by_param is None:
        return {p: f"param.{i}" for i, p in enumerate(params)}
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


def parameters_signature(params: Sequence[torch.Tensor]) -> str:
    """Identity of a model for tuned profiles: the shapes and dtypes of its trainable parameters, in
    any order, and whether they live on a GPU (a config tuned for the device path is not the host
    path's best).  In any order: ``tune`` sees the model's ``parameters()``, a job the order of its
    optimizer's groups (weight decay apart from the norms and biases, a learning rate per layer), and
    the order of the groups sends nothing differently (gradients are sent as backward makes them)."""
    return _signature(sorted(_entries(params)), params)


def ordered_parameters_signature(params: Sequence[torch.Tensor]) -> str:
    """:func:`parameters_signature` as tunelab computed it before 2026-11-28, in the order given: the
    key of profiles tuned before then, which a job still looks up when the new key has none."""
    return _signature(_entries(params), params)


def _entries(params: Sequence[torch.Tensor]) -> list[str]:
    return [f"{tuple(p.shape)}:{p.dtype};" for p in params]


def _signature(entries: Sequence[str], params: Sequence[torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for entry in entries:
        h.update(entry.encode())
    where = "cuda-" if any(p.is_cuda for p in params) else ""
    return f"{where}{len(params)}p-{h.hexdigest()[:16]}"


def model_signature(model: torch.nn.Module) -> str:
    return parameters_signature([p for p in model.parameters() if p.requires_grad])


def ordered_model_signature(model: torch.nn.Module) -> str:
    """The model's key as tunelab computed it before 2026-11-28 (:func:`ordered_parameters_signature`)."""
    return ordered_parameters_signature([p for p in model.parameters() if p.requires_grad])


def _scheduler_tracked_step(wrapped: Any, original: torch.optim.Optimizer) -> Any:
    """The wrapper's ``step`` as an LR scheduler made on ``original`` tracks it: calling it tells the
    scheduler that the optimizer stepped (its order check reads ``original``)."""
    import functools
    import weakref

    me, origin = weakref.ref(wrapped), weakref.ref(original)

    @functools.wraps(type(wrapped).step)
    def step(*args: Any, **kwargs: Any) -> Any:
        first = origin()
        if first is not None:
            first._opt_called = True
        return type(me()).step(me(), *args, **kwargs)

    step._wrapped_by_lr_sched = True
    return step


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: type = Compression.none, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | Sequence[Sequence[torch.nn.Parameter]] | None = None,
                         sparse_as_dense: bool = False, process_set: Any = None, *,
                         load_profile: bool = True, model_name: str = "") -> Any:
    """Wrap ``optimizer`` so gradients are allreduced across ranks before each ``step()``.  Horovod's
    signature, in its order (``process_set``: the global one only); tunelab's own settings by keyword.

    With ``load_profile`` (collective), the best knobs stored by ``tunelab tune`` for this hardware,
    model (its parameters' shapes) and world size are applied, logged in one line on rank 0;
    knobs set explicitly or through ``TUNELAB_*`` variables win."""
    if hasattr(type(optimizer), "_tl_setup"):
        raise TypeError("this optimizer is a DistributedOptimizer already: wrap the plain optimizer, once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    base = optimizer.__class__
    body = {k: v for k, v in _DistributedMixin.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(base.__name__, (base,), body)
    wrapped = cls.__new__(cls)
    state = dict(optimizer.__dict__)  # same param groups, state and hyper-parameters...
    # ...but not methods set on the instance, which would hide the wrapper's: an LR scheduler made
    # before wrapping replaces the instance's ``step`` by one that steps the unwrapped optimizer
    patched = {name: state.pop(name) for name in list(state) if name in body and callable(state[name])}
    wrapped.__dict__.update(state)
    if getattr(patched.get("step"), "_wrapped_by_lr_sched", False):
        wrapped.step = _scheduler_tracked_step(wrapped, optimizer)
    if num_groups and groups is not None:
        raise ValueError("pass either num_groups or groups, not both")
    check_process_set(process_set)
    wrapped._tl_setup(named_parameters, compression, backward_passes_per_step, op,
                      num_groups or groups, gradient_predivide_factor, sparse_as_dense)
    if load_profile:
        _rt.current().load_profile(wrapped._tl_signature, "torch", model_name,
                                   legacy=ordered_parameters_signature(wrapped._tl_params))
    return wrapped
