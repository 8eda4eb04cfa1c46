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


# VGG-16 (configuration D): output channels of each 3x3 conv, "M" for a 2x2 max pool.
VGG16_CONFIG: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)


def vgg16_parameters(num_classes: int = 1000) -> list[tuple[str, Shape]]:
    """VGG-16 without batch norm, parameters in definition order.

    The names index a flat ``features`` sequence in which every conv is followed by
    its ReLU and every pool takes one slot, then a ``classifier`` sequence of
    linear/ReLU/dropout triples, so they match the torch workload's module layout.
    The classifier reads a 7x7 adaptively pooled map, so the count does not depend on image size.
    """
    params: list[tuple[str, Shape]] = []
    index, channels = 0, 3
    for item in VGG16_CONFIG:
        if item == "M":
            index += 1
            continue
        assert isinstance(item, int)
        params += [(f"features.{index}.weight", (item, channels, 3, 3)), (f"features.{index}.bias", (item,))]
        index, channels = index + 2, item
    for index, (fan_in, fan_out) in zip((0, 3, 6), ((channels * 7 * 7, 4096), (4096, 4096), (4096, num_classes))):
        params += [(f"classifier.{index}.weight", (fan_out, fan_in)), (f"classifier.{index}.bias", (fan_out,))]
    return params


def bert_base_parameters(
    vocab: int = 30522,
    hidden: int = 768,
    layers: int = 12,
    ffn: int = 3072,
    max_len: int = 512,
    num_classes: int = 2,
    segments: int = 2,
) -> list[tuple[str, Shape]]:
    """A BERT-base-like encoder classifier's parameters in definition order.

    Attention keeps separate query/key/value/output projections (one tensor each),
    so the head count changes no shape and is not an argument.
    """
    params: list[tuple[str, Shape]] = [
        ("embeddings.word.weight", (vocab, hidden)),
        ("embeddings.position.weight", (max_len, hidden)),
        ("embeddings.segment.weight", (segments, hidden)),
    ]
    params += _layer_norm("embeddings.norm", hidden)
    for layer in range(layers):
        p = f"layers.{layer}."
        for proj in ("query", "key", "value", "attention_output"):
            params += _linear(p + proj, hidden, hidden)
        params += _layer_norm(p + "attention_norm", hidden)
        params += _linear(p + "intermediate", hidden, ffn)
        params += _linear(p + "output", ffn, hidden)
        params += _layer_norm(p + "output_norm", hidden)
    params += _linear("pooler", hidden, hidden)
    params += _linear("classifier", hidden, num_classes)
    return params


def _linear(prefix: str, fan_in: int, fan_out: int) -> list[tuple[str, Shape]]:
    return [(prefix + ".weight", (fan_out, fan_in)), (prefix + ".bias", (fan_out,))]


def _layer_norm(prefix: str, channels: int) -> list[tuple[str, Shape]]:
    return [(prefix + ".weight", (channels,)), (prefix + ".bias", (channels,))]


MODELS = {"resnet50": resnet50_parameters, "vgg16": vgg16_parameters, "bert": bert_base_parameters}


def gradient_shapes(model: str) -> list[Shape]:
    """Gradient shapes of ``model`` in backward (ready) order."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    return [shape for _, shape in reversed(MODELS[model]())]
