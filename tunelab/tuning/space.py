"""The knob search space: one joint mixed space over every knob the user did not pin.

Sizes are searched on a log2 scale; the fusion threshold's lowest bin means "no fusion"
(threshold 0), so fused and unfused configurations live in the same continuous dimension.
``hierarchical`` is searched only when there is more than one node (real or emulated).
``group_fusion`` changes semantics (determinism), not speed, and is never searched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..knobs import Knobs

_FUSION_LOG2 = (13.0, 28.0)   # below 14 -> no fusion; 16 KiB .. 256 MiB
_SEGMENT_LOG2 = (14.0, 26.0)  # 16 KiB .. 64 MiB
_CYCLE_MS = (0.1, 100.0)


@dataclass(frozen=True)
class SearchSpace:
    names: tuple[str, ...]
    base: Knobs  # pinned values and defaults for everything not searched

    def skopt_dimensions(self) -> list[Any]:
        from skopt.space import Categorical, Real

        dims = {"fusion_threshold_bytes": Real(*_FUSION_LOG2, name="fusion_threshold_log2"),
                "cycle_time_ms": Real(*_CYCLE_MS, prior="log-uniform", name="cycle_time_ms"),
                "segment_bytes": Real(*_SEGMENT_LOG2, name="segment_log2"),
                "hierarchical": Categorical([False, True], name="hierarchical")}
        return [dims[n] for n in self.names]

    def to_knobs(self, point: list[Any]) -> Knobs:
        values: dict[str, object] = {}
        for name, x in zip(self.names, point):
            if name == "fusion_threshold_bytes":
                values[name] = 0 if x < 14.0 else _pow2_rounded(x, 1024)
            elif name == "segment_bytes":
                values[name] = _pow2_rounded(x, 4096)
            elif name == "cycle_time_ms":
                values[name] = round(float(x), 3)
            else:
                values[name] = bool(x)
        return self.base.replace(**values)

    def to_point(self, knobs: Knobs) -> list[Any]:
        point: list[Any] = []
        for name in self.names:
            v = getattr(knobs, name)
            if name == "fusion_threshold_bytes":
                point.append(_clip(math.log2(v), *_FUSION_LOG2) if v > 0 else _FUSION_LOG2[0])
            elif name == "segment_bytes":
                point.append(_clip(math.log2(v), *_SEGMENT_LOG2))
            elif name == "cycle_time_ms":
                point.append(_clip(float(v), *_CYCLE_MS))
            else:
                point.append(bool(v))
        return point


def search_space(pinned: dict[str, object], num_nodes: int, base: Knobs | None = None) -> SearchSpace:
    """The space over unpinned knobs; ``pinned`` values are fixed in ``base``."""
    base = (base or Knobs()).replace(**pinned) if pinned else (base or Knobs())
    names = ["fusion_threshold_bytes", "cycle_time_ms", "segment_bytes"]
    if num_nodes > 1:
        names.append("hierarchical")
    return SearchSpace(tuple(n for n in names if n not in pinned), base)


def _pow2_rounded(log2_value: float, multiple: int) -> int:
    return max(multiple, int(round(2.0 ** float(log2_value) / multiple)) * multiple)


def _clip(x: float, low: float, high: float) -> float:
    return min(high, max(low, x))
