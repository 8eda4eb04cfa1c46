"""PyTorch training workloads (ResNet-50, VGG-16, a BERT-base-like encoder) on synthetic data.

The models are written against ``torch.nn`` alone so that the gradients a step
produces are exactly the tensors listed in :mod:`tunelab.workloads.shapes`
(same names, order and shapes): the engine can then be benchmarked on a real
backward pass or on replayed shapes interchangeably.  Weights are always randomly
initialised; nothing is downloaded.

torch is imported lazily so that ``tunelab`` itself installs and imports without it.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .shapes import VGG16_CONFIG

if TYPE_CHECKING:
    import torch
    from torch import nn

DEFAULT_CLASSES = {"resnet50": 1000, "vgg16": 1000, "bert": 2}
_RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # (planes, blocks, stride)
_EXPANSION = 4


def _torch() -> Any:
    """Import torch, or explain which extra installs it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(
            "the PyTorch workloads need torch: pip install 'tunelab[torch]'"
        ) from exc
    return torch


@functools.cache
def _bottleneck_class() -> type:
    """The ResNet v1.5 bottleneck block (stride on the 3x3 conv), defined once torch is importable."""
    nn = _torch().nn

    class Bottleneck(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int) -> None:
            super().__init__()
            width, out = planes, planes * _EXPANSION
            self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample: nn.Module | None = None
            if stride != 1 or inplanes != out:
                self.downsample = nn.Sequential(
                    nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
                )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x if self.downsample is None else self.downsample(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + identity)

    return Bottleneck


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 v1.5: 161 parameter tensors, 25,557,032 parameters at 1000 classes.

    Built as a named ``Sequential`` so parameter names (``conv1``, ``layer3.2.bn1``, ``fc``)
    line up with :func:`tunelab.workloads.shapes.resnet50_parameters`.
    """
    torch = _torch()
    nn = torch.nn
    block = _bottleneck_class()
    modules: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        bn1=nn.BatchNorm2d(64),
        relu=nn.ReLU(inplace=True),
        maxpool=nn.MaxPool2d(3, stride=2, padding=1),
    )
    inplanes = 64
    for index, (planes, blocks, stride) in enumerate(_RESNET50_STAGES, start=1):
        stage = [block(inplanes, planes, stride)]
        inplanes = planes * _EXPANSION
        stage += [block(inplanes, planes, 1) for _ in range(blocks - 1)]
        modules[f"layer{index}"] = nn.Sequential(*stage)
    modules.update(avgpool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten(1), fc=nn.Linear(inplanes, num_classes))
    model = nn.Sequential(modules)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    return model


def vgg16(num_classes: int = 1000) -> nn.Module:
    """VGG-16 (configuration D, no batch norm): 32 tensors, 138,357,544 parameters at 1000 classes.

    The 7x7 adaptive pool keeps the classifier's shapes independent of image size, so small
    test images exercise the same gradients as 224x224 ones.
    """
    nn = _torch().nn
    layers: list[nn.Module] = []
    channels = 3
    for item in VGG16_CONFIG:
        if item == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
        else:
            assert isinstance(item, int)
            layers += [nn.Conv2d(channels, item, 3, padding=1), nn.ReLU(inplace=True)]
            channels = item
    classifier = nn.Sequential(
        nn.Linear(channels * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(4096, num_classes),
    )
    model = nn.Sequential(OrderedDict(
        features=nn.Sequential(*layers), avgpool=nn.AdaptiveAvgPool2d(7), flatten=nn.Flatten(1),
        classifier=classifier,
    ))
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.01)
            nn.init.zeros_(module.bias)
    return model


@functools.cache
def _embeddings_class() -> type:
    """Token + position + segment embeddings, then LayerNorm and dropout (BERT's input layer)."""
    nn = _torch().nn

    class Embeddings(nn.Module):
        def __init__(self, vocab: int, hidden: int, max_len: int, dropout: float) -> None:
            super().__init__()
            self.word = nn.Embedding(vocab, hidden)
            self.position = nn.Embedding(max_len, hidden)
            self.segment = nn.Embedding(2, hidden)
            self.norm = nn.LayerNorm(hidden, eps=1e-12)
            self.dropout = nn.Dropout(dropout)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            # Synthetic inputs are one unpadded segment: position i, segment 0 for every token.
            positions = _torch().arange(ids.shape[1], device=ids.device)
            x = self.word(ids) + self.position(positions) + self.segment(ids.new_zeros(ids.shape))
            return self.dropout(self.norm(x))

    return Embeddings


@functools.cache
def _encoder_layer_class() -> type:
    """A post-LayerNorm transformer encoder layer with GELU feed-forward (BERT's block)."""
    torch = _torch()
    nn, functional = torch.nn, torch.nn.functional

    class EncoderLayer(nn.Module):
        def __init__(self, hidden: int, heads: int, ffn: int, dropout: float) -> None:
            super().__init__()
            self.heads, self.p = heads, dropout
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
            self.attention_output = nn.Linear(hidden, hidden)
            self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.intermediate = nn.Linear(hidden, ffn)
            self.output = nn.Linear(ffn, hidden)
            self.output_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.dropout = nn.Dropout(dropout)

        def _split(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, hidden = x.shape
            return x.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
            p = self.p if self.training else 0.0
            attended = functional.scaled_dot_product_attention(q, k, v, dropout_p=p)
            attended = attended.transpose(1, 2).reshape(x.shape)
            x = self.attention_norm(x + self.dropout(self.attention_output(attended)))
            y = self.output(functional.gelu(self.intermediate(x)))
            return self.output_norm(x + self.dropout(y))

    return EncoderLayer


@functools.cache
def _first_token_class() -> type:
    """Selects the first ([CLS]) position, which the pooler summarises for classification."""
    nn = _torch().nn

    class FirstToken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, 0]

    return FirstToken


def bert_encoder(
    vocab: int = 30522,
    hidden: int = 768,
    layers: int = 12,
    heads: int = 12,
    ffn: int = 3072,
    max_len: int = 512,
    num_classes: int = 2,
    dropout: float = 0.1,
) -> nn.Module:
    """A BERT-base-like sequence classifier taking token ids (N x L, int64) and returning logits.

    Parameters match :func:`tunelab.workloads.shapes.bert_base_parameters` (109,483,778 at the
    defaults).  Linear and embedding weights start from N(0, 0.02), biases at zero, as BERT does.
    """
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
    nn = _torch().nn
    layer = _encoder_layer_class()
    model = nn.Sequential(OrderedDict(
        embeddings=_embeddings_class()(vocab, hidden, max_len, dropout),
        layers=nn.Sequential(*(layer(hidden, heads, ffn, dropout) for _ in range(layers))),
        first_token=_first_token_class()(),
        pooler=nn.Linear(hidden, hidden),
        pooler_activation=nn.Tanh(),
        dropout=nn.Dropout(dropout),
        classifier=nn.Linear(hidden, num_classes),
    ))
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
    return model


MODELS: dict[str, Callable[..., Any]] = {"resnet50": resnet50, "vgg16": vgg16, "bert": bert_encoder}


def build(name: str, num_classes: int | None = None, **kw: Any) -> nn.Module:
    """Build workload ``name`` with random weights; ``num_classes`` defaults to the model's usual head."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    classes = DEFAULT_CLASSES[name] if num_classes is None else num_classes
    return MODELS[name](num_classes=classes, **kw)


def synthetic_batch(
    name: str,
    batch_size: int,
    image_size: int = 224,
    seed: int = 0,
    seq_len: int = 128,
    num_classes: int | None = None,
    vocab: int = 30522,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (inputs, targets) batch for ``name``: the same seed gives the same tensors.

    CNNs get N x 3 x S x S float32 images, the encoder N x ``seq_len`` int64 token ids below
    ``vocab``; targets are int64 class indices below ``num_classes``.  Random data costs no I/O,
    so a step measures compute and communication only.
    """
    torch = _torch()
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    classes = DEFAULT_CLASSES[name] if num_classes is None else num_classes
    generator = torch.Generator().manual_seed(seed)
    if name == "bert":
        inputs = torch.randint(0, vocab, (batch_size, seq_len), generator=generator, dtype=torch.int64)
    else:
        inputs = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    targets = torch.randint(0, classes, (batch_size,), generator=generator, dtype=torch.int64)
    return inputs, targets


def parameter_count(model: nn.Module) -> int:
    """Number of trainable scalars, i.e. the elements one data-parallel step reduces."""
    return sum(math.prod(p.shape) for p in model.parameters() if p.requires_grad)
