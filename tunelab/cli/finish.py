"""The one way a command ends: its notes, its ``--json`` result, its HTML report, its exit status."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

from ..report.auto import add_report_flag, write_outputs
from .types import output_file


def finish(args: argparse.Namespace, result: dict, name: str, kind: str | None = None,
           bad: Iterable[str] = (), problem: str = "wrong results from") -> int:
    """Print ``result``'s notes, write ``--json`` (``args.json``) and, when ``kind`` ("bench" or "tune")
    is given and ``args.report`` is on, the HTML report named after ``name``.  ``bad`` names what went
    wrong (e.g. the algorithms with wrong rows): then one error line on stderr and exit status 1."""
    from .types import writes_outputs

    # under the user's mpiexec every rank has rank 0's result: rank 0 alone writes and speaks for the job
    # (N ranks wrote N reports, and N copies of the JSON into one --json /dev/stdout)
    speaks = writes_outputs()
    for note in result.get("notes", []):
        print(f"# note: {note}")
    report = kind if getattr(args, "report", False) else None
    if speaks:
        write_outputs(result, getattr(args, "json", None), name, report)
    names = sorted({str(b) for b in bad})
    if names:
        if speaks:
            sys.stderr.write(f"tunelab: error: {problem} {', '.join(names)}\n")
        return 1
    return 0


def add_output_flags(p: argparse.ArgumentParser, report: bool = True, what: str = "results") -> None:
    """``--json PATH`` and (with ``report``) ``--report/--no-report``: what :func:`finish` reads."""
    p.add_argument("--json", type=output_file, default=None, metavar="PATH", help=f"also write {what} as JSON")
    if report:
        add_report_flag(p)

