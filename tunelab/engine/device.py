"""Device tensors: recognising them and seeing them as raw memory, without copies.

:func:`device_buffer` turns any CUDA tensor into a :class:`DeviceBuffer` (address, element count,
dtype): objects with ``__cuda_array_interface__`` (CuPy, Numba, PyTorch CUDA tensors) directly,
DLPack exporters (``__dlpack__``, e.g. TensorFlow GPU tensors through ``tf.experimental.dlpack``)
through ``cupy.from_dlpack``.  The engine moves them through the device path
(:mod:`tunelab.engine.device_path`), whose staging is shared with CUDA IPC
(:mod:`tunelab.engine.device_ipc`).

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) device memory *is* host memory: the whole
device path, kernels included, runs on a machine without a GPU.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import bfloat16
from ..kernels.base import cuda_array_layout

ENV_CUDA_AWARE = "TUNELAB_CUDA_AWARE_MPI"


def simulated() -> bool:
    """Whether Numba's CUDA simulator stands in for a device in this process."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


@dataclass(frozen=True)
class DeviceBuffer:
    """A C-contiguous device tensor seen as raw memory; ``owner`` keeps the memory alive.  ``ready``:
    where the tensor was handed over, ``(event, stream, order, thread)`` for an event recorded then on
    the producer's stream (its number among the marks, and the recording thread), so a call waits
    for the work queued before then and no more; ``(None, stream handle)`` for a producer stream to
    record on when the call starts; None: the owner's current stream, when the call starts."""

    addr: int
    size: int  # elements
    dtype: np.dtype
    shape: tuple[int, ...]
    owner: Any
    ready: Any = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def with_ready(buf: DeviceBuffer, ready: Any) -> DeviceBuffer:
    """``buf`` with ``ready`` set (as ``dataclasses.replace`` would, without its introspection: this
    runs for every gradient a hook submits)."""
    return DeviceBuffer(buf.addr, buf.size, buf.dtype, buf.shape, buf.owner, ready)


def device_buffer(obj: Any) -> DeviceBuffer:
    """``obj`` as a :class:`DeviceBuffer`, without copying; TypeError for host memory.

    Under the simulator, numpy arrays and simulated device arrays count as device memory.
    """
    if isinstance(obj, DeviceBuffer):
        return obj
    found = _interface_buffer(obj)
    if found is None and hasattr(obj, "__dlpack__"):
        found = _dlpack_buffer(obj)
    if found is None and simulated():
        host = getattr(obj, "_ary", obj)  # a simulated device array wraps a numpy array
        if isinstance(host, np.ndarray):
            if not host.flags.c_contiguous:
                raise ValueError("device tensors must be C-contiguous")
            # (uint16 holds bfloat16 bits, as for every array-interface buffer: cuda_array_layout)
            dtype = bfloat16() if host.dtype == np.uint16 else host.dtype
            found = DeviceBuffer(host.ctypes.data, host.size, dtype, host.shape, obj)
    if found is None:
        raise TypeError(f"expected a CUDA tensor (__cuda_array_interface__ or DLPack), "
                        f"got {type(obj).__name__}")
    return found


def _interface_buffer(obj: Any) -> DeviceBuffer | None:
    found = cuda_array_layout(obj, "tunelab")
    if found is None:
        return None
    addr, dtype, count, shape = found
    return DeviceBuffer(addr, count, dtype, shape, obj)


def _dlpack_buffer(obj: Any) -> DeviceBuffer | None:
    try:
        kind, _device = obj.__dlpack_device__()
    except (AttributeError, TypeError):
        return None
    if int(kind) not in (2, 3):  # kDLCUDA, kDLCUDAHost
        return None
    import cupy

    return _interface_buffer(cupy.from_dlpack(obj))


_LIBRARIES: dict[type, str] = {}


def library(owner: Any) -> str:
    """The top-level package of ``owner``'s type ("torch", "cupy", "numba", ...), read once per type
    (it is asked for every gradient a hook submits)."""
    cls = type(owner)
    name = _LIBRARIES.get(cls)
    if name is None:
        name = _LIBRARIES[cls] = cls.__module__.split(".")[0]
    return name


def producer_stream_handle(owner: Any) -> int:
    """The raw ``cudaStream_t`` a tensor's producer queues its work on: the calling thread's current
    stream of the tensor's library (torch's, of the tensor's device; CuPy's), 0 (the legacy default
    stream) for others.  Current streams are per thread: read it in the thread that submits the tensor."""
    module = library(owner)
    if module == "torch":
        return _torch_stream_handle(owner)
    if module == "cupy":
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    return 0


PER_THREAD_STREAM = 2  # cudaStreamPerThread: "the calling thread's default stream", in every thread


def submitted_stream_handle(owner: Any) -> int:
    """:func:`producer_stream_handle` for a tensor handed to another thread (the coordinator's): a
    per-thread default stream cannot be named there, since in the engine's thread the same handle is
    that thread's stream (an event recorded or waited on through it would order nothing of the
    producer's).  UsageError for one."""
    handle = producer_stream_handle(owner)
    if handle == PER_THREAD_STREAM:
        from ..errors import UsageError

        raise UsageError(f"a {library(owner)} tensor produced on the per-thread default stream (e.g. "
                         "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) cannot be ordered by tunelab's background "
                         "thread, where that stream is another one: produce it on a stream of your own "
                         "(cupy.cuda.Stream()) or on the legacy default stream")
    return handle


def _torch_stream_handle(tensor: Any) -> int:
    """torch's current stream of ``tensor``'s device in this thread, as a raw handle.  torch's own
    compiled code reads it through ``torch._C._cuda_getCurrentRawStream`` (one call into C);
    ``torch.cuda.current_stream`` builds a Stream object in Python first, several microseconds on
    every gradient a hook submits.  Builds without the raw reader take the public path."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(tensor.get_device()))
    return int(torch.cuda.current_stream(tensor.device).cuda_stream)


def device_index(owner: Any) -> int | None:
    """The CUDA device a tensor lives on, where its library says (torch, CuPy); None otherwise."""
    module = library(owner)
    if module == "torch":
        return owner.device.index
    if module == "cupy":
        return int(owner.device.id)
    return None


def device_backend_name(configured: str) -> str:
    """The GPU kernel back end for device tensors: the configured one ("cpu" refuses them), or for
    "auto" the best available (CuPy, else numba-cuda; "cpu" when there is none)."""
    if configured in ("cupy", "numba-cuda", "cpu"):
        return configured
    from ..kernels import get_backend

    return get_backend("auto").name


def cuda_aware_mpi(environ: dict[str, str] | None = None) -> bool:
    """Whether MPI may be handed device pointers: ``TUNELAB_CUDA_AWARE_MPI=0/1`` if set, else
    what the library says (Open MPI's ``MPIX_Query_cuda_support``, MPICH's
    ``MPIX_GPU_query_support``); False when it says nothing."""
    env = os.environ if environ is None else environ
    if env.get(ENV_CUDA_AWARE, "").strip():
        return env[ENV_CUDA_AWARE].strip().lower() in ("1", "true", "yes", "on")
    try:
        from mpi4py import MPI

        lib = ctypes.CDLL(MPI.__file__)
    except (ImportError, OSError):
        return False
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query())
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        supported = ctypes.c_int(0)
        if query(ctypes.c_int(0), ctypes.byref(supported)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
            return bool(supported.value)
    return False


def zeros(shape: tuple[int, ...], dtype: np.dtype, backend: str, index: int | None) -> Any:
    """A device array of zeros on device ``index`` (None: the current one), through ``backend``'s library
    (CuPy, else numba-cuda; a simulated device array under the simulator), filled before it returns:
    what a rank that has joined contributes to its peers' device allreduces.  bfloat16, which neither
    library holds, as uint16 zeros (the bits of +0.0), which the engine reads as bfloat16."""
    if np.dtype(dtype).kind == "V" and np.dtype(dtype).itemsize == 2:
        dtype = np.dtype(np.uint16)
    if backend == "cupy" and not simulated():
        import cupy

        with cupy.cuda.Device(cupy.cuda.runtime.getDevice() if index is None else index):
            out = cupy.zeros(shape, dtype=dtype)
            cupy.cuda.get_current_stream().synchronize()  # filled before any other stream reads it
        return out
    from numba import cuda

    host = np.zeros(shape, dtype=dtype)
    if index is None or simulated():
        return cuda.to_device(host)  # a synchronous copy
    with cuda.gpus[index]:
        return cuda.to_device(host)


def empty_like(buf: DeviceBuffer) -> Any:
    """A new device array shaped like ``buf``, of the owner's kind (torch, CuPy, Numba; numpy under
    the simulator)."""
    owner = buf.owner
    module = library(owner)
    if module == "torch":
        import torch

        return torch.empty_like(owner, memory_format=torch.contiguous_format)
    if module == "cupy":
        import cupy

        with cupy.cuda.Device(owner.device.id):  # the owner's GPU, not this thread's current one
            return cupy.empty(buf.shape, dtype=owner.dtype)
    if module == "numba":  # real or simulated device array
        from numba import cuda

        return cuda.device_array(buf.shape, dtype=owner.dtype)
    if simulated():
        return np.empty(buf.shape, dtype=getattr(owner, "dtype", buf.dtype))
    import cupy

    return cupy.empty(buf.shape, dtype=buf.dtype if buf.dtype.kind != "V" else np.uint16)
