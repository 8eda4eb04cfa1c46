"""Parsing and printing sizes with binary units ("64MiB", "1KiB", "4096"), and the range of a link."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
}
# A link between hosts, emulated or shaped: from 1 Mb/s to 100 Tb/s, with at most a second of latency.
# Outside that a run would take hours or compute with times no clock holds; refused as bad input.
LINK_GBPS_RANGE = (0.001, 100_000.0)
LINK_LATENCY_US_MAX = 1e6


def link_problem(gbps: float | None = None, latency_us: float | None = None) -> str | None:
    """Why a link speed (Gb/s) or latency (us) is not one tunelab runs or models, or None."""
    low, high = LINK_GBPS_RANGE
    if gbps is not None and not low <= gbps <= high:
        return f"a link speed must be {low:g} .. {high:g} Gb/s, got {gbps!r}"
    if latency_us is not None and not 0.0 <= latency_us <= LINK_LATENCY_US_MAX:
        return f"a link latency must be 0 .. {LINK_LATENCY_US_MAX:g} us, got {latency_us!r}"
    return None


def check_link(gbps: float | None = None, latency_us: float | None = None) -> None:
    """ValueError saying why, when :func:`link_problem` finds one."""
    why = link_problem(gbps, latency_us)
    if why is not None:
        raise ValueError(why)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a plain integer or a number with B/KiB/MiB/GiB (K/M/G and KB/MB/GB
    are read as binary too).  Raises ValueError with the offending text."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid size {text!r} (expected e.g. 4096, 1KiB, 64MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not value < 1 << 62:  # (inf too, from a number of hundreds of digits)
        shown = text if len(text) <= 40 else f"{text[:20]}...{text[-8:]}"
        raise ValueError(f"size {shown!r} is too large (at most 4 EiB)")
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def human_size(nbytes: float) -> str:
    """A size as people read it, to three significant digits ("97.5 MiB", "1 KiB", "600 B"); not exact
    (use :func:`format_size` where the text is read back)."""
    try:
        if not math.isfinite(float(nbytes)):
            return f"{nbytes} B"
    except OverflowError:  # (an integer past float's range)
        return f"{nbytes} B"
    for suffix, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)):
        if nbytes >= mult or suffix == "B":
            value = nbytes / mult
            text = f"{value:.3g}"  # (three digits, or the whole number where that needs an exponent:
            return f"{text if 'e' not in text else f'{value:.0f}'} {suffix}"  # 999.7 MiB is "1000 MiB")
    raise AssertionError("unreachable")


def knob_size(nbytes: int) -> str:
    """A knob's size as tune's progress and reports show it: exact where that is short ("4MiB",
    "516KiB"); else to three digits, zeros kept so that a rounded size never reads as a round one
    ("68.1MiB" for 69712KiB, "1.00MiB" for 1025KiB, "228.3MiB" for 233765KiB)."""
    exact = format_size(nbytes)
    if nbytes >= 1 << 20 and not exact.endswith(("MiB", "GiB")):
        unit, suffix = (1 << 30, "GiB") if nbytes >= 1 << 30 else (1 << 20, "MiB")
        value = nbytes / unit
        # ("#" keeps the zeros of "1.00"; from three integer digits on, 99.96 included, one decimal,
        # since "228." is no number and "228" would read as exact)
        text = f"{value:#.3g}"
        return (f"{value:.1f}" if text.endswith(".") or "e" in text else text) + suffix
    return exact


def format_size(nbytes: int) -> str:
    """Shortest exact binary-unit spelling of ``nbytes`` ("64MiB", "1000B")."""
    for suffix, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{suffix}"
    return f"{nbytes}B"


def counted(n: int, noun: str) -> str:
    """"1 block", "2 blocks": a count with its noun, plural unless it is one."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
