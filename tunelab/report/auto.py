"""What a command writes at the end of a run: its ``--json`` result and, by default, an HTML report.

The report needs the ``report`` extra (matplotlib, pandas, jinja2); without it the run still succeeds
and says in one line what to install.  Nothing heavy is imported unless a report is written.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..files import write_text


def add_report_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", action=argparse.BooleanOptionalAction, default=True,
                   help="write a self-contained HTML report under reports/ at the end (default: on)")


REPORTS_DIR = Path("reports")


def reports_unwritable() -> str | None:
    """Why the default report folder cannot take a report (None when it can): checked before a run."""
    from ..files import unwritable

    why = unwritable(REPORTS_DIR / "report.html")
    return None if why is None else f"cannot write reports under {REPORTS_DIR}/: {why} (give --no-report)"


def write_outputs(result: dict, json_path: Path | None, name: str, kind: str | None) -> None:
    """Write ``result`` to ``json_path`` (or, for a report, ``reports/<name>-<time>.json``) and, when
    ``kind`` is "bench" or "tune", the report next to it.  Prints every path written."""
    if json_path is None and kind is None:
        return
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # (runs started in one second differ)
    path = json_path or REPORTS_DIR / f"{stem}.json"
    text = json.dumps(result, indent=2) + "\n"
    write_text(path, text)
    print(f"# wrote {path}")
    if kind is not None:
        if not path.is_file():  # /dev/stdout, /dev/null, a pipe: the report reads a copy it can read back
            path = write_text(REPORTS_DIR / f"{stem}.json", text)
            print(f"# wrote {path} (for the report)")
        _write_report(path, REPORTS_DIR / f"{stem}.html", kind)


def _write_report(json_path: Path, out: Path, kind: str) -> None:
    try:
        import jinja2  # noqa: F401
        import matplotlib  # noqa: F401
        import pandas  # noqa: F401
    except ImportError as exc:
        print(f"# report skipped: {exc.name} is not installed (pip install 'tunelab[report]')")
        return
    from .build import write_report

    write_report(out, title=f"tunelab {json_path.stem}", profiles=[],
                 benches=[json_path] if kind == "bench" else [], tunes=[json_path] if kind == "tune" else [])
    print(f"# report: {out}")
