"""Reduction names shared by the framework adapters (Horovod's ``Average``/``Sum``/``Min``/``Max``)."""

from __future__ import annotations

Average = "average"
Sum = "sum"
Min = "min"
Max = "max"


def resolve_op(op: str | None, average: bool | None = None) -> str:
    """The reduction for an ``op=``/legacy ``average=`` pair; Average when neither is given."""
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op
