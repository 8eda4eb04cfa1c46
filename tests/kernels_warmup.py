"""Compile every CPU kernel specialisation the engine uses (all dtypes), filling Numba's disk cache."""

import numpy as np
from tunelab.kernels import ReduceOp, get_backend

from tunelab.dtypes import dtype_from_name, supported_names


def warm() -> None:
    k = get_backend("cpu")
    for name in supported_names():
        dt = dtype_from_name(name)
        a = np.ones(8, dt)
        b = np.ones(8, dt)
        k.reduce(a.ctypes.data, np.array([a.ctypes.data, b.ctypes.data]), 8, dt, ReduceOp.SUM)
        k.copy_table(np.array([[a.ctypes.data, b.ctypes.data, a.nbytes]]))
        k.scale_copy_table(np.array([[a.ctypes.data, b.ctypes.data, a.size]]), dt, 2 if dt.kind in "iu" else 0.5)
    f = np.ones(8, np.float32)
    for name in ("float16", "bfloat16"):
        h = np.ones(8, dtype_from_name(name))
        k.cast(f, h)
        k.cast(h, f)
