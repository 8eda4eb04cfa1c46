"""The argparse types every tunelab command uses, and the parser class behind one-line errors.

Public, so that a command's module (here or under ``tunelab.bench``) takes them from one place.
Light on purpose: nothing from ``tunelab.bench`` or any heavy package is imported here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ..units import parse_size

__all__ = ["Parser", "choice_list", "knob", "non_negative_int", "positive_float", "positive_int", "size_list"]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def size_list(text: str) -> list[int]:
    """``"1KiB,1MiB"`` -> byte counts."""
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated subset of ``choices`` (order kept, duplicates dropped)."""
    def parse(text: str) -> list[str]:
        items = [part.strip() for part in text.split(",") if part.strip()]
        for item in items:
            if item not in choices:
                raise argparse.ArgumentTypeError(f"unknown choice {item!r} (choose from {', '.join(choices)})")
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return list(dict.fromkeys(items))
    return parse


def knob(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` for an engine knob, checked against the knob's range."""
    from ..knobs import SPECS, Knobs

    name, sep, value = text.partition("=")
    if not sep or name not in SPECS:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(SPECS)}, "
                                         f"got {text!r}")
    try:
        Knobs(**{name: value})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, value
