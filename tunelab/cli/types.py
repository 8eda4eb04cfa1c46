"""The argparse types every tunelab command uses, and the parser class behind one-line errors.

Public, so that a command's module (here or under ``tunelab.bench``) takes them from one place.
Light on purpose: nothing from ``tunelab.bench`` or any heavy package is imported here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..units import parse_size

__all__ = [  # the argparse types and helpers (DEFAULT_SCENARIO is a constant beside them)
    "Parser",
    "add_training_flags",
    "choice_list",
    "chosen_scenario",
    "default_scenario_input",
    "fraction",
    "knob",
    "link_gbps",
    "named_input",
    "non_negative_int",
    "output_file",
    "positive_float",
    "positive_int",
    "profile_id",
    "scenario_input",
    "size_list",
]


DEFAULT_SCENARIO = "resnet50"  # what tune and bench landscape run without --model or --scenario


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def _number(text: str, convert: Callable[[str], float], ok: Callable[[float], bool], what: str) -> float:
    """``text`` converted, or an ArgumentTypeError saying what was expected."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--image-size`` and ``--batch-size``: a training scenario's settings a run may
    override (each defaults to None, the scenario's own)."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="where each rank trains (cuda: its GPU, torch models); default: the scenario's")
    parser.add_argument("--image-size", type=positive_int, default=None,
                        help="square input images; default: the scenario's")
    parser.add_argument("--batch-size", type=positive_int, default=None, help="per rank")


def positive_int(text: str) -> int:
    return int(_number(text, int, lambda v: v >= 1, "a positive integer"))


def non_negative_int(text: str) -> int:
    return int(_number(text, int, lambda v: v >= 0, "an integer >= 0"))


SEED_LIMIT = 2**31  # numpy's and scikit-learn's seeds stop at 2**32 - 1; epochs add to the given one


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**31)."""
    return int(_number(text, int, lambda v: 0 <= v < SEED_LIMIT, f"an integer from 0 to {SEED_LIMIT - 1}"))


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def link_gbps(text: str) -> float:
    """A link's speed in Gb/s, within :data:`tunelab.units.LINK_GBPS_RANGE`."""
    from ..units import LINK_GBPS_RANGE

    low, high = LINK_GBPS_RANGE
    return _number(text, float, lambda v: low <= v <= high, f"a link speed of {low:g} .. {high:g} Gb/s")


def profile_id(text: str) -> int:
    """A profile's id in the store: a positive integer that SQLite can hold, in ASCII digits only (int()
    also reads "1_2" as 12 and other scripts' digits: a typo must not name another profile)."""
    digits = text.isascii() and text.isdigit() and len(text.lstrip("0")) <= 19  # (19: past 2**63 anyway)
    value = int(text) if digits else 0
    if not 1 <= value < 2 ** 63:
        raise argparse.ArgumentTypeError(f"expected a profile id (a positive integer), got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    return _number(text, float, lambda v: 0.0 <= v < 1.0, "a fraction in [0, 1)")


def size_list(text: str) -> list[int]:
    """``"1KiB,1MiB"`` -> byte counts, each at least one byte."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("no sizes given")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
    try:
        sizes = [parse_size(part) for part in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    small = [p for p, s in zip(parts, sizes) if s < 1]
    if small:
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {small[0]!r}")
    return sizes


def input_file(text: str) -> Path:
    """A file the command will read (whether it exists is checked where it is read)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return Path(text)


def named_input(action: argparse.Action, resolve: Callable[[str], Path | None],
                default: Callable[[argparse.Namespace], list[Path]] | None = None) -> argparse.Action:
    """Mark ``action`` as naming a file the command reads, by a name that ``resolve`` turns into its path
    (a shipped scenario's or landscape's name): an output naming that file is refused as any input path
    is (:func:`tunelab.cli._refuse_overwriting_inputs`).  ``resolve`` returns None, or raises, where the
    name names no file; ``default(args)`` gives the files the command reads when the flag is not given."""
    action.input_path = resolve  # type: ignore[attr-defined]
    action.input_default = default  # type: ignore[attr-defined]
    return action


def default_scenario_input(args: argparse.Namespace) -> list[Path]:
    """The file of the scenario tune and bench landscape run when given neither --model nor --scenario."""
    path = None if getattr(args, "scenario", None) is not None else scenario_input(DEFAULT_SCENARIO)
    return [path] if path is not None else []


def chosen_scenario(args: argparse.Namespace) -> str:
    """What tune and bench landscape load: --scenario's file, else --model's name, else the default."""
    if args.scenario is not None:
        return str(args.scenario)
    return DEFAULT_SCENARIO if args.model is None else args.model


def scenario_input(name: str) -> Path | None:
    """The file a scenario name or path reads (see :func:`tunelab.scenarios.load_scenario`), None if none."""
    from ..errors import TunelabError
    from ..scenarios import scenario_path

    try:
        return scenario_path(name)
    except TunelabError:
        return None


def writes_outputs() -> bool:
    """Whether this process writes the command's files: inside the user's mpiexec/srun, rank 0 alone
    (:func:`tunelab.cli.finish.finish`), so the other ranks do not check where they would go."""
    from ..launch import inside_mpi_job, job_rank

    return not inside_mpi_job() or job_rank() == 0


def output_file(text: str) -> Path:
    """A file the command will write: refused now (exit 2), before any work, when it cannot be."""
    from ..files import unwritable

    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    path = Path(text)
    if not writes_outputs():
        return path  # (rank 0 writes it: another host's rank need not be able to)
    why = unwritable(path)
    if why is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {why}")
    return path


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
