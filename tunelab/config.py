"""The one reader of ``TUNELAB_*`` environment variables.

Precedence: explicit arguments (CLI, API) > scenario file > environment > defaults.
Every knob ``k`` has the variable ``TUNELAB_<K>`` (e.g. ``TUNELAB_FUSION_THRESHOLD_BYTES=64MiB``).
Knobs set explicitly anywhere are *pinned*: the tuner leaves them alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import StoreLocationError, UsageError
from .knobs import SPECS, Knobs
from .units import check_link

ENV_PREFIX = "TUNELAB_"
ENV_RANKS_PER_NODE = "TUNELAB_RANKS_PER_NODE"
ENV_TIMEOUT_S = "TUNELAB_TIMEOUT_S"
ENV_STALL_WARNING_S = "TUNELAB_STALL_WARNING_S"
ENV_BACKEND = "TUNELAB_KERNEL_BACKEND"
ENV_TIMELINE = "TUNELAB_TIMELINE"
ENV_HOME = "TUNELAB_HOME"
ENV_LINK_GBPS = "TUNELAB_LINK_GBPS"
ENV_LINK_LATENCY_US = "TUNELAB_LINK_LATENCY_US"
ENV_RETUNE = "TUNELAB_RETUNE"        # 1: a job that auto-loads its profile keeps watching it (retunes)
ENV_LAB_DIR = "TUNELAB_LAB_DIR"      # where `tunelab lab up` keeps its state (default /run/tunelab-lab)
ENV_LAB_STATE = "TUNELAB_LAB_STATE"  # set by the launcher in lab ranks: the state file of their lab
ENV_PROFILE = "TUNELAB_PROFILE"      # which stored profile a job loads: auto (its own key's), off, or an id


# How long a rank waits for the others: a stop long enough for a rank that evaluates or saves a
# checkpoint while its peers wait in their next collective (torch.distributed's NCCL default, 10
# minutes), and a warning long before it that names what is waited for (Horovod's stall check, 60 s).
# A rank that leaves the job (its script ended or raised) ends its peers' waits at once instead: the
# coordinator's negotiation carries it.
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_STALL_WARNING_S = 60.0


@dataclass(frozen=True)
class EngineConfig:
    knobs: Knobs = field(default_factory=Knobs)
    ranks_per_node: int | None = None  # emulate nodes of this many ranks (None: real hosts)
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long a rank waits for the others before failing
    stall_warning_s: float = DEFAULT_STALL_WARNING_S  # how long it waits before saying so (and what it waits for)
    backend: str = "auto"             # GPU kernels for CUDA tensors: auto | cupy | numba-cuda | cpu (refuse them)
    pinned: frozenset[str] = frozenset()
    timeline: str | None = None        # Chrome-trace path (``{rank}`` expands per rank)
    link_gbps: float | None = None     # emulated link between emulated nodes (None: not slowed)
    link_latency_us: float = 0.0
    retune: bool = False               # after auto-loading a profile, watch step time and retune when it moves
    profile: str | int = "auto"        # the profile a job loads: "auto" (its key's), "off" (none), or a profile id


def env_knobs(environ: Mapping[str, str]) -> dict[str, str]:
    """Knob values found in ``environ`` as raw strings (validated by ``Knobs``)."""
    return {name: environ[ENV_PREFIX + name.upper()] for name in SPECS
            if environ.get(ENV_PREFIX + name.upper())}


def load_engine_config(environ: Mapping[str, str] | None = None,
                       scenario: Mapping[str, object] | None = None,
                       **explicit: object) -> EngineConfig:
    """Merge defaults, environment, scenario and explicit values (``None`` means unset)."""
    env = os.environ if environ is None else environ
    given = {k: v for k, v in explicit.items() if v is not None}
    check_environment(env, overridden=set(scenario or {}) | set(given))
    layers: list[Mapping[str, object]] = [_env_layer(env), scenario or {}, given]
    merged: dict[str, object] = {}
    for layer in layers:
        merged.update(layer)
    knob_values = {k: v for k, v in merged.items() if k in SPECS}
    other = {k: v for k, v in merged.items() if k not in SPECS}
    unknown = set(other) - {"ranks_per_node", "timeout_s", "stall_warning_s", "backend", "timeline", "link_gbps",
                            "link_latency_us", "retune", "profile"}
    if unknown:
        raise ValueError(f"unknown engine setting {min(unknown)!r}")
    rpn = other.get("ranks_per_node")
    if rpn is not None:
        rpn = _positive_int("ranks_per_node", rpn)
    timeout = _positive_float("timeout_s", other.get("timeout_s", DEFAULT_TIMEOUT_S))
    warning = _positive_float("stall_warning_s", other.get("stall_warning_s", DEFAULT_STALL_WARNING_S))
    gbps = other.get("link_gbps")
    if gbps is not None:
        gbps = _link_setting("link_gbps", gbps)
        if rpn is None:
            raise SettingsConflictError("link_gbps emulates the link between emulated nodes: set ranks_per_node too")
    latency = _link_setting("link_latency_us", other.get("link_latency_us", 0.0))
    return EngineConfig(knobs=Knobs(**knob_values), ranks_per_node=rpn, timeout_s=timeout,
                        stall_warning_s=warning,
                        backend=_backend(other.get("backend", "auto")), pinned=frozenset(knob_values),
                        timeline=str(other["timeline"]) if other.get("timeline") else None,
                        link_gbps=gbps, link_latency_us=latency, retune=_flag("retune", other.get("retune", False)),
                        profile=profile_choice("profile", other.get("profile", "auto")))


def _expanded(text: str, variable: str) -> Path:
    try:
        return Path(text).expanduser()
    except (RuntimeError, KeyError):  # ~user of a user this system does not know, or ~ with no home
        user = text.split("/")[0]
        if user == "~":
            raise StoreLocationError(f"{variable}={text}: {_NO_HOME}") from None
        raise StoreLocationError(f"{variable}={text}: no such user as {user!r} to expand") from None


# (a container run under a uid with no passwd entry and no HOME: nowhere to keep the store by default)
_NO_HOME = ("no home directory to expand '~' to (HOME is unset and this user has no passwd entry): set "
            f"{ENV_HOME} to a directory for the profile store")


def tunelab_home(environ: Mapping[str, str] | None = None) -> Path:
    """Directory of tunelab's lasting data (the profile store): ``TUNELAB_HOME``, else the user's
    data dir (``$XDG_DATA_HOME/tunelab`` or ``~/.local/share/tunelab``), so every job on the host
    finds the profiles earlier jobs tuned.  ``StoreLocationError`` (a usage error, and a StoreError)
    where none can be told: ``~user`` of an unknown user, or no home (HOME unset, no passwd entry)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_HOME):
        return _expanded(env[ENV_HOME], ENV_HOME)
    xdg = _expanded(env.get("XDG_DATA_HOME") or "", "XDG_DATA_HOME")
    if xdg.is_absolute():  # the XDG spec says relative values are to be ignored
        return xdg / "tunelab"
    if env.get("HOME"):
        home = Path(env["HOME"])
    else:
        try:
            home = Path.home()
        except (RuntimeError, KeyError, OSError):  # (no HOME, and no passwd entry for this uid)
            raise StoreLocationError("cannot locate the profile store: HOME is unset and this user (uid "
                                     f"{_uid()}) has no passwd entry: set {ENV_HOME} to a directory for it") from None
    return home / ".local" / "share" / "tunelab"


def _uid() -> str:
    getuid = getattr(os, "getuid", None)
    return str(getuid()) if getuid is not None else "?"


def lab_directory(environ: Mapping[str, str] | None = None) -> Path:
    """Where the lab's state, hostfiles and launcher live: ``TUNELAB_LAB_DIR``, else /run/tunelab-lab
    (/run is cleared at boot, as the lab's namespaces are)."""
    env = os.environ if environ is None else environ
    return Path(env.get(ENV_LAB_DIR) or "/run/tunelab-lab")


def lab_state_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """In a rank launched into a lab: its lab's state file (None elsewhere)."""
    env = os.environ if environ is None else environ
    return Path(env[ENV_LAB_STATE]) if env.get(ENV_LAB_STATE) else None


class SettingsConflictError(UsageError, ValueError):
    """Engine settings that are each valid but do not go together (a usage error: exit 2)."""


class EnvironmentSettingError(UsageError, ValueError):
    """A ``TUNELAB_*`` variable holds a value its setting cannot take (a usage error: exit 2)."""


def check_environment(environ: Mapping[str, str] | None = None,
                      overridden: set[str] | frozenset[str] = frozenset()) -> None:
    """Each ``TUNELAB_*`` engine setting in ``environ`` on its own, except those ``overridden`` (given by
    a scenario or explicitly: the environment is the lowest layer): EnvironmentSettingError naming the
    variable and its value when one is not valid (what needs two settings together is checked later)."""
    env = os.environ if environ is None else environ
    variables = {"ranks_per_node": ENV_RANKS_PER_NODE, "timeout_s": ENV_TIMEOUT_S,
                 "stall_warning_s": ENV_STALL_WARNING_S, "backend": ENV_BACKEND,
                 "link_gbps": ENV_LINK_GBPS, "link_latency_us": ENV_LINK_LATENCY_US, "retune": ENV_RETUNE,
                 "profile": ENV_PROFILE}
    checks = {"ranks_per_node": _positive_int, "timeout_s": _positive_float, "stall_warning_s": _positive_float,
              "link_gbps": _link_setting,
              "link_latency_us": _link_setting, "retune": _flag, "profile": profile_choice,
              "backend": lambda name, value: _backend(value)}
    for name, value in _env_layer(env).items():
        if name in overridden:
            continue
        try:
            if name in SPECS:
                Knobs(**{name: value})
            elif name in checks:
                checks[name](name, value)
        except ValueError as exc:
            var = variables.get(name, ENV_PREFIX + name.upper())
            raise EnvironmentSettingError(f"{var}={value!r}: {exc}") from None


def _env_layer(environ: Mapping[str, str]) -> dict[str, object]:
    layer: dict[str, object] = dict(env_knobs(environ))
    # (an empty variable is an unset one, for every setting)
    if environ.get(ENV_RANKS_PER_NODE):
        layer["ranks_per_node"] = environ[ENV_RANKS_PER_NODE]
    if environ.get(ENV_TIMEOUT_S):
        layer["timeout_s"] = environ[ENV_TIMEOUT_S]
    if environ.get(ENV_STALL_WARNING_S):
        layer["stall_warning_s"] = environ[ENV_STALL_WARNING_S]
    if environ.get(ENV_BACKEND):
        layer["backend"] = environ[ENV_BACKEND]
    if environ.get(ENV_LINK_GBPS):
        layer["link_gbps"] = environ[ENV_LINK_GBPS]
    if environ.get(ENV_LINK_LATENCY_US):
        layer["link_latency_us"] = environ[ENV_LINK_LATENCY_US]
    if environ.get(ENV_RETUNE):
        layer["retune"] = environ[ENV_RETUNE]
    if environ.get(ENV_TIMELINE):
        layer["timeline"] = environ[ENV_TIMELINE]
    if environ.get(ENV_PROFILE):
        layer["profile"] = environ[ENV_PROFILE]
    return layer


def profile_choice(name: str, value: object) -> str | int:
    """Which stored profile a job loads (``TUNELAB_PROFILE``): "auto" (the one stored under the job's
    own key: hardware, model, framework, world size), "off" (none: the job trains with its knobs as
    given), or a profile id (that profile, whatever its key; refused where its world size is not the
    job's).  In any case; an id in ASCII digits, as ``tunelab profiles list`` shows it."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 2 ** 63:
        return value
    text = value.strip() if isinstance(value, str) else ""
    if text.lower() in ("auto", "off"):
        return text.lower()
    if text.isascii() and text.isdigit() and len(text.lstrip("0")) <= 19 and 1 <= int(text) < 2 ** 63:
        return int(text)
    raise ValueError(f"{name} must be auto, off or a profile id (a positive integer, as `tunelab profiles "
                     f"list` shows it), got {value!r}")


def _flag(name: str, value: object) -> bool:
    """A switch: a bool, or 1/0, true/false, yes/no, on/off in any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {value!r}")


def _positive_int(name: str, value: object) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError  # (2.5 ranks is not 2, and True is not 1)
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a positive integer, got {value!r}") from None
    if number < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return number


def _positive_float(name: str, value: object) -> float:
    number = _float(name, value, "a number > 0")
    if not number > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return number


def _non_negative_float(name: str, value: object) -> float:
    number = _float(name, value, "a number >= 0")
    if not number >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return number


def _link_setting(name: str, value: object) -> float:
    """``link_gbps`` (> 0) or ``link_latency_us`` (>= 0), within what a link may be (:func:`link_problem`)."""
    speed = name == "link_gbps"
    number = _positive_float(name, value) if speed else _non_negative_float(name, value)
    try:
        check_link(gbps=number if speed else None, latency_us=None if speed else number)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    return number


def _float(name: str, value: object, what: str) -> float:
    if isinstance(value, bool):  # ValueError, as for any other bad setting (callers catch that one)
        raise ValueError(f"{name} must be {what}, got {value!r}")  # noqa: TRY004
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def _backend(value: object) -> str:
    names = ("auto", "cupy", "numba-cuda", "cpu")
    if value not in names:
        raise ValueError(f"backend must be one of {', '.join(names)}, got {value!r}")
    return str(value)
