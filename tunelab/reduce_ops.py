"""Reduction names shared by the framework adapters (Horovod's ``Average``/``Sum``/``Min``/``Max``)."""

from __future__ import annotations

import math
import numbers

import numpy as np

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
# Horovod's other two: named, so that a script that mentions them runs (``op=hvd.Adasum if
# args.use_adasum else hvd.Average``), and refused in one line where one is asked for
Adasum = "adasum"
Product = "product"
_UNSUPPORTED = {Adasum: "Adasum (adaptive summation)", Product: "Product"}


class ProcessSet:
    """Horovod's process set, as far as tunelab has one: every collective runs on all ranks, so the
    global set (``global_process_set``) is the only one a call takes."""

    def __init__(self, ranks: object = None) -> None:
        self.ranks = ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self is global_process_set else f"ProcessSet({self.ranks!r})"


global_process_set = ProcessSet()


def check_process_set(process_set: object) -> None:
    """ValueError unless ``process_set`` is None or the global one."""
    if process_set is not None and process_set is not global_process_set:
        raise ValueError(f"process_set={process_set!r}: tunelab runs every collective on all ranks (only "
                         "global_process_set, Horovod's default, is supported)")


def predivide_factor(factor: float, op: str) -> float:
    """Horovod's ``gradient_predivide_factor`` f, checked (both adapters): gradients are divided by f
    before the sum, and the sum by ``size() / f`` after (an average all the same, of smaller addends:
    half precision's range).  ValueError unless a number > 0, and other than 1 only with Average."""
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")
    if factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=Average")
    return float(factor)


def check_op(op: str) -> str:
    """``op`` where tunelab reduces with it; ValueError naming Horovod's Adasum or Product otherwise."""
    if op in _UNSUPPORTED:
        raise ValueError(f"op={_UNSUPPORTED[op]} is not supported by tunelab: use Average (Horovod's default), "
                         "Sum, Min or Max")
    return op


def resolve_op(op: str | None, average: bool | None = None) -> str:
    """The reduction for an ``op=``/legacy ``average=`` pair; Average when neither is given, and
    ValueError for both (as Horovod: ``op`` replaces ``average``, and a call naming both may mean either)."""
    if average is not None and op is not None:
        raise ValueError("pass op or the older average, not both (op=Average or op=Sum replaces average=)")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else check_op(op)


def scale_factors(prescale: float, postscale: float) -> tuple[float, float]:
    """Horovod's ``prescale_factor`` and ``postscale_factor`` (a tensor is multiplied by the first before
    the reduction and its result by the second after it), checked: ValueError unless finite numbers."""
    if type(prescale) is float and type(postscale) is float and math.isfinite(prescale + postscale):
        return prescale, postscale  # (the usual call, for every gradient: no abstract-class checks)
    for what, f in (("prescale_factor", prescale), ("postscale_factor", postscale)):
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not math.isfinite(f):
            raise ValueError(f"{what} must be a finite number, got {f!r}")
    return float(prescale), float(postscale)


def is_integer_average(op: str, dtype_name: str) -> bool:
    """Whether this call is Horovod's integer average, which the engine does as a sum (it only averages
    floating dtypes) followed by :func:`integer_average`."""
    return op == Average and dtype_name.startswith(("int", "uint"))


def integer_average(total: np.ndarray, world: int) -> np.ndarray:
    """Horovod's average of integers: the sum times ``1.0 / world`` in double precision, truncated toward
    zero (its CPU and GPU scale kernels assign ``double * int`` to the integer type)."""
    return np.trunc(total.astype(np.float64) * (1.0 / world)).astype(total.dtype)
