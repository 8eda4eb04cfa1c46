"""Keras callbacks with Horovod's names and behaviour (``hvd.callbacks.*`` in ``tunelab.tensorflow.keras``)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from .. import runtime as _rt
from ..reduce_ops import Average
from .ops import broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's weights, and the optimizer's variables, from ``root_rank``: those that
    exist when training starts, and again after the first batch if that batch built more.  Without a
    ``tf.distribute`` strategy Keras builds a model that has no ``Input`` (a subclassed model, a
    ``Sequential`` of layers alone), and its optimizer, only while it traces the first step: at the
    start there is nothing to send, and each rank would train its own random initial weights (Horovod
    broadcasts after the first batch for this reason).

    ``local_variables`` (a variable or a list), or :meth:`register_local_var`: the model's variables
    each rank keeps as its own (Horovod's worker-local variables), left out of the broadcast."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._sent: set[int] | None = None
        self._local: dict[int, Any] = {}  # by id (a Keras 3 variable has no ref(); the dict keeps it alive)
        if local_variables is not None:  # (one variable, or any collection of them)
            one = hasattr(local_variables, "shape") and hasattr(local_variables, "dtype")
            for var in [local_variables] if one else local_variables:
                self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own."""
        self._local[id(var)] = var

    def _parts(self) -> tuple[list[Any], list[Any] | None]:
        opt = getattr(self.model, "optimizer", None)
        built = opt is not None and getattr(opt, "built", False)
        weights = [w for w in self.model.weights if id(w) not in self._local] if self._local else list(self.model.weights)
        return weights, list(opt.variables) if built else None

    def on_train_begin(self, logs: Any = None) -> None:
        # what every rank has built: a rank that resumed from a file (``load_model``, root alone in
        # Horovod's examples) has its optimizer's state, the others build theirs in the first step
        weights, slots = self._parts()
        have = _rt.current().allgather_object((len(weights), slots is not None))
        variables = (weights if len({n for n, _ in have}) == 1 else []) + \
            (slots if slots is not None and all(b for _, b in have) else [])
        broadcast_variables(variables, self.root_rank)
        self._sent = {id(v) for v in variables}

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._sent is None:
            return
        weights, slots = self._parts()  # after a step, built on every rank
        variables = weights + (slots or [])
        if {id(v) for v in variables} != self._sent:
            broadcast_variables(variables, self.root_rank)  # the first step's update is root's for all
        self._sent = None


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics (loss, accuracy, ...) over all ranks before other callbacks see them."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items()  # numbers, numpy's included (an integer count too), not flags
                      if isinstance(v, (numbers.Real, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)))
        _rt.current().check_same(keys, "the metric names to average")
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        out = _rt.current().coordinator.submit(f"metrics.epoch{epoch}", values, op=Average).wait()
        for k, v in zip(keys, out):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in [start_epoch, end_epoch):
    at each epoch's first batch (``staircase``), or every batch at the fractional epoch
    ``epoch + batch / steps_per_epoch``.  A constant ``multiplier`` m means ``m ** (epoch - start_epoch)``
    (Horovod's meaning since 0.23: the rate is ``initial_lr`` when the schedule starts; it was
    ``m ** epoch`` here, a rate ``m ** start_epoch`` too low, silently).

    ``momentum_correction`` is accepted for Horovod's signature but not applied: Keras 3 optimizers
    hold momentum as a constant of the traced train step, which a callback cannot change."""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("LearningRateScheduleCallback needs initial_lr")
        self.initial_lr, self.start_epoch, self.end_epoch = float(initial_lr), start_epoch, end_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier ** (epoch - start_epoch))
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self.current_epoch = 0

    def on_train_begin(self, logs: Any = None) -> None:
        rate = getattr(self.model.optimizer, "learning_rate", None)
        if not hasattr(rate, "assign"):  # (a LearningRateSchedule's rate is a value computed each step)
            raise ValueError(f"{type(self).__name__} sets the optimizer's learning rate, and this optimizer's is "
                             "a schedule: give it a constant rate (the callback schedules it) or drop the callback")
        if not self.staircase and not self.steps_per_epoch:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(f"{type(self).__name__}: pass steps_per_epoch (Keras did not report it)")
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._set_lr(self.initial_lr * self.multiplier(epoch))
        elif not self.staircase:
            self._set_lr(self.initial_lr * self.multiplier(epoch + batch / self.steps_per_epoch))

    def _set_lr(self, lr: float) -> None:
        self.model.optimizer.learning_rate.assign(lr)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``, batch
    by batch (Goyal et al.'s gradual warmup, as Horovod does it: the multiplier at fractional epoch e is
    ``(1 / size) * ((e + 1 / steps_per_epoch) * (size - 1) / warmup_epochs + 1)``)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            n = _rt.size()
            return 1.0 / n * ((epoch + 1.0 / self.steps_per_epoch) * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch, verbose=verbose)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _rt.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(np.asarray(self.model.optimizer.learning_rate)):g}.")
