"""The profiles export format (``tunelab profiles export`` / ``import``): what a valid export holds,
checked field by field before the store writes anything."""

from __future__ import annotations

import json
import math
import re
from datetime import datetime, timedelta, timezone

EXPORT_FORMAT = "tunelab-profiles"
EXPORT_VERSION = 2  # 2: trials may have the phase "check" (exports without such trials are written as 1)
# "check": a retune's blocks that set the locked configuration against the default before a search
# re-opens (the default's two, the locked one's between them)
PHASES = ("default", "explore", "remeasure", "locked", "check")


class InvalidExport(ValueError):
    """Data given to ``import_`` is not a tunelab profiles export this version can read."""


_NUM, _STR, _INT, _OBJ = ((int, float), "number"), ((str,), "string"), ((int,), "integer"), ((dict,), "object")
_PROFILE_FIELDS = {"hardware_hash": _STR, "model_signature": _STR, "framework": _STR, "world_size": _INT,
                   "hardware_name": _STR, "hardware_facts": _OBJ, "model_name": _STR, "created": _STR,
                   "updated": _STR, "trials": ((list,), "list")}
_TRIAL_FIELDS = {"uid": _STR, "knobs": _OBJ, "score": _NUM, "spread": _NUM, "steps": _INT,
                 "seconds": _NUM, "run_id": _STR, "phase": _STR, "created": _STR}
_BEST_FIELDS = {"knobs": _OBJ, "score": _NUM, "default_score": _NUM, "spread": _NUM, "run_id": _STR,
                "updated": _STR}
_BEST_OPTIONAL = {"gain_low": _NUM, "gain_high": _NUM, "steps": _INT, "outcome": _STR,  # schema 2
                  "gain": _NUM}  # schema 3: the tuner's estimate


def validate_export(data: object) -> list[dict]:
    """The export's profiles, every field checked before anything is written."""
    if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
        raise InvalidExport(f'not a tunelab profiles export (expected "format": "{EXPORT_FORMAT}")')
    version = data.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidExport(f'"version" must be an integer, got {version!r}')
    if version > EXPORT_VERSION:
        raise InvalidExport(f"export version {version} is newer than this tunelab reads ({EXPORT_VERSION})")
    if version < 1:
        raise InvalidExport(f'"version" must be 1 .. {EXPORT_VERSION}, got {version}')
    profiles = data.get("profiles")
    if not isinstance(profiles, list):
        raise InvalidExport('"profiles" must be a list')
    uids: dict[str, str] = {}
    keys: set[tuple] = set()
    for i, p in enumerate(profiles):
        _check_fields(p, _PROFILE_FIELDS, f"profiles[{i}]")
        for name in ("created", "updated"):
            p[name] = _check_time(p[name], f"profiles[{i}].{name}")
        if p["world_size"] < 1:
            raise InvalidExport(f"profiles[{i}].world_size must be >= 1")
        for name in _KEY_STRINGS:  # a profile's key: a store cannot hold (nor look up) an empty one
            if not p[name].strip():
                raise InvalidExport(f"profiles[{i}].{name} is empty")
        key = tuple(p[name] for name in (*_KEY_STRINGS, "world_size"))
        if key in keys:
            raise InvalidExport(f"profiles[{i}] has the key of an earlier profile of the file")
        keys.add(key)
        for j, t in enumerate(p["trials"]):
            where = f"profiles[{i}].trials[{j}]"
            _check_fields(t, _TRIAL_FIELDS, where)
            t["created"] = _check_time(t["created"], f"{where}.created")
            if t["phase"] not in PHASES:
                raise InvalidExport(f"{where}.phase {t['phase']!r} is not one of {PHASES}")
            _check_knobs(t["knobs"], f"{where}.knobs")
            if not t["uid"].strip():
                raise InvalidExport(f"{where}.uid is empty")
            if t["uid"] in uids:  # a uid names one trial: a second would be dropped without a word
                raise InvalidExport(f"{where}.uid is also the uid of {uids[t['uid']]}")
            uids[t["uid"]] = where
        if p.get("best") is not None:
            _check_fields(p["best"], _BEST_FIELDS, f"profiles[{i}].best")
            optional = {k: v for k, v in _BEST_OPTIONAL.items() if p["best"].get(k) is not None}
            _check_fields(p["best"], optional, f"profiles[{i}].best")
            _check_knobs(p["best"]["knobs"], f"profiles[{i}].best.knobs")
            _check_complete(p["best"]["knobs"], f"profiles[{i}].best.knobs")
            p["best"]["updated"] = _check_time(p["best"]["updated"], f"profiles[{i}].best.updated")
            b = p["best"]
            low, high = b.get("gain_low"), b.get("gain_high")
            if (low is None) != (high is None) or (low is not None and not 0 < low <= high):
                raise InvalidExport(f"profiles[{i}].best: gain_low and gain_high go together, 0 < gain_low <= gain_high")
            if b.get("gain") is not None and not (low is not None and low <= b["gain"] <= high):
                raise InvalidExport(f"profiles[{i}].best.gain must lie within gain_low .. gain_high (> 0)")
            score, default = b["score"], b["default_score"]
            if not (score > 0 and default > 0 and math.isfinite(score / default) and score / default > 0):
                # (as the store reads a best back: a ratio of two positive numbers, itself finite and > 0)
                raise InvalidExport(f"profiles[{i}].best: score and default_score must be > 0, with a finite "
                                    f"ratio (got {score!r} and {default!r})")
    _check_text(data, "the file")
    return profiles


_KEY_STRINGS = ("hardware_hash", "model_signature", "framework")


def _check_time(value: str, where: str) -> str:
    """A timestamp as the store writes its own (ISO 8601, UTC, milliseconds; one without a zone is
    taken as UTC): the store orders profiles by them and keeps the later of two ``updated`` as text,
    so a hand-edited "yesterday" or a year 9999 would sort after every real one for good."""
    # what Python 3.10's fromisoformat does not read: a "Z" for UTC, and fractions of other than 3 or 6 digits
    text = re.sub(r"[Zz]$", "+00:00", value.strip())
    text = re.sub(r"(T\d{2}:\d{2}:\d{2})[.,](\d+)", lambda m: f"{m.group(1)}.{(m.group(2) + '000000')[:6]}", text,
                  count=1)
    try:
        when = datetime.fromisoformat(text)
        when = (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
    except (ValueError, OverflowError):  # (the second: a time at the very ends of the calendar, moved to UTC)
        raise InvalidExport(f"{where} is not an ISO 8601 time (as 2026-11-28T15:15:10.123+00:00): {value[:40]!r}") from None
    if when > datetime.now(timezone.utc) + timedelta(days=1):
        raise InvalidExport(f"{where} {value!r} lies in the future")
    return when.isoformat(timespec="milliseconds")


def _check_text(value: object, where: str) -> None:
    """Every string (keys included) as text the store can hold: a lone surrogate cannot be encoded."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            stack += v
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidExport(f"{where} holds a string that is not valid text ({v[:40]!r})") from None


def _check_knobs(knobs: dict, where: str) -> None:
    """Knob settings a store may hold: known names, values in range (what jobs will apply).  They are
    rewritten in place as a job reads them ("4MiB" as 4194304, "yes" as true), so the store holds
    what its own runs write: jobs and ``profiles show`` compare stored values with knobs."""
    from .knobs import SPECS, Knobs

    unknown = sorted(set(knobs) - set(SPECS))
    if unknown:
        raise InvalidExport(f"{where}: unknown knob {unknown[0]!r}")
    try:
        read = Knobs(**knobs).as_dict()
    except (TypeError, ValueError) as exc:
        raise InvalidExport(f"{where}: {exc}") from None
    knobs.update({name: read[name] for name in knobs})


def _check_complete(knobs: dict, where: str) -> None:
    """A best config names every knob it ran with: a job applies it as stored, and what it leaves out
    would run at the job's own values, a configuration nobody measured.  Only a knob added since the
    first profiles were stored (``ADDED_LATER``) may be missing: a best stored before it ran without it."""
    from .knobs import ADDED_LATER, SPECS

    missing = [name for name in SPECS if name not in knobs and name not in ADDED_LATER]
    if missing:
        raise InvalidExport(f"{where} lacks {', '.join(repr(m) for m in missing)}: a best config names every knob "
                            "it was measured with")


def _huge_number(value: object) -> bool:
    """Whether a number anywhere in ``value`` (lists and objects walked) is an integer or a float of
    magnitude 2**63 or more: the store keeps it, but nothing that reads a size or a count can."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += list(v.values())
        elif isinstance(v, list):
            stack += v
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) >= 2 ** 63:
            return True
    return False


MAX_DEPTH = 32  # objects within objects in an export's facts (a host's are a few levels deep)


def _deeper_than(value: object, limit: int) -> bool:
    """Whether lists and objects in ``value`` nest more than ``limit`` levels (a store holding such facts
    could not be exported: copying them recurses once a level)."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth >= limit:
                return True
            stack += [(w, depth + 1) for w in (v.values() if isinstance(v, dict) else v)]
    return False


def _check_fields(obj: object, fields: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise InvalidExport(f"{where} must be an object")
    for name, (kinds, kind_name) in fields.items():
        value = obj.get(name)
        if isinstance(value, bool) or not isinstance(value, kinds):
            article = "an" if kind_name[0] in "aeiou" else "a"
            raise InvalidExport(f"{where}.{name} is missing or not {article} {kind_name}")
        if isinstance(value, (int, float)) and not (math.isfinite(value) and 0 <= value < 2 ** 63):
            raise InvalidExport(f"{where}.{name} must be a finite number >= 0 (and below 2**63)")
        if isinstance(value, dict):
            try:
                json.dumps(value, allow_nan=False)
            except ValueError:
                raise InvalidExport(f"{where}.{name} holds a number JSON cannot (NaN or infinity)") from None
            if _huge_number(value):
                raise InvalidExport(f"{where}.{name} holds a number past 2**63 (the store's and the tables' range)")
            if _deeper_than(value, MAX_DEPTH):
                raise InvalidExport(f"{where}.{name} nests lists or objects more than {MAX_DEPTH} levels deep")
