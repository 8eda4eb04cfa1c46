"""``tunelab hw``: this host's hardware and software facts, one per line."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    hw = subparsers.add_parser("hw", help="print this host's hardware and software facts")
    hw.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..hardware import host_info

    for key, value in host_info().items():
        print(f"{key}: {value}")
    return 0
