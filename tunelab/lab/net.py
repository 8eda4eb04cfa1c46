"""Building and removing a lab with iproute2: namespaces, veth pairs, a bridge and ``tc`` shaping.

Each host gets a network namespace (its own interfaces, routes and sockets) with one veth pair to
a bridge in the root namespace.  Its link is shaped in both directions with a token bucket
(``tbf``): egress of the host's ``eth0`` (what the host sends) and egress of the bridge-side end
(what it receives), so each host has a full-duplex NIC of the requested rate.  Latency needs the
``netem`` qdisc, which some kernels lack; then the lab says so and adds none.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ..errors import TunelabError, UsageError
from .spec import BRIDGE, HOST_IFACE, PREFIX, LabHost, LabSpec, LabState, bucket, host_name, veth_name

NETNS_ETC = Path("/etc/netns")  # `ip netns exec` bind-mounts NETNS_ETC/NAME/* over /etc/*
_TOOLS = ("ip", "tc", "unshare")


def require_privileges() -> None:
    """UsageError (exit 2) naming what is missing: root, iproute2 or util-linux's unshare."""
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise UsageError(f"the lab needs iproute2 (ip, tc) and util-linux (unshare); missing: {', '.join(missing)}")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise UsageError("the lab needs root (network namespaces, veth pairs and tc shaping): run it as root")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), check=False, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise TunelabError(f"'{' '.join(args)}' failed: {detail[-1] if detail else f'exit {proc.returncode}'}")
    return proc


# The names a lab makes, and only those (a namespace or link of someone else's that merely starts with
# the prefix is never touched): hosts tlab-h<i>, their veths tlab-v<i>, the bridge, netem's probe.
_OURS_NS = re.compile(rf"^{re.escape(PREFIX)}(h\d+|netem-probe)$")
_OURS_LINK = re.compile(rf"^{re.escape(PREFIX)}v\d+$|^{re.escape(BRIDGE)}$")


def _links() -> dict[str, str]:
    """Every link of the root namespace: name -> its ``ip -o link`` line."""
    out = {}
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            out[parts[1].strip().split("@")[0]] = line
    return out


def _namespaces() -> list[str]:
    """The lab's namespaces that exist now (by their exact names, ``_OURS_NS``)."""
    names = (line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines() if line.strip())
    return sorted(name for name in names if _OURS_NS.match(name))


def leftovers() -> dict[str, list[str]]:
    """Every lab object that exists now: its namespaces, links and /etc/netns folders, by their exact
    names (``_OURS_NS``, ``_OURS_LINK``)."""
    links = [name for name in _links() if _OURS_LINK.match(name)]
    etc = sorted(str(p) for p in NETNS_ETC.glob(PREFIX + "h*") if _OURS_NS.match(p.name)) if NETNS_ETC.exists() else []
    return {"namespaces": _namespaces(), "links": sorted(links), "etc": etc}


def problems(state: LabState) -> list[str]:
    """What is missing from the lab ``state`` describes: a host's namespace, its link, the bridge it
    hangs on, or the shaping of its link (a lab without its tbf would run unshaped)."""
    spaces, links = set(_namespaces()), _links()
    shaped = {words[words.index("dev") + 1] for words in map(str.split, _run("tc", "qdisc", "show", check=False)
                                                               .stdout.splitlines()) if "tbf" in words and "dev" in words}
    found = [h.name for h in state.hosts if h.name not in spaces]
    if BRIDGE not in links:
        found.append(f"the bridge {BRIDGE}")
    for h in state.hosts:
        line = links.get(h.veth)
        if line is None:
            found.append(f"{h.name}'s link {h.veth}")
        elif f"master {BRIDGE}" not in line:
            found.append(f"{h.veth} on the bridge")
        elif h.veth not in shaped:
            found.append(f"the shaping of {h.veth}")
    return found


def remove_all() -> list[str]:
    """Remove every lab object (processes inside lab namespaces are killed first); returns what was
    removed.  Safe to call when nothing is there."""
    found = leftovers()
    for space in found["namespaces"]:
        pids = _run("ip", "netns", "pids", space, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        if pids:
            time.sleep(0.2)
        _run("ip", "netns", "delete", space, check=False)
    for link in found["links"]:  # veth ends vanish with their namespace; the bridge does not
        if link.startswith(PREFIX + "v") or link == BRIDGE:
            _run("ip", "link", "delete", link, check=False)
    for folder in found["etc"]:
        shutil.rmtree(folder, ignore_errors=True)
    return found["namespaces"] + [link for link in found["links"] if link == BRIDGE] + found["etc"]


_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit", "blackhole",
                "nat", "anycast"}  # words `ip route` puts before a route's destination


def check_subnet_free(spec: LabSpec) -> None:
    """Refuse a subnet that the host already routes (the lab must not shadow a real network)."""
    import ipaddress

    net = spec.network()
    for line in _run("ip", "-4", "route", "show", check=False).stdout.splitlines():
        words = line.split()
        if not words:
            continue
        dest = words[1] if words[0] in _ROUTE_TYPES and len(words) > 1 else words[0]
        if dest == "default" or f" dev {BRIDGE} " in f"{line} ":  # (the lab's own route: it is replaced)
            continue
        try:
            other = ipaddress.IPv4Network(dest, strict=False)
        except ValueError:
            continue
        if other.overlaps(net):
            raise UsageError(f"subnet {spec.subnet} overlaps the host's route {dest}: pick another with --subnet")


def has_netem() -> bool:
    """Whether this kernel has the netem qdisc (tried on a throwaway namespace's loopback)."""
    probe = PREFIX + "netem-probe"
    _run("ip", "netns", "add", probe, check=False)
    try:
        return _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                    "delay", "1ms", check=False).returncode == 0
    finally:
        _run("ip", "netns", "delete", probe, check=False)


def _shape(prefix: tuple[str, ...], dev: str, gbps: float, latency_us: float) -> None:
    """Token-bucket shaping of ``dev``'s egress at ``gbps``, with netem latency in front if asked."""
    burst, gso = bucket(gbps)
    _run(*prefix, "ip", "link", "set", "dev", dev, "gso_max_size", str(gso))
    tbf = ["tbf", "rate", f"{gbps * 1e6:.0f}kbit", "burst", str(burst), "latency", "50ms"]
    if latency_us > 0:
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
             "delay", f"{latency_us:g}us")
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
    else:
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *tbf)


def _hosts_file(spec: LabSpec) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
    lines += [f"{spec.host_address(i)} {host_name(i)}" for i in range(spec.hosts)]
    # the same addresses as a dual-stack socket reports them, so that a reverse lookup (torch's c10d
    # names its peers) is answered here and not sent to a DNS the lab cannot reach
    lines += [f"::ffff:{spec.host_address(i)} {host_name(i)}" for i in range(spec.hosts)]
    return "\n".join(lines) + "\n"


def build(spec: LabSpec, netem: bool) -> tuple[LabHost, ...]:
    """Create the bridge and every host; the caller removes everything if this raises."""
    prefix_len = spec.network().prefixlen
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "add", f"{spec.bridge_address()}/{prefix_len}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    hosts_text = _hosts_file(spec)
    hosts = []
    for i in range(spec.hosts):
        name, veth, addr = host_name(i), veth_name(i), spec.host_address(i)
        inside = ("ip", "netns", "exec", name)
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_IFACE, "netns", name)
        _run("ip", "link", "set", veth, "master", BRIDGE, "up")
        _run("ip", "-n", name, "addr", "add", f"{addr}/{prefix_len}", "dev", HOST_IFACE)
        _run("ip", "-n", name, "link", "set", HOST_IFACE, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        latency = spec.link_latency_us / 2 if netem else 0.0  # half each way: one crossing adds the whole
        _shape(inside, HOST_IFACE, spec.link_gbps, latency)
        _shape((), veth, spec.link_gbps, latency)
        etc = NETNS_ETC / name
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_text)
        hosts.append(LabHost(name=name, address=addr, veth=veth))
    return tuple(hosts)


def link_counters(state: LabState) -> dict[str, dict[str, int]]:
    """Bytes each host's eth0 sent and received so far (what crossed its shaped link)."""
    out = {}
    for host in state.hosts:
        stats = Path(f"/sys/class/net/{host.veth}/statistics")
        try:  # the root end's rx is what the host sent, its tx what the host received
            out[host.name] = {"sent_bytes": int((stats / "rx_bytes").read_text()),
                              "received_bytes": int((stats / "tx_bytes").read_text())}
        except OSError:
            out[host.name] = {"sent_bytes": -1, "received_bytes": -1}
    return out


def qdisc_lines(state: LabState) -> list[str]:
    """``tc qdisc show`` for each host's link (its shaping as the kernel reports it)."""
    lines = []
    for host in state.hosts:
        shown = _run("tc", "qdisc", "show", "dev", host.veth, check=False).stdout.strip().splitlines()
        lines.append(f"{host.name}: " + ("; ".join(shown) if shown else "no qdisc (link missing?)"))
    return lines
