"""The engine's live knobs: one frozen value, validated, with the search space the tuner explores.

Units are in the names.  ``Knobs()`` are the defaults; ``knobs.replace(x=...)``
returns a validated copy; an invalid value raises ``ValueError`` naming the knob
and its allowed range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .units import format_size, parse_size

MiB = 1 << 20


@dataclass(frozen=True)
class KnobSpec:
    name: str
    kind: type  # int, float or bool
    low: float | None
    high: float | None
    help: str

    def describe_range(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.name.endswith("_bytes"):
            return f"{format_size(int(self.low))} .. {format_size(int(self.high))}"
        return f"{self.low:g} .. {self.high:g}"


SPECS: dict[str, KnobSpec] = {s.name: s for s in (
    KnobSpec("fusion_threshold_bytes", int, 0, 1 << 30,
             "largest fusion buffer; tensors are packed into buffers up to this size (0 = no fusion)"),
    KnobSpec("cycle_time_ms", float, 0.05, 1000.0,
             "wait between negotiations while tensors are in flight (an idle coordinator wakes on the next one)"),
    KnobSpec("hierarchical", bool, None, None,
             "local reduce-scatter, cross-node allreduce of shards, local allgather"),
    KnobSpec("group_fusion", bool, None, None,
             "let different groups (and ungrouped tensors) share a fusion buffer"),
    KnobSpec("segment_bytes", int, 4096, 256 * MiB,
             "pipeline piece: shared-memory staging size and MPI ring message size"),
    KnobSpec("oneshot_max_bytes", int, 0, 64 * MiB,
             "buckets up to this size take the one-shot algorithm within a node (every rank reads every "
             "peer's copy and reduces once: one ordering point); larger ones the two-shot "
             "reduce-scatter + allgather (0 = always two-shot)"),
    KnobSpec("doubling_max_bytes", int, 0, 64 * MiB,
             "buffers up to this size cross nodes by recursive doubling (log2 of the ranks exchanges of the "
             "whole buffer, where the ring sends 2 (ranks - 1) messages of a 1/ranks share); larger ones "
             "go round the ring (0 = always the ring)"),
)}


# Defaults that changed, knob by knob: (the value, the UTC time it stopped being the default, as the
# profile store writes times).  A stored profile whose tuning kept the default holds that run's default;
# in one stored before then, the value is read as the default of then, not as a knob the user pinned, so
# a job loading it gets today's default (runtime._lookup_profile says so).
FORMER_DEFAULTS: dict[str, tuple[tuple[object, str], ...]] = {
    "cycle_time_ms": ((1.0, "2026-11-28T02:01:20"),),
    "oneshot_max_bytes": ((256 << 10, "2026-11-23T08:54:18"),),
}

# Knobs added after the first profiles were stored, with the value in effect before (the engine had no
# such route then: every call took the general path, every size the ring): a configuration stored
# without the knob ran as this, not as today's default.
ADDED_LATER: dict[str, object] = {"oneshot_max_bytes": 0, "doubling_max_bytes": 0}


def stored_knobs(values: dict) -> Knobs:
    """A stored configuration (a profile's trial or best) as the knobs it ran with (``ADDED_LATER``)."""
    return Knobs(**{**ADDED_LATER, **values})


def former_default(name: str, value: object, stored: str) -> bool:
    """Whether ``value`` of knob ``name``, stored at ``stored`` (an ISO time, as the store writes it, or
    as an imported file gives it: any offset, or none for UTC), was tunelab's default then and is no
    longer (``FORMER_DEFAULTS``).  A time that does not parse is read as after every change (the value
    then counts as chosen)."""
    from datetime import datetime, timezone

    def utc(text: str) -> datetime:
        t = datetime.fromisoformat(text)
        return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t

    try:
        when = utc(stored)
    except (TypeError, ValueError):
        return False
    return any(value == was and when < utc(until) for was, until in FORMER_DEFAULTS.get(name, ()))


@dataclass(frozen=True)
class Knobs:
    fusion_threshold_bytes: int = 64 * MiB
    cycle_time_ms: float = 10.0
    hierarchical: bool = False
    group_fusion: bool = True
    segment_bytes: int = 4 * MiB
    oneshot_max_bytes: int = 1 * MiB  # host crossover measured at 2-4 MiB (2 and 4 ranks, 2 cores)
    doubling_max_bytes: int = 32 * 1024  # lab, 1 Gb/s: 2x1 gains up to 16 KiB, 2x2 flat loses at 64 KiB

    def __post_init__(self) -> None:
        for spec in SPECS.values():
            object.__setattr__(self, spec.name, _validate(spec, getattr(self, spec.name)))

    def replace(self, **changes: object) -> Knobs:
        unknown = set(changes) - set(SPECS)
        if unknown:
            raise ValueError(f"unknown knob {min(unknown)!r}; knobs are {', '.join(SPECS)}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _validate(spec: KnobSpec, value: object) -> object:
    if spec.kind is bool:
        if isinstance(value, str):
            value = parse_bool(spec.name, value)
        if not isinstance(value, bool):
            raise ValueError(f"knob {spec.name} must be {spec.describe_range()}, got {value!r}")
        return value
    if isinstance(value, bool):
        # ValueError, not TypeError: every caller reports a bad setting the same way, whatever its type
        raise ValueError(f"knob {spec.name} must be a number in {spec.describe_range()}, got {value!r}")  # noqa: TRY004
    if spec.kind is int and spec.low == 0 and isinstance(value, str) and value.strip().lower() == "off":
        value = 0  # a size whose 0 means "off" (no fusion, never one-shot), as knob_text prints it
    try:
        if spec.kind is int:
            number: float = parse_size(value) if isinstance(value, str) else int(value)
            if number != value and not isinstance(value, str):
                raise ValueError
        else:
            number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # (the last: int() of an infinity)
        raise ValueError(f"knob {spec.name} must be a number in {spec.describe_range()}, "
                         f"got {value!r}") from None
    if not (spec.low <= number <= spec.high):  # type: ignore[operator]
        raise ValueError(f"knob {spec.name}={value!r} is out of range {spec.describe_range()}")
    return number


def knob_text(name: str, value: object, exact: bool = True) -> str:
    """One knob's value as every command prints it: on/off for switches, "off" for a size of 0, sizes
    in binary units (``exact``: as ``--knob`` takes them back, e.g. "69712KiB"; else to three digits,
    "68.1MiB", where only reading matters), plain numbers without a trailing ".0"."""
    from .units import knob_size

    if isinstance(value, bool):
        return "on" if value else "off"
    if name.endswith("_bytes") and isinstance(value, int):
        return "off" if value == 0 else format_size(value) if exact else knob_size(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"knob {name} must be true or false, got {text!r}")
