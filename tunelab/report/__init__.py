"""``tunelab report``: one self-contained HTML file from tuning runs and benchmark results.

Figures are PNG data URIs (matplotlib, Agg), tables are pandas HTML, the page is a Jinja2
template with autoescaping on.  Nothing heavy is imported until a report is built.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """Add the ``report`` subcommand to the CLI's subparsers."""
    rep = sub.add_parser("report", help="write a self-contained HTML report of tuning runs and benchmarks")
    rep.add_argument("--profile", type=int, action="append", default=[], metavar="ID",
                     help="a tuning profile from the store; repeatable")
    rep.add_argument("--bench", type=Path, action="append", default=[], metavar="FILE.json",
                     help="a tunelab bench --json result; repeatable")
    rep.add_argument("--tune", type=Path, action="append", default=[], metavar="FILE.json",
                     help="a tunelab tune --json result; repeatable")
    rep.add_argument("--title", default="tunelab report")
    rep.add_argument("--out", type=Path, default=None, metavar="PATH",
                     help="output file (default reports/report-<timestamp>.html)")
    rep.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from ..errors import TunelabError
    from .build import default_out, write_report

    if not (args.profile or args.bench or args.tune):
        raise TunelabError("nothing to report: give --profile, --bench or --tune")
    out = args.out if args.out is not None else default_out()
    write_report(out, title=args.title, profiles=args.profile, benches=args.bench, tunes=args.tune)
    print(out)
    return 0
