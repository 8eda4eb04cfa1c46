"""``tunelab hw``: this host's hardware and software facts, one per line, as people read them.

The facts are those a benchmark records (``host_info``) and those a tuning profile is keyed on (the
fingerprint's: sockets, GPUs, frameworks); sizes in binary units, versions on one line.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    hw = subparsers.add_parser("hw", help="print this host's hardware and software facts")
    hw.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..hardware import fact_text, fingerprint, host_info

    facts = dict(host_info())
    job = ("nodes", "ranks_per_node", "memory_gib", "hostname")  # the job's layout, or said already
    facts.update({k: v for k, v in fingerprint(1, [1]).facts.items() if k not in facts and k not in job})
    for key, value in facts.items():
        print(f"{key.removesuffix('_bytes')}: {fact_text(key, value)}")
    return 0
