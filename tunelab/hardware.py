"""What this host is: CPU, memory, MPI library and software versions (for benchmark records).

``fingerprint()`` condenses the facts a tuned config depends on into a stable hash, so tuning
profiles are shared by every run on the same kind of machine and job layout.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def host_info(gpus: bool = False) -> dict[str, object]:
    """Facts about this host and the software stack that shape communication speed (``gpus``: with the
    GPU facts of ``nvidia-smi`` too, for a job that runs on them)."""
    import numpy

    info: dict[str, object] = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count() or 0,
        "memory_bytes": _memory_bytes(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        pass
    try:
        from mpi4py import MPI

        info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
    except ImportError:
        pass
    if gpus:
        info.update(_gpu_facts())
    return info


def fact_text(name: str, value: object) -> str:
    """One fact as people read it: sizes in binary units, ``{"torch": "2.13"}`` as "torch 2.13", lists
    joined, version banners on one line."""
    from .units import human_size

    if name.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        return human_size(value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    return " ".join(str(value).split())


# --- Fingerprint: which tuning profile a run belongs to -------------------------------------------

# Facts recorded for people but kept out of the hash: the same machine type under another name
# (a rebuilt node, a cloud instance) should find the profile it already tuned, and so should the
# same GPUs after a driver update (the CUDA version, which the driver's update may raise, stays in).
# Framework versions are hashed as major.minor, and only the job's own framework's (see
# :func:`fingerprint_from_facts`): installing TensorFlow beside torch, or a patch release, changes
# nothing the knobs depend on.
UNHASHED_FACTS = frozenset({"hostname", "gpu_driver"})
_NVIDIA_SMI_TIMEOUT_S = 15.0  # (a many-GPU node's topo -m can take seconds)
_FRAMEWORK_DISTRIBUTIONS = {
    "torch": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tensorflow-intel"),
}


@dataclass(frozen=True)
class Fingerprint:
    """What a tuned config depends on: ``hash`` keys profiles, ``name`` is for people, ``facts`` for both."""

    name: str
    hash: str
    facts: dict
    # the hash tunelab gave the same facts before 2026-11-29 (every installed framework's full version
    # and the GPU driver in it): a profile stored under it is still found, and moves at its next tune
    legacy_hash: str = ""


def fingerprint(nodes: int, ranks_per_node: list[int] | tuple,
                frameworks: tuple[str, ...] = ("torch", "tensorflow"),
                emulated_link: str | None = None, lab_link: str | None = None,
                usable_cores: int | None = None, framework: str | None = None) -> Fingerprint:
    """Fingerprint this host's hardware and software for a job of ``nodes`` nodes.
    ``frameworks``: those whose installed versions the facts record; ``framework``: the job's own, the
    only one whose version (major.minor) the hash takes (None: every recorded one's).
    ``emulated_link`` (e.g. ``"10 Gb/s"``) names the emulated link between emulated nodes: a
    config tuned behind one is not the best config without it, so it is part of the hash.
    ``usable_cores``: the cores the job's ranks on this host may run on together (the union of their
    affinities, :attr:`tunelab.engine.topology.Topology.host_cores`); by default this process's own.

    Cheap enough to call at every job start: no torch/tensorflow import (versions come from the
    installed metadata), and the GPU query is one short ``nvidia-smi`` call.
    """
    layout = _layout(nodes, ranks_per_node)
    facts: dict[str, object] = {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count() or 0,
        "cpu_sockets": _cpu_sockets(),
        # whole GiB: the kernel's reserved memory varies a little between boots and kernels
        "memory_gib": round(_memory_bytes() / (1 << 30)),
        **_gpu_facts(),
        "nodes": nodes,
        "ranks_per_node": layout,
        "mpi_library": _mpi_library_line(),
        "frameworks": _framework_versions(frameworks),
    }
    usable = usable_cores if usable_cores is not None else _usable_cores()
    if usable is not None and usable != facts["cpu_cores"]:
        # a job held to some of the cores (taskset, a cgroup's cpuset, a scheduler's binding) runs its
        # ranks and kernel threads on those only: its best knobs are not those of the whole machine
        # (only then a fact: profiles tuned on every core keep the hash they had)
        facts["cpu_usable"] = usable
    if emulated_link:
        facts["emulated_link"] = emulated_link
    if lab_link:  # the shaped link between lab hosts (tunelab.lab): as much a part of the hardware
        facts["lab_link"] = lab_link
    return fingerprint_from_facts(facts, framework)


def fingerprint_from_facts(facts: dict, framework: str | None = None) -> Fingerprint:
    """The fingerprint of already-collected facts (e.g. gathered on rank 0 or read from a profile), for
    a job of ``framework`` (None: every framework the facts record counts)."""
    hashed = {k: v for k, v in facts.items() if k not in UNHASHED_FACTS}
    versions = dict(facts.get("frameworks") or {})
    if framework is not None:
        versions = {k: v for k, v in versions.items() if k == framework}
    if "frameworks" in facts:
        hashed["frameworks"] = {k: _major_minor(str(v)) for k, v in versions.items()}
    legacy = {k: v for k, v in facts.items() if k != "hostname"}
    return Fingerprint(name=_readable_name(facts), hash=_digest(hashed), facts=dict(facts), legacy_hash=_digest(legacy))


def _digest(facts: dict) -> str:
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _major_minor(version: str) -> str:
    """``2.13.0+cpu`` -> ``2.13``; a version that does not start with numbers stays as it is."""
    match = re.match(r"\d+(\.\d+)?", version)
    return match.group() if match else version


def _layout(nodes: int, ranks_per_node: list[int] | tuple) -> list[int]:
    layout = [int(r) for r in ranks_per_node]
    if int(nodes) < 1 or len(layout) != int(nodes) or any(r < 1 for r in layout):
        raise ValueError(f"ranks_per_node must list a positive rank count for each of the {nodes} "
                         f"node(s), got {list(ranks_per_node)!r}")
    return layout


def _usable_cores() -> int | None:
    """The cores this process may run on (its CPU affinity), where the platform says (None elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _cpu_sockets() -> int:
    """Distinct physical packages in /proc/cpuinfo (1 where the kernel does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            ids = {line.split(":", 1)[1].strip() for line in f if line.startswith("physical id")}
    except OSError:
        ids = set()
    return max(1, len(ids))


def _gpu_facts() -> dict[str, object]:
    """GPU model, count, memory, driver, CUDA version and interconnect from ``nvidia-smi`` (no CUDA
    library is loaded for this)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"gpu_count": 0}
    why: list[str] = []
    listing = _run_quietly([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], why)
    facts = parse_nvidia_smi(listing or "")
    if not facts.get("gpu_count"):
        # exit status 6 (no device found) and 9 (no driver loaded) are a machine without a GPU; a
        # timeout or another failure may be one whose GPUs did not answer, fingerprinted as without
        if listing is None and why and why[0] not in ("exit status 6", "exit status 9"):
            _warn_once(f"# hardware: nvidia-smi --query-gpu failed ({why[0]}): the fingerprint counts no GPU, "
                       "so a profile tuned with this machine's GPUs will not be found")
        return {"gpu_count": 0}
    banner, topology = _run_quietly([exe]), _run_quietly([exe, "topo", "-m"])
    match = re.search(r"CUDA Version:\s*([\d.]+)", banner or "")
    if match:
        facts["cuda_version"] = match.group(1)
    facts["gpu_interconnect"] = parse_nvidia_topology(topology or "", int(facts["gpu_count"]))  # type: ignore[arg-type]
    failed = [(command, fact) for command, fact, out in (("nvidia-smi", "CUDA version", banner),
                                                         ("nvidia-smi topo -m", "interconnect", topology)) if out is None]
    if failed:  # the fingerprint then lacks facts a profile was recorded with: say so, once a process
        _warn_once(f"# hardware: {' and '.join(c for c, _ in failed)} failed or gave no answer within "
                   f"{_NVIDIA_SMI_TIMEOUT_S:g} s: the GPU fingerprint lacks the {' and the '.join(f for _, f in failed)}, "
                   "so a profile tuned on this machine may not be found")
    return facts


_WARNED: set[str] = set()


def _warn_once(line: str) -> None:
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr, flush=True)


def _run_quietly(cmd: list[str], why: list[str] | None = None) -> str | None:
    """A short command's standard output, or None when it fails (``why`` then gets the reason)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        reason = f"no answer within {_NVIDIA_SMI_TIMEOUT_S:g} s"
    except (OSError, subprocess.SubprocessError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if proc.returncode == 0:
            return proc.stdout
        reason = f"exit status {proc.returncode}"
    if why is not None:
        why.append(reason)
    return None


def parse_nvidia_smi(text: str) -> dict[str, object]:
    """Facts from ``name,memory.total[,driver_version]`` CSV lines such as
    ``NVIDIA H100 80GB HBM3, 81559 MiB, 575.57.08``."""
    models: list[str] = []
    mib: list[int] = []
    drivers: set[str] = set()
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 3 and re.fullmatch(r"[\d.]+", fields[-1]) and re.search(r"\d+\s*MiB", fields[-2]):
            drivers.add(fields[-1])
            fields = fields[:-1]
        name, memory = ",".join(fields[:-1]).strip(), fields[-1] if fields else ""
        match = re.search(r"\d+", memory)
        if not name or match is None:
            continue
        models.append(name)
        mib.append(int(match.group()))
    if not models:
        return {"gpu_count": 0}
    facts: dict[str, object] = {"gpu_model": " + ".join(sorted(set(models))), "gpu_count": len(models),
                                "gpu_memory_gib": round(min(mib) / 1024)}
    if drivers:
        facts["gpu_driver"] = " + ".join(sorted(drivers))
    return facts


def parse_nvidia_topology(text: str, gpu_count: int) -> str:
    """How the GPUs of this host connect, from ``nvidia-smi topo -m``: the distinct link kinds
    between GPU pairs (``NV18`` for 18 NVLinks, ``PIX``/``PXB``/``PHB``/``NODE``/``SYS`` for PCIe
    paths), or ``single GPU``."""
    if gpu_count <= 1:
        return "single GPU"
    links: set[str] = set()
    for line in text.splitlines():
        cells = line.split()
        if line[:1].isspace() or not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue  # the header row is indented; GPU rows start with their name
        row = int(cells[0][3:])
        for col, cell in enumerate(cells[1:1 + gpu_count]):
            if col != row and cell != "X":
                links.add(cell)
    return ", ".join(sorted(links)) if links else "unknown"


def _mpi_library_line() -> str:
    try:
        from mpi4py import MPI
    except ImportError:
        return "none"
    lines = MPI.Get_library_version().strip().splitlines()
    return " ".join(lines[0].split()) if lines else "unknown"


def _framework_versions(frameworks: tuple[str, ...]) -> dict[str, str]:
    """Installed versions from package metadata; frameworks that are not installed are left out."""
    versions: dict[str, str] = {}
    for framework in frameworks:
        for dist in _FRAMEWORK_DISTRIBUTIONS.get(framework, (framework,)):
            try:
                versions[framework] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def _readable_name(facts: dict) -> str:
    """E.g. ``AMD EPYC (2 cores, 24 GiB) | 1 node x 2 ranks | MPICH 5.0.2 | torch 2.13``."""
    sockets = int(facts.get("cpu_sockets", 1) or 1)
    cpu = (f"{sockets}x " if sockets > 1 else "") + _short_cpu(str(facts.get("cpu_model", "?")))
    cores = f"{facts.get('cpu_cores', '?')} cores"
    if facts.get("cpu_usable"):  # a job held to some of them
        cores = f"{facts['cpu_usable']} of {cores}"
    parts = [f"{cpu} ({cores}, {facts.get('memory_gib', '?')} GiB)"]
    if facts.get("gpu_count"):
        link = facts.get("gpu_interconnect")
        parts.append(f"{facts['gpu_count']}x {facts.get('gpu_model', 'GPU')} "
                     f"({facts.get('gpu_memory_gib', '?')} GiB{', ' + str(link) if link else ''})")
    layout = list(facts.get("ranks_per_node") or [])
    nodes = int(facts.get("nodes", len(layout)) or 0)
    ranks = str(layout[0]) if len(set(layout)) == 1 else "+".join(map(str, layout)) or "?"
    parts.append(f"{nodes} node{'s' if nodes != 1 else ''} x {ranks} rank{'s' if ranks != '1' else ''}")
    if facts.get("emulated_link"):
        parts[-1] += f" (emulated link {facts['emulated_link']})"
    if facts.get("lab_link"):
        parts[-1] += f" (lab link {facts['lab_link']})"
    parts.append(_short_mpi(str(facts.get("mpi_library", "none"))))
    for framework, version in dict(facts.get("frameworks") or {}).items():
        parts.append(f"{framework} {_major_minor(str(version))}")
    return " | ".join(parts)


def _short_cpu(model: str) -> str:
    model = re.sub(r"\((R|TM|tm|r)\)", "", model)
    model = re.sub(r"\s+(CPU\s+)?@\s*[\d.]+\s*GHz", "", model)
    return " ".join(model.split()) or "unknown CPU"


def _short_mpi(line: str) -> str:
    """``MPICH Version: 5.0.2`` -> ``MPICH 5.0.2``; ``Open MPI v4.1.5, package: ...`` -> ``Open MPI v4.1.5``."""
    head = line.split(",", 1)[0].replace("Version:", " ")
    return " ".join(head.split()) or "no MPI"
