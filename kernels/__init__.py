"""tunelab kernels: pack/unpack (batched copy tables), reduce, scale and half casts.

One interface (:class:`KernelBackend`), several back ends.  ``get_backend("cpu")``
returns the Numba CPU kernels, ``"numba-cuda"`` and ``"cupy"`` the GPU ones, ``"auto"``
the best that runs here.  Importing this package does not import Numba or CuPy: back
ends load on first use.
"""

from __future__ import annotations

from .base import HALF_KINDS, KernelBackend, ReduceOp

_BACKENDS: dict[str, KernelBackend] = {}


BACKEND_NAMES = ("cpu", "numba-cuda", "cupy", "auto")


def get_backend(name: str = "cpu") -> KernelBackend:
    """The kernel back end called ``name``: ``cpu``, ``numba-cuda``, ``cupy`` or ``auto``.

    ``auto`` prefers CuPy (NVRTC-compiled kernels) when it imports and sees a device, then numba-cuda
    when a device is present, else the CPU.  A GPU back end that cannot run here raises ImportError or
    RuntimeError with a one-line reason.
    """
    if name == "auto":
        name = _BACKENDS["auto"].name if "auto" in _BACKENDS else _auto_name()
        _BACKENDS["auto"] = get_backend(name)
    if name not in _BACKENDS:
        if name == "cpu":
            from .cpu import CpuBackend

            _BACKENDS[name] = CpuBackend()
        elif name == "numba-cuda":
            from .numba_cuda import NumbaCudaBackend

            _BACKENDS[name] = NumbaCudaBackend()
        elif name == "cupy":
            from .cupy_backend import CupyBackend

            _BACKENDS[name] = CupyBackend()
        else:
            raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
    return _BACKENDS[name]


def register_backend(name: str, backend: KernelBackend) -> KernelBackend | None:
    """Make ``get_backend(name)`` return ``backend`` in this process (an instrumented or alternative
    implementation, e.g. for tests); returns the one it replaces, if any."""
    if name not in BACKEND_NAMES[:-1]:
        raise ValueError(f"unknown kernel backend {name!r}; available: {', '.join(BACKEND_NAMES[:-1])}")
    previous = _BACKENDS.get(name)
    _BACKENDS[name] = backend
    _BACKENDS.pop("auto", None)
    return previous


def _auto_name() -> str:
    """The best back end this process can run; probing imports the GPU libraries, so only on demand."""
    for candidate in ("cupy", "numba-cuda"):
        try:
            get_backend(candidate)
        except (ImportError, RuntimeError):
            continue
        return candidate
    return "cpu"


__all__ = ["BACKEND_NAMES", "HALF_KINDS", "KernelBackend", "ReduceOp", "get_backend", "register_backend"]
