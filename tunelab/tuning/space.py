"""The knob search space: one joint mixed space over every knob the user did not pin.

Each searchable knob has a :class:`Scale` here (its search range and how it maps to the optimizer's
coordinate), so the space, the strategies, the replayed landscapes and the report never branch on a
knob's name.  Sizes are searched on a log2 scale; the fusion threshold's lowest bin means "no
fusion" (threshold 0), so fused and unfused configurations live in one continuous dimension.
``hierarchical`` is searched only when there is more than one node (real or emulated).
``group_fusion`` changes semantics (determinism), not speed, and is never searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..knobs import Knobs


@dataclass(frozen=True)
class Scale:
    """How one knob is searched.  ``kind``: ``log2`` (a size in bytes, searched as its log2, rounded to
    a multiple of ``multiple``; values below ``off_below`` mean ``off_value``), ``log`` (a positive
    number, log-uniform) or ``bool``.  ``multi_node``: searched only when there are several nodes;
    ``device_only``: only when the job trains on GPUs."""

    kind: str
    low: float = 0.0
    high: float = 1.0
    multiple: int = 1
    off_below: float | None = None
    off_value: int = 0
    multi_node: bool = False
    device_only: bool = False  # searched only when the job reduces device (GPU) tensors

    def to_value(self, x: Any) -> object:
        if self.kind == "bool":
            return bool(x)
        if self.kind == "log":
            return round(float(x), 3)
        if self.off_below is not None and x < self.off_below:
            return self.off_value
        return max(self.multiple, round(2.0 ** float(x) / self.multiple) * self.multiple)

    def to_coordinate(self, value: Any) -> Any:
        if self.kind == "bool":
            return bool(value)
        if self.kind == "log":
            return _clip(float(value), self.low, self.high)
        if self.off_below is not None and value <= self.off_value:
            return self.low
        return _clip(math.log2(value), self.low, self.high)

    def from_unit(self, u: float) -> object:
        """The knob value at ``u`` in [0, 1] (the inverse of :meth:`unit`, up to rounding)."""
        u = _clip(float(u), 0.0, 1.0)
        if self.kind == "bool":
            return u >= 0.5
        if self.kind == "log":
            return self.to_value(math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low))))
        return self.to_value(self.low + u * (self.high - self.low))

    def unit(self, value: Any) -> float:
        """``value`` in [0, 1] as a GP sees it (booleans: 0 or 1)."""
        x = self.to_coordinate(value)
        if self.kind == "bool":
            return float(x)
        if self.kind == "log":
            return (math.log(x) - math.log(self.low)) / (math.log(self.high) - math.log(self.low))
        return (x - self.low) / (self.high - self.low)


# The searched knobs, in search order.  Ranges are the ones worth searching, inside each knob's valid range.
SCALES: dict[str, Scale] = {
    "fusion_threshold_bytes": Scale("log2", 13.0, 28.0, multiple=1024, off_below=14.0),  # off, 16 KiB..256 MiB
    "cycle_time_ms": Scale("log", 0.1, 100.0),
    "segment_bytes": Scale("log2", 14.0, 26.0, multiple=4096),                         # 16 KiB .. 64 MiB
    "hierarchical": Scale("bool", multi_node=True),
    # one-shot vs two-shot within a node: off (always two-shot), or 8 KiB .. 16 MiB
    "oneshot_max_bytes": Scale("log2", 12.0, 24.0, multiple=4096, off_below=13.0, device_only=True),
}


@dataclass(frozen=True)
class SearchSpace:
    names: tuple[str, ...]
    base: Knobs  # pinned values and defaults for everything not searched

    def scale(self, name: str) -> Scale:
        return SCALES[name]

    def to_knobs(self, point: list[Any]) -> Knobs:
        return self.base.replace(**{n: SCALES[n].to_value(x) for n, x in zip(self.names, point)})

    def to_point(self, knobs: Knobs) -> list[Any]:
        return [SCALES[n].to_coordinate(getattr(knobs, n)) for n in self.names]

    def unit_point(self, knobs: Knobs) -> list[float]:
        """Every searched knob in [0, 1] (the GP's and the landscapes' distance coordinates)."""
        return [SCALES[n].unit(getattr(knobs, n)) for n in self.names]

    def from_unit(self, u: list[float]) -> Knobs:
        return self.base.replace(**{n: SCALES[n].from_unit(x) for n, x in zip(self.names, u)})

    def booleans(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if SCALES[n].kind == "bool")

    def restricted(self, fixed: dict[str, object]) -> SearchSpace:
        """The same space with ``fixed`` knobs taken out of the search and set in the base."""
        return SearchSpace(tuple(n for n in self.names if n not in fixed), self.base.replace(**fixed))


def search_space(pinned: dict[str, object], num_nodes: int, base: Knobs | None = None,
                 device: bool = False, uniform_nodes: bool = True) -> SearchSpace:
    """The space over unpinned knobs; ``pinned`` values are fixed in ``base``.  ``device``: the job
    reduces GPU tensors, so the device path's knobs are searched too.  ``uniform_nodes``: every node has
    as many ranks (else hierarchical, which needs that, cannot run and is not searched)."""
    base = (base or Knobs()).replace(**pinned) if pinned else (base or Knobs())
    names = [n for n, s in SCALES.items() if n not in pinned and (num_nodes > 1 and uniform_nodes or not s.multi_node)
             and (device or not s.device_only)]
    return SearchSpace(tuple(names), base)


def _clip(x: float, low: float, high: float) -> float:
    return min(high, max(low, x))
