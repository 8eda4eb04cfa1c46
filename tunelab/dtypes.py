"""The element types the engine reduces, with stable codes used in rank agreement."""

from __future__ import annotations

import numpy as np

_NAMES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
_CODES = {name: code for code, name in enumerate(_NAMES, start=1)}


def bfloat16() -> np.dtype:
    import ml_dtypes  # light import, but only needed where bf16 is used

    return np.dtype(ml_dtypes.bfloat16)


def supported_names() -> tuple[str, ...]:
    return _NAMES


def dtype_from_name(name: str) -> np.dtype:
    """numpy dtype for one of the supported names; ValueError naming the choices otherwise."""
    if name == "bfloat16":
        return bfloat16()
    if name not in _CODES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {', '.join(_NAMES)}")
    return np.dtype(name)


_CODE_BY_DTYPE: dict[np.dtype, int] = {}


def dtype_code(dtype: np.dtype) -> int:
    """Stable small integer for ``dtype``; TypeError for types the engine does not reduce."""
    code = _CODE_BY_DTYPE.get(dtype)
    if code is not None:
        return code
    dt = np.dtype(dtype)
    if not dt.isnative:  # (its name is the native type's: its bytes are not)
        raise TypeError(f"tunelab cannot reduce dtype {dt.str} (non-native byte order); convert it first "
                        "(array.astype(array.dtype.newbyteorder('=')))")
    code = _CODES.get(dt.name)
    if code is not None:
        _CODE_BY_DTYPE[dtype] = code
    if code is None:
        raise TypeError(f"tunelab cannot reduce dtype {np.dtype(dtype).name}; "
                        f"supported: {', '.join(_NAMES)}")
    return code


def dtype_name_from_code(code: int) -> str:
    if code == 0:  # what a rank holding a type the engine does not reduce agrees with (engine._safe_code)
        return "an unsupported dtype"
    return _NAMES[code - 1] if 1 <= code <= len(_NAMES) else f"?{code}"


FLOAT_CODES = frozenset(_CODES[n] for n in ("float16", "bfloat16", "float32", "float64"))


def is_floating(dtype: np.dtype) -> bool:
    return _CODES.get(np.dtype(dtype).name) in FLOAT_CODES
