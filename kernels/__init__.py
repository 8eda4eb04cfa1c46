"""tunelab kernels: pack/unpack (batched copy tables), reduce, scale and half casts.

One interface (:class:`KernelBackend`), several back ends.  ``get_backend("cpu")``
returns the Numba CPU kernels; GPU back ends register under their own names.
Importing this package does not import Numba: back ends load on first use.
"""

from __future__ import annotations

from .base import HALF_KINDS, KernelBackend, ReduceOp

_BACKENDS: dict[str, KernelBackend] = {}


def get_backend(name: str = "cpu") -> KernelBackend:
    """The kernel back end called ``name`` (``cpu``)."""
    if name not in _BACKENDS:
        if name == "cpu":
            from .cpu import CpuBackend

            _BACKENDS[name] = CpuBackend()
        else:
            raise ValueError(f"unknown kernel backend {name!r}; available: cpu")
    return _BACKENDS[name]


__all__ = ["HALF_KINDS", "KernelBackend", "ReduceOp", "get_backend"]
