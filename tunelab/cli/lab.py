"""``tunelab lab up|down|status|exec``: a multi-host lab of network namespaces on this machine.

After ``lab up``, ``--lab`` on ``bench allreduce``, ``bench train`` and ``tune`` runs their ranks on
the lab's hosts.  Needs root and iproute2 (a one-line error and exit 2 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..files import write_text
from .finish import add_output_flags
from .types import link_gbps, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser("lab", help="a multi-host lab on this machine (network namespaces, shaped links)")
    sub = lab.add_subparsers(dest="lab", required=True, parser_class=type(lab))

    upp = sub.add_parser("up", help="create H hosts linked by a bridge, each link shaped to G Gb/s")
    upp.add_argument("--hosts", type=positive_int, required=True, metavar="H",
                     help="hosts to create, each a network namespace with its own hostname")
    upp.add_argument("--link-gbps", type=link_gbps, required=True, metavar="G",
                     help="each host's link rate, both directions (tc tbf)")
    upp.add_argument("--ranks-per-host", type=positive_int, default=1, metavar="K",
                     help="ranks per host when a --lab run gives no --np (default 1)")
    upp.add_argument("--link-latency-us", type=float, default=0.0, metavar="US",
                     help="one-way latency between hosts (needs the netem qdisc in the kernel)")
    upp.add_argument("--subnet", default=None, help="private IPv4 subnet for the lab (default 10.213.0.0/24)")
    upp.add_argument("--no-probe", action="store_true", help="skip measuring what one TCP stream sustains")
    upp.set_defaults(func=_up)

    down = sub.add_parser("down", help="remove the lab and anything a killed run left")
    down.set_defaults(func=_down)

    st = sub.add_parser("status", help="the lab that is up: hosts, addresses, shaping, bytes carried")
    add_output_flags(st, report=False, what="the lab's state")
    st.set_defaults(func=_status)

    ex = sub.add_parser("exec", help="run a command on one lab host (its namespace and hostname)")
    ex.add_argument("host", help="a lab host, e.g. tlab-h0")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments")
    ex.set_defaults(func=_exec)


def _up(args: argparse.Namespace) -> int:
    from ..lab import up
    from ..lab.spec import DEFAULT_SUBNET, LabSpec

    spec = LabSpec(hosts=args.hosts, link_gbps=args.link_gbps, ranks_per_host=args.ranks_per_host,
                   link_latency_us=args.link_latency_us, subnet=args.subnet or DEFAULT_SUBNET)
    state = up(spec, probe=not args.no_probe)
    _print_state(state)
    return 0


def _down(args: argparse.Namespace) -> int:
    from ..lab import down

    removed = down()
    print(f"removed {', '.join(removed)}" if removed else "no lab was up")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ..lab import status
    from ..lab.net import link_counters, qdisc_lines

    state, present = status()
    if state is None:
        stale = present["namespaces"] + present["links"] + present["etc"]
        print("no lab is up" + (f"; left behind: {', '.join(stale)} (removed by 'lab up' or 'lab down')"
                                if stale else ""))
        if args.json:
            write_text(args.json, json.dumps({"up": False, "left_behind": present}, indent=2) + "\n")
        return 0
    _print_state(state)
    from ..lab.net import problems

    missing = problems(state)
    counters = link_counters(state)
    for host in state.hosts:
        c = counters[host.name]
        print(f"  {host.name}: sent {c['sent_bytes']:,} B, received {c['received_bytes']:,} B over its link")
    for line in qdisc_lines(state):
        print(f"  tc {line}")
    if args.json:
        data = {"up": not missing, "state": json.loads(state.to_json()), "counters": counters, "missing": missing}
        write_text(args.json, json.dumps(data, indent=2) + "\n")
    if missing:
        sys.stderr.write(f"tunelab: error: the lab is broken, missing {', '.join(missing)}: run 'tunelab lab up'\n")
        return 1
    return 0


def _exec(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from ..lab import require_lab

    state = require_lab()
    names = [h.name for h in state.hosts]
    if args.host not in names:
        raise UsageError(f"unknown lab host {args.host!r} (hosts: {', '.join(names)})")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("lab exec needs a command, e.g. 'tunelab lab exec tlab-h0 -- hostname'")
    os.execvp("ip", ["ip", "netns", "exec", args.host, "unshare", "--uts", "sh", "-c",
                     'hostname "$0" && exec "$@"', args.host, *cmd])
    return 1  # not reached


def scenario_session(use_lab: bool, scenario):
    """The lab session of a scenario run (``tune``, ``bench landscape``): the scenario's ``[lab]``
    table, or the lab that is up with ``--lab``, or none.  See :func:`tunelab.lab.session`."""
    from ..errors import UsageError
    from ..lab import session
    from ..lab.spec import LabSpec
    from ..launch import inside_mpi_job

    if (use_lab or scenario.lab_hosts is not None) and inside_mpi_job():  # (before any rank builds a lab)
        raise UsageError(("--lab" if use_lab else f"scenario {scenario.name}'s [lab]") + " launches its own "
                         "ranks on the lab's hosts: run it outside mpiexec/srun")
    spec = None
    if scenario.lab_hosts is not None:
        spec = LabSpec(hosts=scenario.lab_hosts, link_gbps=scenario.lab_link_gbps,
                       ranks_per_host=scenario.lab_ranks_per_host)
    elif use_lab and (scenario.ranks_per_node is not None or scenario.link_gbps is not None):
        raise UsageError("--lab hosts are real hosts with real links: this run also emulates nodes "
                         "(ranks_per_node/link_gbps); drop those")
    return session(use_lab, spec)


def scenario_ranks(lab, np_flag: int | None, scenario) -> int:
    """Ranks of a scenario run: ``--np``, else the scenario's own count when it has a ``[lab]`` table
    or runs off the lab, else (``--lab`` on a scenario without one) the lab's hosts x ranks per host.
    Under the user's mpiexec/srun, the ranks it started (:func:`tunelab.lab.job_ranks`)."""
    from ..lab import job_ranks
    from ..launch import inside_mpi_job

    if np_flag is None and (lab is None or scenario.lab_hosts is not None) and not inside_mpi_job():
        np_flag = scenario.np
    return job_ranks(lab, np_flag)


def _print_state(state) -> None:
    s = state.spec
    print(f"# lab: {state.describe()}, bridge {state.bridge} {s.bridge_address()}")
    for host in state.hosts:
        print(f"  {host.name}  {host.address}  link {host.veth} <-> {host.name}:eth0  {s.link_gbps:g} Gb/s each way")
    if state.sustained_gbps is not None:
        print(f"# one TCP stream sustained {state.sustained_gbps:.2f} Gb/s over a {s.link_gbps:g} Gb/s link"
              + (" (the host's cores, not the link, set this ceiling)"
                 if state.sustained_gbps < 0.8 * s.link_gbps else ""))
    for note in state.notes:
        print(f"# note: {note}")
