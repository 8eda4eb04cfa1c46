"""Tuning runs, normalised from a ``tunelab tune --json`` file or a profile in the store."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import TunelabError, UsageError

SEARCHABLE = ("fusion_threshold_bytes", "cycle_time_ms", "segment_bytes")


def _spread(samples: list[dict[str, Any]], knobs: dict[str, Any]) -> float:
    """Mean relative spread ((p90 - p10) / median of step rates) of the samples measured at ``knobs``."""
    spreads = [float(s.get("spread", 0.0)) for s in samples if s["knobs"] == knobs]
    return sum(spreads) / len(spreads) if spreads else 0.0


def run_from_json(label: str, data: dict[str, Any]) -> dict[str, Any]:
    """A ``tunelab tune --json`` file as a run (UsageError, exit 2, when it is not one or is damaged)."""
    if not isinstance(data.get("samples"), list) or "default" not in data or "best" not in data:
        raise UsageError(f"{label}: not a tunelab tune --json result")
    _check_entries(label, data)
    if isinstance(data.get("hardware"), dict) and data["hardware"]:  # what the run itself recorded
        facts, name = data["hardware"], str(data.get("hardware_name", "?"))
    else:  # (files from before runs recorded it: from the store, where it still is; a store on another
        facts, name = _facts_from_store(data)  # machine at the same path can hold another profile there)
    return {
        "label": label, "model": str(data.get("model", "?")), "hardware_name": name, "hardware_facts": facts,
        "samples": data["samples"], "searched": list(data.get("searched", SEARCHABLE)),
        "default": {"knobs": data["default"]["knobs"], "score": data["default"]["score"],
                    "spread": _spread(data["samples"], data["default"]["knobs"])},
        "best": {"knobs": data["best"]["knobs"], "score": data["best"]["score"],
                 "spread": _spread(data["samples"], data["best"]["knobs"])},
        "locked_final": data.get("locked_final", {}).get("score"), "profile_id": data.get("profile_id"),
        "store_error": str(data["store_error"]) if data.get("store_error") else None,
        "default_recent": _recent(label, data.get("locked_final", {}).get("default_recent")),
        "runner_up": ({"knobs": data["runner_up"]["knobs"], "score": data["runner_up"]["score"],
                       "spread": _spread(data["samples"], data["runner_up"]["knobs"])}
                      if isinstance(data.get("runner_up"), dict) else None),
        "outcome": _outcome(label, data),
        "first_proposals": _first_proposals(label, data.get("first_proposals")),
    }


def _first_proposals(label: str, value: Any) -> dict[str, Any] | None:
    """Where the search started, when the scale model gave it its first candidates (None: it did not)."""
    if value is None:
        return None
    knobs = value.get("knobs") if isinstance(value, dict) else None
    if not isinstance(knobs, list) or not knobs or not all(isinstance(k, dict) for k in knobs):
        raise UsageError(f"{label}: first_proposals must be an object with a list of knob settings, got {value!r:.60}")
    return {"model_file": str(value.get("model_file", "?")), "knobs": knobs}


def _outcome(label: str, data: dict[str, Any]) -> dict[str, Any]:
    """The decision, its interval, its cost and the drift seen (runs recorded before intervals: empty)."""
    if "gain_interval" not in data:
        return {}
    keys = ("adopted", "gain_interval", "locked_from", "decision", "converged", "stop_reason", "samples_to_lock",
            "steps_to_lock", "seconds_to_lock", "drift")
    out = {k: data.get(k) for k in keys}
    out["retuned"] = str(data.get("outcome") or "").startswith("retuned:")  # (the last search's, re-opened)
    up = data.get("runner_up")
    out["runner_up_interval"] = up.get("interval") if isinstance(up, dict) else None
    for name, where in (("gain_interval", "gain_interval"), ("runner_up_interval", "runner_up.interval")):
        _check_interval(f"{label}: {where}", out[name])
    if out["drift"] is not None and not isinstance(out["drift"], dict):
        raise UsageError(f"{label}: drift must be an object (the reference's blocks), got {out['drift']!r:.60}")
    return out


def _check_interval(where: str, interval: Any) -> None:
    """A tune result's interval: null, or an object of a gain within its positive low and high."""
    if interval is None:
        return
    try:
        gain, low, high = (float(interval[k]) for k in ("gain", "low", "high"))
    except (KeyError, TypeError, ValueError):
        raise UsageError(f"{where} must be null or an object with numbers gain, low and high, "
                         f"got {interval!r:.60}") from None
    if not 0 < low <= gain <= high < math.inf:
        raise UsageError(f"{where} must have 0 < low <= gain <= high, got {low!r}, {gain!r}, {high!r}")


def _check_entries(label: str, data: dict[str, Any]) -> None:
    """What the report reads of every block and of the default and best: knobs tunelab knows, a
    non-negative score, a phase and an index; a hand-edited or truncated file is named, not a traceback."""
    from ..knobs import Knobs

    entries = [(f"sample {i + 1}", s) for i, s in enumerate(data["samples"])]
    for what, entry in [*entries, ("the default", data["default"]), ("the best", data["best"])]:
        try:
            Knobs(**entry["knobs"])
            ok = math.isfinite(float(entry["score"])) and float(entry["score"]) >= 0 and (what.startswith("the ") or (
                isinstance(entry["phase"], str) and int(entry["index"]) == entry["index"] >= 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"{label}: {what} of this tune result is damaged ({type(exc).__name__}: "
                             f"{' '.join(str(exc).split())})") from None
        if not ok:
            raise UsageError(f"{label}: {what} of this tune result is damaged (a score or index that is negative or not a number)")


def run_from_profile(profile_id: int, store: Any | None = None) -> dict[str, Any]:
    from ..profiles import ProfileStore

    store = store if store is not None else ProfileStore(create=False)
    summary = store.get(profile_id)
    if summary is None:
        raise TunelabError(f"no profile {profile_id} in {store.path}")
    trials = store.trials(profile_id)
    best = store.best_of(profile_id)
    if not trials or best is None:
        raise TunelabError(f"profile {profile_id} has no trials or no best config yet")
    # the search that set the best, alone: other runs of the profile (another default, other knobs pinned)
    # would put their blocks in its figures and its ratios to another default
    search = _search_of(best, [t for t in trials if t.run_id == best.run_id]) or trials
    samples = [{"index": i, "phase": t.phase, "knobs": t.knobs, "score": t.score, "spread": t.spread}
               for i, t in enumerate(search)]
    default = next((s for s in samples if s["phase"] == "default"), samples[0])
    nodes = int(summary.hardware_facts.get("nodes", 1) or 1)
    knobs = list(SEARCHABLE) + (["hierarchical"] if nodes > 1 else [])
    return {
        "label": f"profile {profile_id}", "model": summary.model_name, "hardware_name": summary.hardware_name,
        "hardware_facts": summary.hardware_facts, "samples": samples,
        "searched": [k for k in knobs if any(s["knobs"].get(k) != default["knobs"].get(k) for s in samples)],
        "default": {"knobs": default["knobs"], "score": best.default_score, "spread": _spread(samples, default["knobs"])},
        "best": {"knobs": best.knobs, "score": best.score, "spread": best.spread},
        "locked_final": None, "profile_id": profile_id, "default_recent": None,
        "outcome": _outcome_of_best(best, search),
    }


def _search_of(best: Any, run: list[Any]) -> list[Any]:
    """The trials of the search that set ``best``, from its run's trials in order: a run that watched its
    lock (``--retune``) recorded its locked blocks and each later search too, so they split at the locked
    blocks; a retune's lock (outcome ``retuned: ...``) is the run's last search before the best was
    written (a job may have ended in the middle of a later one), a tune's its first."""
    searches: list[list[Any]] = [[]]
    for t in run:
        if best.updated and t.created > best.updated:
            break  # measured after this best was written: a later search that never locked
        if t.phase in ("locked", "check"):  # (a check: the locked configuration between two default blocks)
            if searches[-1]:
                searches.append([])
        else:
            searches[-1].append(t)
    searches = [s for s in searches if s]
    if not searches:
        return []
    return searches[-1] if best.retuned else searches[0]


def _outcome_of_best(best: Any, search: list[Any]) -> dict[str, Any]:
    """What the store says of the search that set the profile's best, in the terms of a tune result (a
    store from before schema 2, without an outcome: empty, and the report says so).  A lock stores its
    interval and a kept default none, so the interval tells which it was."""
    if best.outcome is None:
        return {}
    adopted = best.gain_low is not None and best.gain_high is not None
    # (a lock stored before schema 3 has no estimate: the ratio of its two means may lie outside its interval)
    interval = {"gain": best.estimate, "low": best.gain_low, "high": best.gain_high, "n": None} if adopted else None
    return {"adopted": adopted, "gain_interval": interval, "converged": best.ended == "converged",
            "decision": "" if adopted else best.kept_reason(),
            "stop_reason": best.ended, "retuned": best.retuned, "samples_to_lock": len(search) or None,
            "steps_to_lock": best.steps, "seconds_to_lock": sum(t.seconds for t in search), "seconds_measured": True,
            "drift": _drift(search)}


def _drift(run: list[Any]) -> dict[str, Any] | None:
    """How far the default's blocks of that run wandered (the store keeps their scores, not their noise)."""
    refs = [t.score for t in run if t.phase == "default"]
    if len(refs) < 2:
        return None
    return {"reference_scores": refs, "range_frac": (max(refs) - min(refs)) / (sum(refs) / len(refs)),
            "block_sigma_frac": None}


def _facts_from_store(data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Hardware facts of a JSON run, from the store it was recorded in (empty when unavailable)."""
    if data.get("profile_id") is None or not data.get("store") or not Path(data["store"]).exists():
        return {}, "?"
    try:
        from ..profiles import ProfileStore

        summary = ProfileStore(data["store"], create=False).get(int(data["profile_id"]))
    except (TunelabError, OSError, ValueError):  # an unreadable store only costs the hardware table
        return {}, "?"
    return (summary.hardware_facts, summary.hardware_name) if summary else ({}, "?")


def _recent(label: str, value: Any) -> dict | None:
    """A tune JSON's ``locked_final.default_recent`` (the default's last reference blocks): null or absent
    (files from before it), or an object of a positive score and a block count; else a usage error."""
    if value is None:
        return None
    score = value.get("score") if isinstance(value, dict) else None
    blocks = value.get("blocks") if isinstance(value, dict) else None
    if isinstance(score, (int, float)) and not isinstance(score, bool) and 0 < score < math.inf \
            and isinstance(blocks, int) and not isinstance(blocks, bool) and blocks > 0:
        return {"score": float(score), "blocks": blocks}
    raise UsageError(f"{label}: locked_final.default_recent must be null or an object with a positive score and "
                     f"a whole number of blocks, got {value!r:.60}")
