"""``tunelab report``: one self-contained HTML file from tuning runs and benchmark results."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .types import input_file, output_file, profile_id


def register(subparsers: argparse._SubParsersAction) -> None:
    rep = subparsers.add_parser("report", help="write a self-contained HTML report of tuning runs and benchmarks")
    rep.add_argument("--profile", type=profile_id, action="append", default=[], metavar="ID",
                     help="a tuning profile from the store; repeatable")
    rep.add_argument("--bench", type=input_file, action="append", default=[], metavar="FILE.json",
                     help="a tunelab bench --json result; repeatable")
    rep.add_argument("--tune", type=input_file, action="append", default=[], metavar="FILE.json",
                     help="a tunelab tune --json result; repeatable")
    rep.add_argument("--title", default="tunelab report", help="the page's title (default: tunelab report)")
    rep.add_argument("--out", type=output_file, default=None, metavar="PATH",
                     help="output file (default reports/report-<timestamp>.html)")
    rep.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report.build import default_out, write_report

    if not (args.profile or args.bench or args.tune):
        raise UsageError("nothing to report: give --profile, --bench or --tune")
    out = args.out if args.out is not None else default_out()
    write_report(out, title=args.title, profiles=args.profile, benches=args.bench, tunes=args.tune)
    print(out)
    return 0
