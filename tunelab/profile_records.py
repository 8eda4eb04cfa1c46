"""What the profile store holds, as values: the key a profile is stored under, its summary, its
trials and its best config, and how a stored row becomes one (a row whose JSON is damaged is
:class:`DamagedProfileError`, naming the profile to delete; the file is never rewritten).  The SQLite
file itself is :mod:`tunelab.profiles`."""

from __future__ import annotations

import json
import math
import operator
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from .errors import StoreError
from .files import json_loads


@dataclass(frozen=True)
class ProfileKey:
    """What a tuned config is valid for: this hardware, this model, this framework, this many ranks."""

    hardware_hash: str
    model_signature: str
    framework: str
    world_size: int

    def __post_init__(self) -> None:
        for name in ("hardware_hash", "model_signature", "framework"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"ProfileKey.{name} must be a non-empty string")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"ProfileKey.world_size must be a positive integer, got {self.world_size!r}")

    def params(self) -> tuple[str, str, str, int]:
        return (self.hardware_hash, self.model_signature, self.framework, self.world_size)


@dataclass(frozen=True)
class ProfileSummary:
    id: int
    hardware_hash: str
    model_signature: str
    framework: str
    world_size: int
    hardware_name: str
    hardware_facts: dict
    model_name: str
    n_trials: int
    best_score: float | None
    best_gain: float | None
    created: str
    updated: str
    damage: str | None = None  # a row that cannot be read, listed anyway: why (its unreadable fields are None)

    @property
    def key(self) -> ProfileKey:
        """The key it is stored under; a key field the store holds damaged (an empty hash, a world size
        of 0) is :class:`DamagedProfileError` naming the profile, as any other damaged field."""
        try:
            return ProfileKey(self.hardware_hash, self.model_signature, self.framework, self.world_size)
        except ValueError as exc:
            raise DamagedProfileError(f"profile {self.id} is damaged ({exc}); delete that profile "
                                      f"('tunelab profiles delete {self.id} --yes') or restore the file") from None


@dataclass(frozen=True)
class Trial:
    id: int
    uid: str
    profile_id: int
    knobs: dict
    score: float    # samples/s
    spread: float   # relative, e.g. (p90 - p10) / median
    steps: int
    seconds: float
    run_id: str
    phase: str
    created: str


@dataclass(frozen=True)
class Best:
    profile_id: int
    knobs: dict
    score: float
    default_score: float
    gain: float     # the tuner's estimate where stored (schema 3), else score / default_score
    spread: float
    run_id: str
    updated: str
    gain_low: float | None = None   # the tuner's confidence interval of the gain (None: default kept,
    gain_high: float | None = None  # or stored by a tunelab before schema 2)
    steps: int | None = None        # training steps the search took until it locked
    outcome: str | None = None      # how the search ended: "converged", "budget exhausted", "retuned: ..."
    estimate: float | None = None   # the tuner's gain estimate, paired with the default's blocks (the
                                    # centre of gain_low .. gain_high); None before schema 3

    @property
    def ended(self) -> str | None:
        """How the search that set this best ended ("converged", "budget exhausted", ...), without the
        marks of a retune; None for a store from before schema 2."""
        if self.outcome is None:
            return None
        return self.outcome.removeprefix("retuned: ").removesuffix(", default kept")

    @property
    def retuned(self) -> bool:
        """Set by a search a retune re-opened after a lock (the run's last search, not its first)."""
        return (self.outcome or "").startswith("retuned:")

    def kept_reason(self) -> str:
        """Why a search that kept the default kept it."""
        if self.ended == "every knob is pinned":
            return "every knob was pinned"
        return "no configuration cleared the minimum gain"

    def interval_text(self) -> str:
        """'1.120x [1.070, 1.180]'; the plain ratio when no interval was stored, the interval alone when
        no estimate was (schema 2: the ratio of the two means there can lie outside it)."""
        if self.gain_low is None or self.gain_high is None:
            return f"{self.gain:.3f}x"
        if self.estimate is None:
            return f"[{self.gain_low:.3f}, {self.gain_high:.3f}]x"
        return f"{self.gain:.3f}x [{self.gain_low:.3f}, {self.gain_high:.3f}]"


@dataclass(frozen=True)
class ImportResult:
    profile_ids: list[int]
    profiles_added: int
    trials_added: int


# -- stored values ---------------------------------------------------------------------------------

def _plain(value: object) -> object:
    """numpy scalars and arrays as Python values (json cannot encode them)."""
    if hasattr(value, "tolist"):
        return value.tolist()  # type: ignore[no-any-return, attr-defined]
    raise TypeError(f"{type(value).__name__} value {value!r} cannot be stored as JSON")


def to_json(value: object) -> str:
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict, got {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, default=_plain, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None


def stored_number(name: str, value: object) -> float:
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def stored_count(name: str, value: object) -> int:
    number = operator.index(value)  # type: ignore[arg-type]
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return number


def trial_from_row(row: sqlite3.Row, path: Path) -> Trial:
    what = f"its trial {row['id']}"
    knobs = stored_knobs(path, row["knobs"], row["profile_id"], f"the knobs of {what} are")
    d = dict(row)
    for name in ("score", "spread", "seconds", "steps"):
        value = d[name]
        if not _finite(value) or value < 0:  # (what ProfileStore.record_trial takes)
            raise damaged(path, d["profile_id"], f"the {name} of {what} is {value!r}")
    return Trial(**{**d, "knobs": knobs})


def _finite(value: object) -> bool:
    """A stored number: an int or a float (not a bool, nor text SQLite kept as it was given), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def best_from_row(row: sqlite3.Row, path: Path) -> Best:
    d = dict(row)
    knobs = stored_knobs(path, d["knobs"], d["profile_id"], "its best config's knobs are")
    estimate = d.pop("gain", None)
    try:
        ratio = float(d["score"]) / float(d["default_score"])
    except (TypeError, ValueError, ZeroDivisionError):
        raise damaged(path, d["profile_id"], "its best config's scores are not positive numbers") from None
    if not (math.isfinite(ratio) and ratio > 0):
        raise damaged(path, d["profile_id"], "its best config's scores are not positive numbers")
    if estimate is not None and not (_finite(estimate) and estimate > 0):
        raise damaged(path, d["profile_id"], "its best config's gain is not a positive number")
    for name in ("gain_low", "gain_high", "steps", "outcome"):  # (a store before schema 2, read as it
        d.setdefault(name, None)                                # is, has none of these columns)
    for name in ("gain_low", "gain_high", "spread", "steps"):  # (what ProfileStore.set_best takes)
        value = d[name]
        if (value is not None or name == "spread") and not (_finite(value) and value >= 0):
            raise damaged(path, d["profile_id"], f"the {name} of its best config is {value!r}")
    low, high = d["gain_low"], d["gain_high"]
    centre = high if estimate is None else estimate
    if (low is None) != (high is None) or (low is not None and not low <= centre <= high):
        raise damaged(path, d["profile_id"], f"its best config's interval is [{low!r}, {high!r}]")
    for name in ("outcome", "run_id", "updated"):
        if not isinstance(d[name], str) and (d[name] is not None or name != "outcome"):
            raise damaged(path, d["profile_id"], f"the {name} of its best config is {d[name]!r}")
    gain = ratio if estimate is None else float(estimate)
    return Best(**{**d, "knobs": knobs, "gain": gain, "estimate": estimate})


_KEY_TEXTS = ("hardware_hash", "model_signature", "framework")
_TEXTS = ("hardware_name", "model_name", "created", "updated")


def summary_from_row(row: sqlite3.Row, path: Path) -> ProfileSummary:
    """A profile's row (with its trial count and best's score and gain) as its summary; a field that is
    not what the store writes (an empty or non-text key, a world size that is not a positive integer,
    facts that are not a JSON object) is :class:`DamagedProfileError` naming the profile."""
    d = dict(row)
    pid = d["id"]
    for name in (*_KEY_TEXTS, *_TEXTS):
        value = d[name]
        if not isinstance(value, str) or (name in _KEY_TEXTS and not value):
            raise damaged(path, pid, f"its {name} is {value!r}")
    size = d["world_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise damaged(path, pid, f"its world_size is {size!r}, not a positive integer")
    facts = stored_object(path, d["hardware_facts"], pid, "its hardware facts are")
    return ProfileSummary(**{**d, "hardware_facts": facts})


def damaged_summary(row: sqlite3.Row, why: str) -> ProfileSummary:
    """A damaged profile's row as a summary to list (``damage`` says why): its fields as stored where
    they can be shown as such, None where not; its facts empty."""
    d = dict(row)
    size = d["world_size"]
    score = d["best_score"]
    return ProfileSummary(**{
        **d, "hardware_facts": {}, "damage": why,
        **{name: d[name] if isinstance(d[name], str) else None for name in (*_KEY_TEXTS, *_TEXTS)},
        "world_size": size if isinstance(size, int) and not isinstance(size, bool) else None,
        "best_score": score if _finite(score) else None,
        "best_gain": d["best_gain"] if _finite(d["best_gain"]) else None})


def stored_object(path: Path, text: object, profile_id: int, what: str) -> dict:
    """A JSON object read from the store, or StoreError naming what is damaged (the file is left as is)."""
    try:
        value = json_loads(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = None
    if not isinstance(value, dict):
        raise damaged(path, profile_id, f"{what} not a JSON object")
    return value


def stored_knobs(path: Path, text: object, profile_id: int, what: str) -> dict:
    """Knob settings read from the store: a JSON object that :class:`~tunelab.knobs.Knobs` takes (known
    names, values in range), else StoreError naming what is damaged."""
    from .knobs import SPECS, Knobs

    value = stored_object(path, text, profile_id, what)
    unknown = sorted(set(value) - set(SPECS))
    if unknown:  # (a knob added since: the schema version says nothing of knobs)
        raise UnknownKnobProfileError(
            f"profile store {path}: profile {profile_id} has a knob this version of tunelab does not know "
            f"({what.removesuffix(' are')} include {unknown[0]!r}; a newer tunelab wrote it?): upgrade tunelab "
            f"to use it; the file is left as is (or delete that profile: 'tunelab profiles delete {profile_id} --yes')")
    try:
        Knobs(**value)
    except (TypeError, ValueError) as exc:
        raise damaged(path, profile_id, f"{what} not valid knobs: {exc}") from None
    return value


class DamagedProfileError(StoreError):
    """One profile's stored data cannot be read (the rest of the store can): delete it, or restore the file."""


class UnknownKnobProfileError(DamagedProfileError):
    """One profile's knobs include one this version does not know (a newer tunelab added it): not
    damaged, but as unreadable here; the message says to upgrade rather than to delete."""


def damaged(path: Path, profile_id: int, what: str) -> StoreError:
    return DamagedProfileError(f"profile store {path}: profile {profile_id} is damaged ({what}); the file is left as is: "
                      f"delete that profile ('tunelab profiles delete {profile_id} --yes') or restore the file")
