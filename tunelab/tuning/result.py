"""What a tuning run reports: the decision with its gain interval, the cost, and the drift it saw."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from typing import Any

import numpy as np

from ..knobs import Knobs, stored_knobs
from .driver import Driver
from .plan import Decision
from .strategies import Observation


def summarise(driver: Driver, final: list[float], workload: Any, space: Any, seconds: float, topo: Any) -> dict:
    """The JSON-able result of ``tunelab tune`` (also what the report and the profile store read)."""
    decision = driver.decisions[-1]
    default = space.base
    epoch = [s for s in driver.samples if s.epoch == decision.epoch]
    ref_scores = [s.score for s in epoch if s.role == "reference"]
    locked_scores = [s.score for s in evidence(driver, decision)]
    result: dict[str, Any] = {
        "model": workload.name, "signature": workload.signature, "world_size": topo.size,
        "nodes": topo.num_nodes, "seconds": seconds, "searched": list(space.names),
        "stop_reason": decision.stop_reason, "converged": decision.converged, "outcome": outcome(decision),
        "adopted": decision.adopted, "decision": decision.reason,
        "default": _config(default, ref_scores),
        "best": _config(decision.knobs, locked_scores),
        "gain": decision.interval.gain if decision.adopted and decision.interval else 1.0,
        "gain_interval": decision.interval.as_dict() if decision.adopted and decision.interval else None,
        "locked_from": locked_from(driver, decision),
        "steps_to_lock": decision.steps, "samples_to_lock": decision.samples, "block_steps": driver.block_steps,
        "seconds_to_lock": decision.seconds,
        "locked_final": {"score": float(np.median(final)), "scores": final,
                         "default_recent": recent_default(epoch)},
        "drift": drift_seen(driver, decision.epoch),
        "decisions": [decision_dict(d) for d in driver.decisions],
        "checks": [dataclasses.asdict(c) for c in driver.checks],
        "samples": [_sample(s) for s in driver.samples],
    }
    if not decision.adopted and decision.best is not None and decision.interval is not None:
        up = [s.score for s in epoch if s.knobs == decision.best and s.phase == "remeasure"]
        result["runner_up"] = {**_config(decision.best, up), "interval": decision.interval.as_dict()}
    return result


def recent_default(epoch: list[Any], blocks: int = 2) -> dict | None:
    """The default's last ``blocks`` reference blocks of the deciding search (the geometric mean of their
    scores, as blocks score): what the default ran at just before the final measurement, which the
    mean over the whole run is not when the host drifts.  None without a reference block."""
    refs = [s.score for s in epoch if s.role == "reference"][-blocks:]
    if not refs:
        return None
    return {"score": float(np.exp(np.mean(np.log(refs)))), "blocks": len(refs)}


def evidence(driver: Driver, decision: Decision) -> list[Any]:
    """The blocks a decision rests on: the reference's when the default was kept; else the locked
    configuration's re-measured blocks, or its exploration blocks when it was locked from them
    (a simultaneous interval, without re-measuring)."""
    epoch = [s for s in driver.samples if s.epoch == decision.epoch]
    if not decision.adopted:
        return [s for s in epoch if s.role == "reference"]
    mine = [s for s in epoch if s.knobs == decision.knobs and s.role == "candidate"]
    return [s for s in mine if s.phase == "remeasure"] or mine


def locked_from(driver: Driver, decision: Decision) -> str | None:
    """What a lock's interval rests on: ``re-measurement`` blocks, or ``exploration`` blocks (a lock from
    exploration, at a confidence that holds for every configuration explored); None when the default
    was kept or the lock was loaded, not searched."""
    if not decision.adopted or decision.interval is None:
        return None
    phases = {s.phase for s in evidence(driver, decision)}
    return "re-measurement" if "remeasure" in phases else "exploration" if "explore" in phases else None


def search_run_id(run_id: str, epoch: int) -> str:
    """The store's run id of a run's ``epoch``-th search: ``run_id`` for its first, ``run_id.rN`` for
    the N-th a retune re-opened.  Each search's ratios are to its own reference blocks, measured at its
    own time: the warm start (:func:`stored_observations`) and the report read a run id's trials as one
    search, and pooled, a later search's references would pair with an earlier one's candidates."""
    return run_id if epoch == 0 else f"{run_id}.r{epoch}"


def record_sample(store: Any, profile_id: int, run_id: str, s: Any) -> None:
    """A measured block as a trial of profile ``profile_id``, under its search's run id
    (:func:`search_run_id`; the store's phases: a reference block is the default's)."""
    phase = "default" if s.role == "reference" else s.phase
    store.record_trial(profile_id, s.knobs.as_dict(), s.score, s.spread, s.steps, s.seconds,
                       search_run_id(run_id, s.epoch), phase)


def outcome(decision: Decision) -> str:
    """How the search ended, in two words where it can: "converged" or "budget exhausted"; a search the
    watch re-opened after a lock (epoch 1 on) is "retuned: ..." and says when it kept the default, so
    the store's readers know the lock came from the run's last search, not its first."""
    if decision.converged:
        how = "converged"
    else:
        how = "budget exhausted" if "budget" in decision.stop_reason else decision.stop_reason
    if decision.epoch == 0:
        return how
    return f"retuned: {how}" + ("" if decision.adopted else ", default kept")


def gain_text(result: dict) -> str:
    """"1.12x [1.07, 1.18] over the default" or why the default was kept, with the best finalist's interval."""
    iv = result.get("gain_interval")
    if result.get("adopted") and iv:
        return f"{iv['gain']:.3f}x [{iv['low']:.3f}, {iv['high']:.3f}] over the default"
    up = result.get("runner_up")
    if up and up.get("interval"):
        u = up["interval"]
        return (f"1.000x: default kept; the best finalist measured {u['gain']:.3f}x [{u['low']:.3f}, "
                f"{u['high']:.3f}], {result.get('decision', '')}")
    return f"1.000x: default kept ({result.get('decision', 'no decision recorded')})"


def drift_seen(driver: Driver, epoch: int) -> dict:
    """The reference's blocks over time: how far the host's speed wandered, and one block's noise."""
    refs = [s for s in driver.samples if s.role == "reference" and s.epoch == epoch]
    scores = [s.score for s in refs]
    sigma, _ = driver.sigma() if refs else (float("nan"), 0)
    spread = (max(scores) - min(scores)) / float(np.mean(scores)) if len(scores) > 1 else 0.0
    return {"reference_scores": scores, "reference_at_s": [s.at_s for s in refs],
            "range_frac": spread, "block_sigma_frac": math.expm1(sigma) if refs else None,
            "disturbed_blocks": driver.disturbed_references() if refs else 0}


def decision_dict(d: Decision) -> dict:
    return {"epoch": d.epoch, "knobs": d.knobs.as_dict(), "adopted": d.adopted,
            "best": d.best.as_dict() if d.best is not None else None,
            "interval": d.interval.as_dict() if d.interval is not None else None, "reason": d.reason,
            "stop_reason": d.stop_reason, "converged": d.converged, "samples": d.samples, "steps": d.steps,
            "seconds": d.seconds}


def stored_observations(trials: list[Any], extra_sigma: float, reference: Knobs | None = None,
                        searched: Collection[str] | None = None) -> list[Observation]:
    """Earlier runs' trials as a strategy's observations: per run, each explored candidate's log
    samples/s over the mean of that run's default blocks, its variance widened by ``extra_sigma``.
    With ``reference`` (this search's default), only runs whose default blocks measured it: a run's
    ratios are to its own default, and one whose default was another configuration (before a default
    changed, or under other pins) would be told as ratios to this one.  With ``searched`` (the knobs
    this search varies) too, only candidates that keep every other knob at the reference's value: one
    that varied a knob now pinned measured a configuration this search cannot run (told as one, the
    model would read it as the pinned value's)."""
    by_run: dict[str, list[Any]] = {}
    for t in trials:
        by_run.setdefault(t.run_id, []).append(t)
    out: list[Observation] = []
    for run in by_run.values():
        refs = [t.score for t in run if t.phase == "default" and t.score > 0]
        if not refs or (reference is not None
                        and any(stored_knobs(t.knobs) != reference for t in run if t.phase == "default")):
            continue
        ref = math.log(float(np.mean(refs)))
        logs = [math.log(t) - ref for t in refs]
        noise = float(np.var(logs)) if len(logs) > 1 else 0.03 ** 2
        out += [Observation(stored_knobs(t.knobs), math.log(t.score) - ref, 2 * noise + extra_sigma ** 2)
                for t in run if t.phase == "explore" and t.score > 0
                and (reference is None or searched is None or within(stored_knobs(t.knobs), reference, searched))]
    return out


RETUNE_RUN_PREFIX = "retune-"


def samples_per_step(trials: list[Any]) -> float | None:
    """How many samples a step held in the runs that measured ``trials`` (a profile's), so a job's retune,
    which times steps and knows no batch, stores samples/s as they do; None where no trial tells.
    A trial's score is its block's geometric mean rate, so ``score * seconds / steps`` is the samples a
    step times the block's arithmetic over geometric mean step time: at least 1, and within a fraction
    of a percent of it for blocks of a few percent noise.  The smallest over the trials, rounded to a
    whole number (a global batch is one).  Retune runs' own trials are left out: earlier versions
    stored them in steps/s."""
    told = [t.score * t.seconds / t.steps for t in trials
            if not str(t.run_id).startswith(RETUNE_RUN_PREFIX) and t.steps > 0 and t.seconds > 0 and t.score > 0]
    told = [x for x in told if math.isfinite(x)]  # (finite numbers whose product overflows tell nothing)
    if not told:
        return None
    return float(max(1, round(min(told))))


def within(knobs: Knobs, reference: Knobs, searched: Collection[str]) -> bool:
    """Whether ``knobs`` differs from ``reference`` only in the ``searched`` knobs."""
    return all(v == getattr(reference, k) for k, v in knobs.as_dict().items() if k not in searched)


def _config(knobs: Knobs, scores: list[float]) -> dict:
    return {"knobs": knobs.as_dict(), "score": float(np.mean(scores)) if scores else float("nan"),
            "scores": scores}


def _sample(s: Any) -> dict:
    return {"index": s.index, "phase": s.phase, "role": s.role, "knobs": s.knobs.as_dict(), "score": s.score,
            "spread": s.spread, "steps": s.steps, "seconds": s.seconds, "at_s": s.at_s, "epoch": s.epoch,
            "ratio": math.exp(s.told) if s.told is not None else None}
