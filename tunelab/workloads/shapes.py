"""Gradient tensor shapes of well-known models, computed from their architecture.

These are the tensors a data-parallel step reduces (one per parameter), in the
order the backward pass produces them (last layer first).  They drive the
fusion benchmark and the gradient-replay workload without importing a framework.
"""

from __future__ import annotations

Shape = tuple[int, ...]


def resnet50_parameters(num_classes: int = 1000) -> list[tuple[str, Shape]]:
    """ResNet-50 (v1.5, as torchvision defines it) parameters in definition order."""
    params: list[tuple[str, Shape]] = [("conv1.weight", (64, 3, 7, 7))]
    params += _bn("bn1", 64)
    inplanes = 64
    for layer, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for block in range(blocks):
            p = f"layer{layer}.{block}."
            params.append((p + "conv1.weight", (planes, inplanes, 1, 1)))
            params += _bn(p + "bn1", planes)
            params.append((p + "conv2.weight", (planes, planes, 3, 3)))
            params += _bn(p + "bn2", planes)
            params.append((p + "conv3.weight", (planes * 4, planes, 1, 1)))
            params += _bn(p + "bn3", planes * 4)
            if block == 0:
                params.append((p + "downsample.0.weight", (planes * 4, inplanes, 1, 1)))
                params += _bn(p + "downsample.1", planes * 4)
            inplanes = planes * 4
    params += [("fc.weight", (num_classes, 2048)), ("fc.bias", (num_classes,))]
    return params


def _bn(prefix: str, channels: int) -> list[tuple[str, Shape]]:
    return [(prefix + ".weight", (channels,)), (prefix + ".bias", (channels,))]


MODELS = {"resnet50": resnet50_parameters}


def gradient_shapes(model: str) -> list[Shape]:
    """Gradient shapes of ``model`` in backward (ready) order."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return [shape for _, shape in reversed(MODELS[model]())]
