import math

from tunelab.workloads.shapes import gradient_shapes, resnet50_parameters


def test_resnet50_has_the_published_parameter_count():
    # 25,557,032 parameters in 161 tensors: the figures torchvision reports for resnet50
    params = resnet50_parameters()
    assert len(params) == 161
    assert sum(math.prod(s) for _, s in params) == 25_557_032
    assert len({name for name, _ in params}) == 161


def test_gradients_come_in_backward_order():
    shapes = gradient_shapes("resnet50")
    assert shapes[0] == (1000,) and shapes[1] == (1000, 2048) and shapes[-1] == (64, 3, 7, 7)
