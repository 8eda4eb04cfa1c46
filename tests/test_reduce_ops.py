"""The reduction arguments the framework adapters share: Horovod's op/average pair and its scale factors."""

import math

import numpy as np
import pytest

from tunelab.reduce_ops import Average, Sum, resolve_op, scale_factors


@pytest.mark.parametrize("pre,post", [(1.0, 1.0), (2, 0.5), (np.float32(0.25), 3), (1e308, 1e308), (-0.0, 5.0)])
def test_finite_scale_factors_come_back_as_floats(pre, post):
    got = scale_factors(pre, post)
    assert got == (float(pre), float(post)) and all(type(f) is float for f in got)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "2", None, True, [1.0]])
@pytest.mark.parametrize("where", ["pre", "post"])
def test_a_scale_factor_that_is_not_a_finite_number_is_refused(bad, where):
    args = (bad, 1.0) if where == "pre" else (1.0, bad)
    with pytest.raises(ValueError, match=f"{where}scale_factor must be a finite number"):
        scale_factors(*args)


def test_infinities_of_opposite_sign_are_refused_too():
    with pytest.raises(ValueError, match="prescale_factor must be a finite number"):
        scale_factors(math.inf, -math.inf)


def test_op_and_average():
    assert resolve_op(None) == Average and resolve_op(None, False) == Sum and resolve_op(Sum) == Sum
    with pytest.raises(ValueError, match="not both"):
        resolve_op(Sum, average=True)
