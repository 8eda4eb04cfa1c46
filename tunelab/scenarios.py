"""Scenario files: one TOML file per tuning run (workload, model, ranks, data sizes, tuning budget).

A scenario pins everything that is not a knob being tuned, so that two tuning runs of the
same file are comparable; CLI flags may still override single values
(:meth:`Scenario.with_overrides`).  Files are checked strictly, because a misspelt key
silently falling back to its default would waste a whole tuning run: every problem raises
:class:`ScenarioError` with one line naming the file and the key.

Layout (all tables optional; ``workload`` and ``model`` required)::

    name = "resnet50"          # defaults to the file name
    workload = "train"         # "train" (a real framework step) or "replay" (no framework)
    model = "resnet50"         # resnet50 | vgg16 | bert
    framework = "torch"        # torch | tensorflow (ignored by replay)
    [run]     np, ranks_per_node, device ("cpu" or "cuda"), link_gbps, link_latency_us (an emulated link between
              emulated nodes: see tunelab.engine.link)
    [data]    image_size, batch_size, seq_len
    [tuning]  budget_samples, time_budget_s, warmup_steps, discard_steps, measure_steps, block_seconds
              (a measuring block lasts at least this long: more than measure_steps where steps are short)
    [knobs]   pinned knob values (sizes may be written "64MiB")
    [replay]  backward_ms, forward_ms
    [lab]     hosts, link_gbps, ranks_per_host: run on a lab of network namespaces (tunelab.lab), brought
              up for the run when none is up
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ScenarioError
from .knobs import SPECS, Knobs
from .units import link_problem
from .workloads.shapes import MODELS

WORKLOADS = ("train", "replay")
FRAMEWORKS = ("torch", "tensorflow")
BERT_MAX_LEN = 512  # position embeddings of the bert workload
IMAGE_SIZES = (32, 1024)  # the image models' inputs: five 2x2 poolings need 32 px; past 1024 a rank's memory goes
MAX_MS = 3_600_000.0      # a replayed forward or backward pass: an hour at most
MAX_SECONDS = 7 * 86400.0  # a block, or a tuning run's time budget: a week at most


def image_size_problem(model: str, size: int) -> str | None:
    """What is wrong with training ``model`` on ``size`` px images ("must be ..."), or None."""
    if model == "bert" or IMAGE_SIZES[0] <= size <= IMAGE_SIZES[1]:
        return None
    return f"must be {IMAGE_SIZES[0]} to {IMAGE_SIZES[1]} pixels for {model}, got {size}"


# TOML layout: table (None = top level) -> {key in the file: Scenario field}.  [knobs] is separate.
_LAYOUT: dict[str | None, dict[str, str]] = {
    None: {"name": "name", "workload": "workload", "model": "model", "framework": "framework"},
    "run": {"np": "np", "ranks_per_node": "ranks_per_node", "link_gbps": "link_gbps",
            "link_latency_us": "link_latency_us", "device": "device"},
    "data": {"image_size": "image_size", "batch_size": "batch_size", "seq_len": "seq_len"},
    "tuning": {k: k for k in ("budget_samples", "time_budget_s", "warmup_steps", "discard_steps",
                              "measure_steps", "block_seconds")},
    "replay": {"backward_ms": "replay_backward_ms", "forward_ms": "replay_forward_ms"},
    "lab": {"hosts": "lab_hosts", "link_gbps": "lab_link_gbps", "ranks_per_host": "lab_ranks_per_host"},
}
_KEY_OF_FIELD = {f: (k if table is None else f"[{table}].{k}")
                 for table, keys in _LAYOUT.items() for k, f in keys.items()} | {"knobs": "[knobs]"}
_POSITIVE_INT = ("np", "image_size", "batch_size", "seq_len", "budget_samples", "measure_steps")
_NON_NEGATIVE_INT = ("warmup_steps", "discard_steps")
_NON_NEGATIVE_MS = ("replay_backward_ms", "replay_forward_ms")
DEVICES = ("cpu", "cuda")
_CHOICES = {"workload": WORKLOADS, "model": tuple(MODELS), "framework": FRAMEWORKS, "device": DEVICES}
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Scenario:
    """One tuning run's fixed settings.  Construction validates and normalises every field
    (knob sizes become byte counts), so a Scenario that exists is a runnable one."""

    name: str
    workload: str
    model: str
    framework: str = "torch"
    np: int = 2
    ranks_per_node: int | None = None
    link_gbps: float | None = None
    link_latency_us: float = 0.0
    device: str = "cpu"
    image_size: int = 64
    batch_size: int = 8
    seq_len: int = 128
    budget_samples: int = 20
    time_budget_s: float | None = None
    warmup_steps: int = 2
    discard_steps: int = 1
    measure_steps: int = 3
    block_seconds: float = 1.0
    knobs: dict[str, Any] = field(default_factory=dict)
    replay_backward_ms: float = 250.0
    replay_forward_ms: float = 100.0
    lab_hosts: int | None = None        # [lab]: run on this many lab hosts ...
    lab_link_gbps: float | None = None  # ... linked at this rate
    lab_ranks_per_host: int = 1
    path: str | None = None

    def __post_init__(self) -> None:
        where = self._where()
        for f in dataclasses.fields(self):
            if f.name != "path":
                object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name), where))
        if self.ranks_per_node is not None and self.ranks_per_node > self.np:
            raise ScenarioError(f"{where}: [run].ranks_per_node must be at most [run].np = {self.np}, "
                                f"got {self.ranks_per_node}")
        if self.link_gbps is not None and self.ranks_per_node is None:
            raise ScenarioError(f"{where}: [run].link_gbps emulates the link between emulated nodes: "
                                "set [run].ranks_per_node too")
        if self.device == "cuda" and (self.workload != "train" or self.framework != "torch"):
            raise ScenarioError(f"{where}: [run].device = \"cuda\" trains torch models; this scenario is "
                                f"{self.workload} with {self.framework}")
        if (self.lab_hosts is None) != (self.lab_link_gbps is None):
            raise ScenarioError(f"{where}: [lab] needs both hosts and link_gbps")
        if self.lab_hosts is not None and (self.ranks_per_node is not None or self.link_gbps is not None):
            raise ScenarioError(f"{where}: [lab] hosts are real hosts: drop [run].ranks_per_node and "
                                "[run].link_gbps (the emulated nodes)")
        if self.lab_hosts is not None and self.np % self.lab_hosts:
            raise ScenarioError(f"{where}: [run].np = {self.np} does not spread evenly over "
                                f"[lab].hosts = {self.lab_hosts}")
        image = image_size_problem(self.model, self.image_size) if self.workload == "train" else None
        if image is not None:
            raise ScenarioError(f"{where}: [data].image_size {image}")
        if self.model == "bert" and self.seq_len > BERT_MAX_LEN:
            raise ScenarioError(f"{where}: [data].seq_len must be at most {BERT_MAX_LEN} for bert "
                                f"(its position embeddings), got {self.seq_len}")

    def _where(self) -> str:
        return _display(Path(self.path)) if self.path else f"scenario {self.name!r}"

    def as_params(self) -> dict[str, Any]:
        """The JSON-able settings a tuning job's ranks receive."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("path",)}

    def with_overrides(self, **values: Any) -> Scenario:
        """A validated copy with ``values`` replacing fields; ``None`` means "flag not given".
        ``knobs`` are merged into the pinned ones rather than replacing them all."""
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(self)} - {"path"})
        if unknown or "path" in values:
            bad = unknown[0] if unknown else "path"
            raise ScenarioError(f"{self._where()}: cannot override {bad!r}; settings are "
                                f"{', '.join(f.name for f in dataclasses.fields(self) if f.name != 'path')}")
        changes = {k: v for k, v in values.items() if v is not None}
        if isinstance(changes.get("knobs"), dict):
            changes["knobs"] = {**self.knobs, **changes["knobs"]}
        try:
            return dataclasses.replace(self, **changes)
        except ScenarioError as exc:
            where = self._where()
            raise ScenarioError(str(exc).replace(f"{where}: ", f"{where} with overrides: ", 1)) from None


# ---- field checks ---------------------------------------------------------------------------------
def _checked(name: str, value: Any, where: str) -> Any:
    """``value`` normalised for field ``name``, or ScenarioError naming the key as the file spells it."""
    if name == "knobs":
        return _checked_knobs(value, where)
    try:
        return _check_value(name, value)
    except ValueError as exc:
        raise ScenarioError(f"{where}: {_KEY_OF_FIELD[name]} {exc}") from None


def _check_value(name: str, value: Any) -> Any:
    if name == "name":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"must be a non-empty string, got {_show(value)}")
        return value
    if name in _CHOICES:
        if value not in _CHOICES[name] or not isinstance(value, str):
            raise ValueError(f"must be one of {', '.join(map(json.dumps, _CHOICES[name]))}, got {_show(value)}")
        return value
    if name == "lab_hosts" and value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"must be an integer of at least 2, got {_show(value)}")
        return value
    if name in _POSITIVE_INT or (name in ("ranks_per_node", "lab_ranks_per_host") and value is not None):
        return _integer(value, 1, "a positive")
    if name in _NON_NEGATIVE_INT:
        return _integer(value, 0, "a non-negative")
    if name in _NON_NEGATIVE_MS:
        return _number(value, "a non-negative number of milliseconds", positive=False, high=MAX_MS)
    if name in ("link_gbps", "lab_link_gbps") and value is not None:
        gbps = _number(value, "a positive number of Gb/s", positive=True)
        _in_link_range(gbps=gbps)
        return gbps
    if name == "link_latency_us":
        latency = _number(value, "a non-negative number of microseconds", positive=False)
        _in_link_range(latency_us=latency)
        return latency
    if name in ("time_budget_s", "block_seconds") and value is not None:
        return _number(value, "a positive number of seconds", positive=True, high=MAX_SECONDS)
    return value


def _in_link_range(**link: float) -> None:
    """ValueError "must be ..." (after the key's name) where :func:`link_problem` finds the value out of range."""
    why = link_problem(**link)
    if why is not None:
        raise ValueError(why.replace("a link speed ", "", 1).replace("a link latency ", "", 1))


def _integer(value: Any, low: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"must be {what} integer, got {_show(value)}")
    return value


def _number(value: Any, what: str, positive: bool, high: float = math.inf) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0) or value > high:
        raise ValueError(f"must be {what}{'' if high == math.inf else f' up to {high:g}'}, got {_show(value)}")
    return float(value)


def _checked_knobs(knobs: Any, where: str) -> dict[str, Any]:
    """Each pinned knob validated on its own (so the error names it), sizes parsed to bytes."""
    if not isinstance(knobs, dict):
        raise ScenarioError(f"{where}: [knobs] must be a table of knob values, got {_show(knobs)}")
    out: dict[str, Any] = {}
    for name, value in knobs.items():
        if name not in SPECS:
            raise ScenarioError(f"{where}: [knobs].{name} is not a knob; knobs are {', '.join(SPECS)}")
        try:
            out[name] = getattr(Knobs(**{name: value}), name)
        except ValueError:
            raise ScenarioError(f"{where}: [knobs].{name} must be {_knob_kind(name)}, got {_show(value)}") from None
    return out


def _knob_kind(name: str) -> str:
    spec = SPECS[name]
    if spec.kind is bool:
        return "true or false"
    if name.endswith("_bytes"):
        return f'a size in {spec.describe_range()} (bytes, or e.g. "64MiB")'
    return f"a number in {spec.describe_range()}"


def _show(value: Any) -> str:
    """A value as the file would spell it, so messages quote what the user wrote."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return str(value)


def _display(path: Path) -> str:
    """The path relative to the working directory when inside it: shorter messages."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ---- files ----------------------------------------------------------------------------------------
def scenario_dirs() -> list[Path]:
    """Where shipped scenarios may live: inside the package (an installed copy) or beside it
    (a source checkout or an editable install, where ``scenarios/`` sits next to ``tunelab/``)."""
    package = Path(__file__).resolve().parent
    return [package / "scenario_files", package.parent / "scenarios"]


def _shipped_dir() -> Path | None:
    for directory in scenario_dirs():
        if directory.is_dir() and any(directory.glob("*.toml")):
            return directory
    return None


def list_scenarios() -> list[str]:
    """Names of the shipped scenarios (file names without ``.toml``), sorted."""
    directory = _shipped_dir()
    return sorted(p.stem for p in directory.glob("*.toml")) if directory else []


def _toml() -> Any:
    """tomllib (Python 3.11+) or, on 3.10, the tomli backport; imported on first use so that the
    rest of tunelab works on 3.10 without it."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # pragma: no cover - Python 3.10
        import tomli
    except ImportError:  # pragma: no cover
        raise ScenarioError("reading scenario files on Python 3.10 needs tomli: pip install tomli") from None
    return tomli  # pragma: no cover


def scenario_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The file a shipped scenario's name, or a path, stands for (ScenarioError where a name names none)."""
    text = os.fspath(name_or_path)
    if not text.strip():
        raise ScenarioError(f"an empty scenario name; shipped scenarios are {', '.join(list_scenarios())}")
    if not _NAME_RE.fullmatch(text) or text.endswith(".toml"):
        try:
            return Path(text).expanduser()
        except RuntimeError:  # ~user of a user this system does not know (the shell left it as it was)
            raise ScenarioError(f"{text}: no such user as {text.split('/')[0]!r} to expand") from None
    directory = _shipped_dir()
    if (directory is None or not (directory / f"{text}.toml").is_file()) and Path(text).is_file():
        return Path(text)  # not a shipped name, but a file by that name (any extension) is here: read it
    if directory is None:
        raise ScenarioError(f"no scenario named {text!r}: no scenarios directory found "
                            f"(looked in {', '.join(map(str, scenario_dirs()))})")
    path = directory / f"{text}.toml"
    if not path.is_file():
        raise ScenarioError(f"no scenario named {text!r} (nor a file of that name here); "
                            f"shipped scenarios are {', '.join(list_scenarios())}")
    return path


def load_scenario(name_or_path: str | os.PathLike[str]) -> Scenario:
    """Load a shipped scenario by name (``"resnet50"``) or any scenario file by path."""
    path = scenario_path(name_or_path)
    where = _display(path)
    toml = _toml()
    try:
        doc = toml.loads(path.read_text(encoding="utf-8-sig"))  # (a BOM, as some editors write, is not TOML)
    except FileNotFoundError:
        raise ScenarioError(f"{where}: no such scenario file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{where}: cannot read the file: {getattr(exc, 'strerror', None) or exc}") from None
    except toml.TOMLDecodeError as exc:
        raise ScenarioError(f"{where}: invalid TOML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ScenarioError(f"{where}: invalid TOML: arrays or tables nested too deeply") from None
    values = _fields_from_toml(doc, where)
    if "replay" in doc and values.get("workload") == "train":
        raise ScenarioError(f"{where}: [replay] sets a replay's timings; this scenario trains {values.get('model')} "
                            "(workload = \"train\"): drop [replay]")
    for required in ("workload", "model"):
        if required not in values:
            raise ScenarioError(f"{where}: {required} is required "
                                f"(one of {', '.join(map(json.dumps, _CHOICES[required]))})")
    values.setdefault("name", path.stem)
    if "lab_hosts" in values and "np" not in values and isinstance(values["lab_hosts"], int) \
            and values["lab_hosts"] >= 1:
        per_host = values.get("lab_ranks_per_host", 1)
        # (a per-host count that is not a positive integer leaves np alone: the Scenario names that field)
        values["np"] = values["lab_hosts"] * (per_host if isinstance(per_host, int) and per_host >= 1 else 1)
    return Scenario(**values, path=str(path.resolve()))


def _fields_from_toml(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """Map the file's tables onto Scenario fields, refusing keys the format does not have."""
    tables = [t for t in _LAYOUT if t is not None] + ["knobs"]
    values: dict[str, Any] = {}
    for key, value in doc.items():
        if key in _LAYOUT[None]:
            values[_LAYOUT[None][key]] = value
        elif key == "knobs":
            values["knobs"] = value  # checked knob by knob in Scenario
        elif key in _LAYOUT:
            if not isinstance(value, dict):
                raise ScenarioError(f"{where}: [{key}] must be a table, got {_show(value)}")
            for sub, item in value.items():
                if sub not in _LAYOUT[key]:
                    raise ScenarioError(f"{where}: [{key}].{sub} is not a known key; "
                                        f"[{key}] takes {', '.join(_LAYOUT[key])}")
                values[_LAYOUT[key][sub]] = item
        else:
            raise ScenarioError(f"{where}: {key} is not a known key; top-level keys are "
                                f"{', '.join(_LAYOUT[None])} and tables {', '.join(f'[{t}]' for t in tables)}")
    return values
