"""``join()``: uneven data across ranks, as in Horovod."""

from __future__ import annotations

from .. import runtime as _rt


def join(device: int = -1) -> int:
    """Declare that this rank has no more batches.  Until every rank has joined, this rank contributes
    zeros to the allreduces the others still run (their gradients, grouped or not; averages still divide
    by ``size()``, as in Horovod), then returns the rank that joined last.  ``device`` is accepted for
    Horovod's signature.  Only the allreduce family runs while ranks are joined (host tensors)."""
    return _rt.current().coordinator.join()
