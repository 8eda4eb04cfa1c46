"""Torch tensors <-> what the engine and MPI read, without copies where possible; Compression."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..dtypes import bfloat16 as _np_bfloat16
from ..errors import TunelabError


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (no copy)."""
    if t.device.type != "cpu":
        raise TunelabError(f"tensor on {t.device}: expected a CPU tensor here")
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_np_bfloat16())
    return t.numpy()


def from_numpy(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and device holding ``a``."""
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(a).to(like.device)


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array of ``t`` on the host (a view when ``t`` already is one)."""
    return to_numpy(t.detach().contiguous().cpu())


def engine_view(t: torch.Tensor) -> Any:
    """What the engine reduces, without copying: a numpy view of a CPU tensor, a device buffer of
    a CUDA tensor (through ``__cuda_array_interface__``; bfloat16, which the interface cannot
    describe, through its int16 view)."""
    if t.device.type == "cpu":
        return to_numpy(t)
    if t.device.type != "cuda":
        raise TunelabError(f"tensor on {t.device}: tunelab reduces CPU and CUDA tensors")
    from ..engine.device import DeviceBuffer, device_buffer

    if t.requires_grad:  # (a tensor that requires no gradient is its own detached view)
        t = t.detach()
    dtype = device_dtype(t.dtype)
    if t.is_contiguous():
        # what the interface would say, read from the tensor itself: torch builds the interface in
        # Python (tens of microseconds, on every gradient of every step)
        return DeviceBuffer(t.data_ptr(), t.numel(), dtype, tuple(t.shape), t)
    if t.dtype == torch.bfloat16:
        buf = device_buffer(t.view(torch.int16))
        return dataclasses.replace(buf, dtype=np.dtype(_np_bfloat16()), owner=t)
    return dataclasses.replace(device_buffer(t), owner=t)


def device_dtype(dtype: torch.dtype) -> np.dtype:
    """The engine's element type of a CUDA tensor of ``dtype``; TypeError, as for a host tensor, for a
    type it does not reduce.  Decided here, by torch's own dtype, and not by the tensor's
    ``__cuda_array_interface__``: that reads ``uint16`` as bfloat16 (CuPy's arrays, which have no
    bfloat16, hold it so), and a torch.uint16 gradient would be summed as bfloat16 bits."""
    found = _DEVICE_DTYPES.get(dtype)
    if found is None:
        from ..dtypes import supported_names

        raise TypeError(f"tunelab cannot reduce dtype {str(dtype).removeprefix('torch.')}; "
                        f"supported: {', '.join(supported_names())}")
    return found


# The engine's element types by torch dtype (bfloat16 as tunelab's numpy bfloat16).
_DEVICE_DTYPES: dict[torch.dtype, np.dtype] = {
    torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
    torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64), torch.bfloat16: np.dtype(_np_bfloat16())}


class _NoneCompressor:
    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _FP16Compressor:
    """Send floating tensors as float16; restore their dtype afterwards."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    none = _NoneCompressor
    fp16 = _FP16Compressor
