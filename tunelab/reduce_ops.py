"""Reduction names shared by the framework adapters (Horovod's ``Average``/``Sum``/``Min``/``Max``)."""

from __future__ import annotations

import math
import numbers

import numpy as np

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"


def resolve_op(op: str | None, average: bool | None = None) -> str:
    """The reduction for an ``op=``/legacy ``average=`` pair; Average when neither is given, and
    ValueError for both (as Horovod: ``op`` replaces ``average``, and a call naming both may mean either)."""
    if average is not None and op is not None:
        raise ValueError("pass op or the older average, not both (op=Average or op=Sum replaces average=)")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op


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
