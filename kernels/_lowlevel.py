"""Low-level Numba helpers shared by the CPU kernels: raw addresses and bit casts.

The batched kernels take tables of addresses (as their GPU counterparts take
tables of device pointers), so one call can copy or reduce many tensors without
building a Numba typed list on every call.  float16 and bfloat16 are handled as
their uint16 bit patterns, because Numba's CPU target has no half type.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def as_voidptr(typingctx, addr):  # pragma: no cover - compiled by numba
    """An integer address as a ``void*`` for ``numba.carray``."""
    sig = types.voidptr(types.intp)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def f32_from_bits(typingctx, bits):  # pragma: no cover - compiled by numba
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def bits_from_f32(typingctx, value):  # pragma: no cover - compiled by numba
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(inline="always", cache=True)
def f16_to_f32(h):
    """IEEE binary16 bits -> float32 (exact)."""
    h32 = np.int64(h)
    sign = (h32 & 0x8000) << 16
    exp = (h32 >> 10) & 0x1F
    mant = h32 & 0x3FF
    if exp == 0:  # zero or subnormal: mant * 2**-24 is exact in float32
        v = np.float32(mant) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    if exp == 31:  # inf / nan
        return f32_from_bits(np.uint32(sign | 0x7F800000 | (mant << 13)))
    return f32_from_bits(np.uint32(sign | ((exp + 112) << 23) | (mant << 13)))


@njit(inline="always", cache=True)
def f32_to_f16(x):
    """float32 -> IEEE binary16 bits, round to nearest even."""
    f = np.int64(bits_from_f32(np.float32(x)))
    sign = (f >> 16) & 0x8000
    f = f & 0x7FFFFFFF
    if f >= 0x47800000:  # >= 2**16: inf (or nan, kept quiet)
        o = 0x7E00 if f > 0x7F800000 else 0x7C00
    elif f < 0x38800000:  # below 2**-14: subnormal; let the FPU round at 2**-24
        v = f32_from_bits(np.uint32(f)) + np.float32(0.5)
        o = np.int64(bits_from_f32(v)) - 0x3F000000
    else:
        odd = (f >> 13) & 1
        f += 0xFFF - (112 << 23) + odd
        o = f >> 13
    return np.uint16(o | sign)


@njit(inline="always", cache=True)
def bf16_to_f32(h):
    return f32_from_bits(np.uint32(np.int64(h) << 16))


@njit(inline="always", cache=True)
def f32_to_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even (nan stays nan)."""
    f = np.int64(bits_from_f32(np.float32(x)))
    if (f & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16(((f >> 16) | 0x40) & 0xFFFF)
    f += 0x7FFF + ((f >> 16) & 1)
    return np.uint16((f >> 16) & 0xFFFF)
