"""What a lab is: its shape (hosts, link speed, ranks per host) and the state ``lab up`` leaves behind.

Every name a lab creates starts with ``tlab-`` so that a later ``lab up`` or ``lab down`` can find
and remove whatever a killed run left: namespaces ``tlab-h0``.. (each also the host's hostname), the
bridge ``tlab-br`` in the root namespace, the root side of each veth pair ``tlab-v0``.., and the
files under ``/etc/netns/tlab-h*`` that give each host an ``/etc/hosts`` naming all lab hosts.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import TunelabError, UsageError
from ..units import link_problem

PREFIX = "tlab-"
BRIDGE = PREFIX + "br"
HOST_IFACE = "eth0"   # the host's end of its veth pair, inside its namespace
DEFAULT_SUBNET = "10.213.0.0/24"
MAX_HOSTS = 64
LINK_GBPS = (0.001, 1000.0)  # what tc's tbf is asked to shape (in whole kbit/s): 1 Mb/s to 1 Tb/s


# RFC 1918's ranges: Python's is_private also admits loopback, link-local and documentation ranges
_PRIVATE = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))


def bucket(gbps: float) -> tuple[int, int]:
    """(tbf burst, largest GSO packet) of a lab link of ``gbps``, in bytes.

    The bucket holds 100 us of traffic, at least 24 KiB: enough for the kernel's timers to keep a
    fast link busy, small enough that a message of tens of KiB cannot slip through a slow link at
    memory speed.  A packet larger than the bucket makes tbf cut it up in software, which on a
    small host costs more than the link (3x the time of a 64 MiB allreduce at 1 Gb/s, measured), so
    the veth's GSO packets are kept under the bucket: 16 KiB on slow links, 64 KiB from ~6 Gb/s up.
    While a link is idle its bucket fills again, so the next burst of up to that many bytes leaves at
    memory speed (the scale model costs that: :func:`tunelab.model.costs.hidden_s`).
    """
    burst = max(int(gbps * 1e9 / 8 * 100e-6), 24 << 10)
    return burst, (64 << 10) if burst >= (72 << 10) else (16 << 10)


def host_name(index: int) -> str:
    """Namespace name and hostname of lab host ``index``."""
    return f"{PREFIX}h{index}"


def veth_name(index: int) -> str:
    """The root-namespace end of host ``index``'s veth pair (attached to the bridge)."""
    return f"{PREFIX}v{index}"


@dataclass(frozen=True)
class LabSpec:
    """The lab a user asks for."""

    hosts: int
    link_gbps: float
    ranks_per_host: int = 1
    link_latency_us: float = 0.0
    subnet: str = DEFAULT_SUBNET

    def __post_init__(self) -> None:
        if not 2 <= self.hosts <= MAX_HOSTS:
            raise UsageError(f"a lab needs 2 to {MAX_HOSTS} hosts, got {self.hosts}")
        if not LINK_GBPS[0] <= self.link_gbps <= LINK_GBPS[1]:
            raise UsageError(f"a lab link is {LINK_GBPS[0]:g} to {LINK_GBPS[1]:g} Gb/s (tc shapes it in whole "
                             f"Mb/s), got {self.link_gbps:g}")
        if self.ranks_per_host < 1:
            raise UsageError(f"--ranks-per-host must be >= 1, got {self.ranks_per_host}")
        why = link_problem(latency_us=self.link_latency_us)  # (NaN, inf and beyond 1 s too, as everywhere)
        if why is not None:
            raise UsageError(f"--link-latency-us: {why}")
        net = self.network()
        if net.num_addresses < self.hosts + 16:
            raise UsageError(f"subnet {self.subnet} is too small for {self.hosts} hosts")
        if not any(net.subnet_of(block) for block in _PRIVATE):
            raise UsageError(f"subnet {self.subnet} is not within a private range (10.0.0.0/8, 172.16.0.0/12, "
                             "192.168.0.0/16): the lab keeps to private addresses")

    def network(self) -> ipaddress.IPv4Network:
        try:
            return ipaddress.IPv4Network(self.subnet, strict=True)
        except ValueError as exc:
            raise UsageError(f"bad --subnet {self.subnet!r}: {exc}") from None

    def bridge_address(self) -> str:
        return str(self.network().network_address + 1)

    def host_address(self, index: int) -> str:
        return str(self.network().network_address + 11 + index)


@dataclass(frozen=True)
class LabHost:
    name: str       # namespace and hostname
    address: str    # IPv4 on its eth0
    veth: str       # root-namespace end of its link


@dataclass(frozen=True)
class LabState:
    """What ``lab up`` built, saved as JSON in the lab directory for later commands."""

    spec: LabSpec
    hosts: tuple[LabHost, ...]
    netem: bool                        # whether this kernel has the netem qdisc (latency by tc)
    sustained_gbps: float | None = None  # one TCP stream between two lab hosts, measured at ``up``
    created: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    scenario: bool = False             # brought up by a scenario's run (``session``), not by ``lab up``
    users: tuple[int, ...] = ()        # the scenario runs on it now (process ids; dead ones drop out)

    @property
    def bridge(self) -> str:
        return BRIDGE

    def describe(self) -> str:
        s = self.spec
        latency = f", {s.link_latency_us:g} us latency" if s.link_latency_us else ""
        return (f"{s.hosts} hosts x {s.ranks_per_host} rank{'s' if s.ranks_per_host != 1 else ''}, "
                f"{s.link_gbps:g} Gb/s links{latency}")

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2)

    @staticmethod
    def from_json(text: str) -> LabState:
        data = json.loads(text)
        spec = LabSpec(**data["spec"])
        hosts = tuple(LabHost(**h) for h in data["hosts"])
        return LabState(spec=spec, hosts=hosts, netem=bool(data["netem"]),
                        sustained_gbps=data.get("sustained_gbps"), created=float(data.get("created", 0.0)),
                        notes=tuple(data.get("notes", ())), scenario=bool(data.get("scenario", False)),
                        users=tuple(int(u) for u in data.get("users", ())))


def lab_dir() -> Path:
    """Where the lab's state, hostfiles and launcher live (see ``config.lab_directory``)."""
    from ..config import lab_directory

    return lab_directory()


def check_lab_dir(directory: Path | None = None) -> Path:
    """The lab directory, refused (UsageError) when it is a file."""
    d = directory or lab_dir()
    if d.exists() and not d.is_dir():
        raise UsageError(f"the lab directory {d} is a file, not a directory (TUNELAB_LAB_DIR names it): "
                         "remove it or name another")
    return d


LOCK_FILE = Path("/run/tunelab-lab.lock")


@contextmanager
def lab_lock(wait_s: float = 120.0) -> Iterator[None]:
    """Hold the machine's lab lock: one ``lab up`` or ``lab down`` at a time (two at once would each
    tear down what the other builds).  Waits up to ``wait_s`` for another one to finish."""
    import fcntl
    import time

    try:
        handle = open(LOCK_FILE, "a")  # noqa: SIM115 - held for the body, closed below
    except OSError as exc:
        raise TunelabError(f"cannot open the lab's lock {LOCK_FILE}: {exc.strerror or exc}") from None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TunelabError(f"another 'tunelab lab up' or 'lab down' holds {LOCK_FILE} for more than "
                                       f"{wait_s:g} s") from None
                time.sleep(0.1)
        yield
    finally:
        handle.close()


def clear_lab_dir(directory: Path | None = None) -> None:
    """Remove the files a lab keeps in its directory (its state, launcher and hostfiles), and the
    directory when that leaves it empty; nothing else in it is touched."""
    d = check_lab_dir(directory)
    hostfiles = [path for path in d.glob("hosts-*") if path.name[len("hosts-"):].isdigit()] if d.is_dir() else []
    for path in [d / "lab.json", d / "lab.tmp", d / "enter-host.sh", *hostfiles]:
        if path.is_dir() and not path.is_symlink():
            raise UsageError(f"{path} is a directory where the lab keeps a file: remove it")
        path.unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass


def load_state(directory: Path | None = None) -> LabState | None:
    """The lab that is up, or None.  A state file that does not parse is an error, not a silent None."""
    path = (directory or lab_dir()) / "lab.json"
    if not path.exists():
        return None
    try:
        return LabState.from_json(path.read_text())
    except OSError as exc:  # a directory in its place, say
        raise TunelabError(f"lab state {path} cannot be read ({exc.strerror or exc}): remove it") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise TunelabError(f"lab state {path} is unreadable ({exc}): run 'tunelab lab down' to clear it") from None


def save_state(state: LabState, directory: Path | None = None) -> Path:
    d = directory or lab_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / "lab.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    os.replace(tmp, path)
    return path
