"""Measured allreduce times from ``tunelab bench allreduce --json`` files, as model observations.

A bench file holds ``rows`` (algorithm, size, time_us, ...) and a ``hardware`` dict (world_size,
nodes, ranks_per_node, cpu_cores, and from lab or emulated runs ``link_gbps`` and the engine
``knobs``).  Rows map onto the model's algorithms: on several hosts ``ring`` is the flat ring and
``hierarchical`` the hierarchical path; on one host both are the engine's one-host path (one-shot
or two-shot by size); ``mpi`` and ``gloo`` are baselines; ``bound`` (a plain copy) is not modelled.

In a lab (``hardware["lab"]``) every system's bytes cross the shaped links, so MPI and gloo are fitted
per link (``mpi@1gbps``); behind the engine's emulated link (``hardware["link_gbps"]`` without a lab)
they are not slowed and are fitted apart (``mpi``).  The run's knobs are read from
``hardware["knobs"]`` when the file records them, else the defaults are assumed.

Every rank of a bench file is taken to run on one machine (the lab and emulated nodes do), so
the machine's oversubscription is ``world_size / cpu_cores`` unless the hardware dict says
``ranks_per_machine``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..files import read_json
from ..knobs import Knobs
from ..units import check_link
from .costs import Topology, link_name

ALGORITHM_OF_ROW = {"ring": "flat", "hierarchical": "hierarchical", "mpi": "mpi", "gloo": "gloo"}


class ModelInputError(UsageError):
    """A file the model cannot use (missing, not JSON, not bench allreduce output), or too few
    points to fit: a usage error, exit 2."""


@dataclass(frozen=True)
class Observation:
    """One measured allreduce: ``algorithm`` (model name) of ``size`` bytes on ``topo`` took ``time_s``."""

    algorithm: str
    size: int
    time_s: float
    topo: Topology
    knobs: Knobs = field(default_factory=Knobs)
    source: str = ""   # the file's name without its folder and suffix (what tables show)
    run: str = ""      # the file itself (two days' files of one name are two runs)

    @property
    def label(self) -> str:
        return f"{self.source}:{self.algorithm}@{self.size}"


MAX_SIZE = 1 << 50  # 1 PiB: a bench row larger than that is damage, not a measurement


def load_bench(path: Path, link_gbps: float | None = None) -> list[Observation]:
    """Observations in one bench allreduce file.  ``link_gbps``: the link speed of files that do not
    record theirs.  ModelInputError for anything that is not bench allreduce output."""
    doc = _read(path)
    hw = doc.get("hardware")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and "algorithm" in r for r in rows):
        raise ModelInputError(f"{path}: not a tunelab bench allreduce --json result (no allreduce rows)")
    if not isinstance(hw, dict):
        raise ModelInputError(f"{path}: its hardware facts (\"hardware\": the ranks, hosts and link the rows ran "
                              f"on) are missing or not an object, got {type(hw).__name__}")
    notes = doc.get("notes") if isinstance(doc.get("notes"), list) else []
    if doc.get("device") == "cuda" or any(str(n).startswith("device kernels:") for n in notes):
        raise ModelInputError(f"{path}: a --device cuda run; the scale model costs the engine's host path "
                              f"only (its device path takes other routes and copies)")
    latency = _number(hw, "link_latency_us", 0.0, 1e6, path)
    if latency is not None and latency > 0:
        raise ModelInputError(f"{path}: recorded behind an emulated link latency of {latency:g} us, which the "
                              "model does not cost (it would be read as a repeat of the same run without it)")
    topo, knobs = _topology(path, hw, link_gbps)
    out = []
    for i, r in enumerate(rows, 1):
        if r.get("dtype", "float32") != "float32":
            raise ModelInputError(f"{path}: row {i} is {r.get('dtype')!r}; the model is fitted on and predicts "
                                  "float32 allreduces (another dtype would be read as a repeat of them)")
        if not isinstance(r["algorithm"], str):
            raise ModelInputError(f"{path}: row {i}: algorithm must be a name, got {r['algorithm']!r}")
        algo = ALGORITHM_OF_ROW.get(r["algorithm"])
        if algo is None:
            continue  # a system the model does not cost
        raw_size, raw_time = r.get("size"), r.get("time_us")
        try:
            if isinstance(raw_size, bool) or isinstance(raw_time, bool) or int(raw_size) != raw_size:
                raise TypeError  # (true read as 1, 1.7 B as 1: not what was measured)
            size, t = int(raw_size), float(raw_time) * 1e-6
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ModelInputError(f"{path}: row {i} ({r['algorithm']}): size and time_us must be numbers (a "
                                  f"whole number of bytes), got size={raw_size!r:.40}, time_us={raw_time!r:.40}") \
                from None
        if r.get("wrong"):
            continue  # wrong results are not timings of an allreduce
        if not (0 < size <= MAX_SIZE and MIN_TIME_S <= t <= MAX_TIME_S):
            shown = f"{size:.4g}" if size <= MAX_SIZE else f"more than {MAX_SIZE:.4g}"
            raise ModelInputError(f"{path}: a row's size must be 1 B .. 1 PiB and its time 1 ns .. 1e6 s, "
                                  f"got {shown} B in {t:.4g} s")
        out.append(Observation(algo, size, t, topo, knobs, Path(path).stem, str(path)))
    return out


def load_many(paths: list[Path], link_gbps: float | None = None, combine: str = "min") -> list[Observation]:
    """Observations of every file; repeated measurements of the same allreduce (same algorithm, size,
    topology and knobs, from several files) are combined: ``min`` (default: on a shared machine other
    work only ever slows a run down, so the fastest repeat is the least disturbed), ``median``, or
    ``all`` (kept apart)."""
    obs: list[Observation] = []
    for p in paths:
        obs += load_bench(Path(p), link_gbps)
    return combine_repeats(obs, combine)


def combine_repeats(obs: list[Observation], how: str = "min") -> list[Observation]:
    if how == "all":
        return obs
    if how not in ("min", "median"):
        raise ValueError(f"combine must be min, median or all, got {how!r}")
    groups: dict[tuple, list[Observation]] = {}
    for o in obs:
        groups.setdefault((o.algorithm, o.size, o.topo, o.knobs), []).append(o)
    out = []
    for same in groups.values():
        times = sorted(o.time_s for o in same)
        t = times[0] if how == "min" else times[len(times) // 2]
        out.append(Observation(same[0].algorithm, same[0].size, t, same[0].topo, same[0].knobs,
                               same[0].source.split(".")[0]))
    return out


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = read_json(path)
    except FileNotFoundError:
        raise ModelInputError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelInputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelInputError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ModelInputError(f"{path}: not a tunelab bench allreduce --json result")
    return doc


MIN_TIME_S, MAX_TIME_S = 1e-9, 1e6  # a row's time: no allreduce takes less than a nanosecond, nor days
MAX_RANKS = 1 << 20  # a larger claim is a damaged file (a layout's cost grows with its ranks)


def _topology(path: Path, hw: dict[str, Any], link_gbps: float | None) -> tuple[Topology, Knobs]:
    try:
        return _topology_of(path, hw, link_gbps)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ModelInputError(f"{path}: hardware facts unusable ({type(exc).__name__}: {exc})") from None


def _number(facts: dict[str, Any], name: str, low: float, high: float, path: Path, prefix: str = "",
            whole: bool = False) -> float | None:
    """``facts[name]``: None where absent, else a number from ``low`` to ``high`` (a whole one with
    ``whole``), or ModelInputError naming the field (true, "50", NaN or -2 cores were read as facts)."""
    value = facts.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high or (whole and value != int(value)):
        kind = "a whole number" if whole else "a number"
        span = f" from {low:g} to {high:g}" if math.isfinite(low) else ""
        raise ModelInputError(f"{path}: hardware {prefix}{name} must be {kind}{span}, got {value!r:.40}")
    return value


def _topology_of(path: Path, hw: dict[str, Any], link_gbps: float | None) -> tuple[Topology, Knobs]:
    """The file's topology and knobs; KeyError, TypeError, ValueError or AttributeError on facts that
    are missing or of the wrong kind (:func:`_topology` names them)."""
    world = int(hw["world_size"])
    if not 1 <= world <= MAX_RANKS:
        raise ModelInputError(f"{path}: world_size must be 1 .. {MAX_RANKS} ranks, got {world}")
    nodes = int(hw.get("nodes") or 1)
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    per_node = hw.get("ranks_per_node") or [world]
    if isinstance(per_node, list) and hw.get("nodes") is not None and len(per_node) != nodes:
        raise ModelInputError(f"{path}: nodes is {hw.get('nodes')!r} but ranks_per_node lists {len(per_node)} "
                              "hosts")
    if isinstance(per_node, list):
        nodes = len(per_node)  # (the list names every host; a file without nodes is read by it)
    elif nodes > world:  # (a node holds at least one rank; and a list of 1e12 nodes is never built)
        raise ValueError(f"nodes must be 1 .. world_size ({world}), got {nodes}")
    sizes = [int(x) for x in (per_node if isinstance(per_node, list) else [per_node] * nodes)]
    cores = int(_number(hw, "cpu_cores", 0, 1 << 20, path, whole=True) or 0)  # (0: not known)
    # a file from before recursive doubling existed recorded no doubling_max_bytes: it ran rings
    knobs = Knobs(**{"doubling_max_bytes": 0, **(hw.get("knobs") or {})})
    if len(set(sizes)) != 1 or sum(sizes) != world:
        raise ModelInputError(f"{path}: the model needs the same ranks on every host, got {sizes}")
    lab = hw.get("lab") if isinstance(hw.get("lab"), dict) else None
    gbps = next((g for g in (_number(hw, "link_gbps", -math.inf, math.inf, path),  # (its range: check_link)
                             _number(lab or {}, "link_gbps", -math.inf, math.inf, path, "lab."), link_gbps)
                 if g is not None), None)
    if gbps is not None:
        check_link(gbps=float(gbps))
    per_machine = int(_number(hw, "ranks_per_machine", 1, world, path, whole=True) or world)
    over = per_machine / cores if cores else 1.0
    # Emulated nodes slow only the engine's cross-node bytes; in a lab every system crosses the link.
    on_link = lab is not None or hw.get("link_gbps") is None
    burst_s = 0.0
    if lab is not None and nodes > 1 and gbps:  # tc's token bucket in front of every lab link
        from ..lab.spec import bucket

        recorded = _number(lab, "burst_bytes", 0, 1 << 40, path, "lab.")  # (files from before it was
        # recorded ran the formula's bucket)
        burst = bucket(float(gbps))[0] if recorded is None else float(recorded)
        burst_s = burst * 8.0 / (float(gbps) * 1e9)
    return Topology(nodes, sizes[0], link_name(gbps) if nodes > 1 else "none", max(1.0, over), on_link,
                    burst_s), knobs
