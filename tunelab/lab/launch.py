"""Launching MPI ranks onto lab hosts with MPICH's hydra ``mpiexec``.

hydra starts one proxy per host through its ssh launcher; ``-launcher-exec`` points it at a small
script that enters the host's network namespace and a fresh UTS namespace carrying the host's
name, instead of calling ssh.  A hostfile lists the lab's hosts, so hydra gives each host its own
node id and ``MPI.COMM_TYPE_SHARED`` splits per host.  ``-iface`` makes mpiexec listen on the
bridge, the one address every host can reach.

Between hosts MPICH must use TCP sockets: its UCX netmod would notice that all "hosts" share one
kernel and move bytes through shared memory, bypassing the shaped links.  So lab runs select the
OFI netmod with its tcp provider; within a host MPICH keeps its shared-memory path.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..config import ENV_LAB_STATE, lab_state_path
from ..errors import UsageError
from .spec import BRIDGE, PREFIX, LabState, lab_dir

LAUNCHER = "enter-host.sh"

_LAUNCHER_TEXT = f"""#!/bin/sh
# hydra's ssh launcher runs: {LAUNCHER} [-x] HOST COMMAND...  Enter HOST's network namespace and a
# new UTS namespace named after it, then run COMMAND as ssh would (one shell-quoted string).
[ "$1" = "-x" ] && shift
host="$1"; shift
case "$host" in
  {PREFIX}h[0-9]*) ;;
  *) echo "tunelab lab: '$host' is not a lab host" >&2; exit 2 ;;
esac
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && eval exec "$@"' "$host" "$@"
"""


def write_launcher(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LAUNCHER
    path.write_text(_LAUNCHER_TEXT)
    path.chmod(0o755)
    return path


def ranks_per_host(state: LabState, np_: int | None) -> int:
    """Ranks on each host for a job of ``np_`` ranks (None: the lab's ranks per host); UsageError
    unless they spread evenly."""
    hosts = state.spec.hosts
    if np_ is None:
        return state.spec.ranks_per_host
    if np_ % hosts:
        raise UsageError(f"--np {np_} does not spread evenly over the lab's {hosts} hosts: "
                         f"use a multiple of {hosts}")
    return np_ // hosts


def _require_hydra(mpiexec: str) -> None:
    try:
        text = subprocess.run([mpiexec, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if "HYDRA" not in text:
        raise UsageError(f"the lab launches ranks with MPICH's hydra mpiexec; {mpiexec} is not one "
                         "(install the mpich wheel)")


def mpiexec_args(state: LabState, np_: int, mpiexec: str) -> list[str]:
    """The mpiexec command line that starts ``np_`` ranks spread evenly over the lab's hosts."""
    _require_hydra(mpiexec)
    per_host = ranks_per_host(state, np_)
    directory = lab_dir()
    launcher = directory / LAUNCHER
    if not launcher.exists():
        write_launcher(directory)
    hostfile = directory / f"hosts-{per_host}"
    hostfile.write_text("".join(f"{h.name}:{per_host}\n" for h in state.hosts))
    return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher), "-f", str(hostfile),
            "-iface", BRIDGE, "-n", str(np_)]


def lab_env(base: dict[str, str]) -> dict[str, str]:
    """The launch environment for lab ranks: MPICH over TCP between hosts, the lab's state named."""
    env = dict(base)
    env["MPIR_CVAR_CH4_NETMOD"] = "ofi"
    env["FI_PROVIDER"] = "tcp"
    env[ENV_LAB_STATE] = str(lab_dir() / "lab.json")
    return env


def current_lab() -> LabState | None:
    """In a rank: the lab it was launched into (None outside a lab)."""
    path = lab_state_path()
    if path is None:
        return None
    try:
        return LabState.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
