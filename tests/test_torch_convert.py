"""What element type the engine reads a torch tensor as (tunelab/torch/_convert.py), decided by torch's own
dtype: no GPU needed for the decision (the GPU suite checks it on CUDA tensors)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
def test_the_types_the_engine_reduces_keep_their_type(name):
    from tunelab.dtypes import dtype_from_name
    from tunelab.torch._convert import device_dtype

    assert device_dtype(getattr(torch, name)) == dtype_from_name(name)


@pytest.mark.parametrize("name", ["uint16", "int16", "uint8", "int8", "bool", "complex64"])
def test_other_types_are_refused_by_name_not_read_as_another(name):
    """uint16 above all: through ``__cuda_array_interface__`` it reads as bfloat16 (CuPy's way of holding
    it), so a torch.uint16 tensor on a GPU was summed as bfloat16 bits; on the host it is refused."""
    from tunelab.torch._convert import device_dtype

    with pytest.raises(TypeError, match=f"cannot reduce dtype {name}; supported: float16, bfloat16"):
        device_dtype(getattr(torch, name))
    with pytest.raises(TypeError, match=f"cannot reduce dtype {name}"):  # what a host tensor gets
        from tunelab.engine.engine import check_reducible
        from tunelab.torch._convert import to_numpy

        check_reducible(to_numpy(torch.zeros(2, dtype=getattr(torch, name))).dtype, False)
