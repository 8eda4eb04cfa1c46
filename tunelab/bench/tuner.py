"""``tunelab bench tuner``: search strategies compared on recorded landscapes, without training.

Each run is the protocol users get: the tuning driver (:mod:`tunelab.tuning.driver`: reference blocks,
exploration, re-measurement, the interval rule, lock) fed step times replayed from a landscape with its
recorded noise and a seeded host drift (:mod:`tunelab.tuning.replay`).  Only the strategy behind
``ask``/``tell`` changes between rows (:mod:`tunelab.tuning.strategies`).  What is scored is the
**locked** configuration, at its true (recorded mean) throughput:

* ``median_samples_to_lock``: measured blocks until the lock, reference blocks included;
* ``locked_within_3pct_frac``: seeds whose locked configuration is within 3 % of the landscape's best;
* ``locked_worse_than_default_frac``: seeds whose locked configuration is more than 1 % slower than the
  default (the landscape's grid point nearest to the default knobs).

Each fraction comes with its 90 % Wilson score interval over the seeds (``..._interval``: [low, high]):
20 seeds tell a fraction to about +-0.15, so a row 0.05 short of a target is not a miss the seeds can show.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..cli.finish import add_output_flags, finish
from ..cli.types import (
    choice_list,
    fraction,
    input_file,
    link_gbps,
    named_input,
    positive_int,
    scenario_input,
)
from ..errors import TunelabError, UsageError
from ..knobs import Knobs
from ..tuning.driver import Driver
from ..tuning.plan import Plan
from ..tuning.replay import VISIT_MODES, Drift, Landscape, Objective, simulate, visit_mode
from ..tuning.strategies import STRATEGIES, SeededStrategy, make_strategy

WITHIN = 0.97        # locked within 3 % of the landscape's best
WORSE = 0.99         # locked more than 1 % slower than the default
SHARE_CONFIDENCE = 0.9  # two-sided, of the intervals around the fractions over seeds
# the targets a strategy is judged by on each landscape: median samples to lock at most this many, locked
# within 3 % of the best in at least this share of seeds, more than 1 % worse than the default in at most this
TARGET_SAMPLES, TARGET_WITHIN, TARGET_WORSE = 12, 0.90, 0.05
MODEL_SCENARIO = "replay-resnet50"  # the workload of --model-file runs without --scenario
LANDSCAPE_DIR = Path(__file__).resolve().parent / "landscapes"

__all__ = ["LANDSCAPE_DIR", "Landscape", "compare", "evaluate", "run_once"]


def plan_for(landscape: Landscape, budget: int | None = None) -> Plan:
    """The plan ``tunelab tune`` runs for the landscape's scenario: its budget and block sizes, as they were
    recorded (``budget`` overrides; a landscape without a known scenario gets the defaults)."""
    rec = landscape.recorded or {}
    scenario_budget, _ = _scenario_budget(landscape)
    return Plan(budget_samples=budget or scenario_budget or Plan().budget_samples,
                discard_steps=int(rec.get("discard_steps", Plan().discard_steps)),
                measure_steps=int(rec.get("measure_steps", Plan().measure_steps)),
                block_seconds=float(rec.get("block_seconds", Plan().block_seconds)))


def _scenario_budget(landscape: Landscape) -> tuple[int | None, str | None]:
    """The exploration budget of the scenario the landscape was recorded with, and why there is none
    when it names one that cannot be loaded here (None when it names none)."""
    from ..errors import ScenarioError
    from ..scenarios import load_scenario

    name = (landscape.recorded or {}).get("scenario")
    if name is None:
        return None, None
    try:
        return load_scenario(name).budget_samples, None
    except ScenarioError:
        return None, (f"its scenario {name!r} cannot be loaded here: the default budget of "
                      f"{Plan().budget_samples} blocks is used (--budget sets another)")


def run_once(landscape: Landscape, strategy: str, seed: int, plan: Plan, drift: float,
             drift_period_s: float = 120.0, visit_noise: bool | str = True,
             first: list[Knobs] | None = None) -> Driver:
    """One seeded tuning run of ``strategy`` on ``landscape`` through the driver, until it locks
    (``visit_noise``: the host's state from visit to visit, as recorded, pooled or off, :class:`Objective`;
    ``first``: settings its first search asks before its own, as ``tune`` takes the scale model's)."""
    def made(epoch: int) -> Any:
        inner = make_strategy(strategy, landscape.space, seed + 1000 * epoch)
        return SeededStrategy(inner, first) if epoch == 0 and first else inner

    driver = Driver(landscape.space, made, plan, landscape.samples_per_step)
    return simulate(driver, Objective(landscape, seed, Drift(drift, drift_period_s, seed), visit_noise=visit_noise))


def evaluate(landscape: Landscape, strategy: str, seeds: int, plan: Plan | None, drift: float,
             visit_noise: bool | str = True, first: list[Knobs] | None = None) -> tuple[dict, list]:
    """One table row over ``seeds`` runs, and each run's curve: the true throughput of the configuration
    in effect for the user (the default until the lock, then the locked one) after each block,
    relative to the landscape's best.  With ``first`` (the scale model's first proposals) the row's
    strategy is ``<strategy>+model``."""
    plan = plan or plan_for(landscape)
    default = landscape.true_score(landscape.space.base)
    samples, steps, within, worse, adopted, rel, curves, held = [], [], [], [], [], [], [], []
    for seed in range(seeds):
        driver = run_once(landscape, strategy, seed, plan, drift, visit_noise=visit_noise, first=first)
        if not driver.decisions:
            raise TunelabError(f"strategy {strategy} did not lock on {landscape.name} (seed {seed})")
        d = driver.decisions[0]
        locked = landscape.true_score(d.knobs)
        samples.append(d.samples)
        steps.append(d.steps)
        within.append(locked >= WITHIN * landscape.best)
        worse.append(locked < WORSE * default)
        adopted.append(d.adopted)
        rel.append(locked / landscape.best)
        if d.adopted and d.interval is not None:  # the gain it claimed: does the truth reach its low end?
            true_gain = landscape.true_log_rate(d.knobs) - landscape.true_log_rate(landscape.space.base)
            held.append(true_gain >= math.log(d.interval.low))
        curves.append([default / landscape.best] * (d.samples - 1) + [locked / landscape.best])
    row = {"landscape": landscape.name, "strategy": f"{strategy}+model" if first else strategy, "seeds": seeds,
           "budget": plan.budget_samples,
           "median_samples_to_lock": float(np.median(samples)), "p90_samples_to_lock": float(np.percentile(samples, 90)),
           "median_steps_to_lock": float(np.median(steps)),
           "locked_within_3pct_frac": float(np.mean(within)),
           "locked_within_3pct_interval": share_interval(within),
           "locked_worse_than_default_frac": float(np.mean(worse)),
           "locked_worse_than_default_interval": share_interval(worse),
           "adopted_frac": float(np.mean(adopted)), "median_locked_vs_best": float(np.median(rel)),
           "locked_low_end_held_frac": float(np.mean(held)) if held else None}
    if first:
        row["first_proposals"] = [k.as_dict() for k in first]
    return row, curves


def share_interval(flags: list[bool], confidence: float = SHARE_CONFIDENCE) -> list[float]:
    """The Wilson score interval, [low, high], of the fraction of ``flags`` that are true: what the seeds
    say of the fraction a strategy would show over many more seeds."""
    from scipy.stats import binomtest

    ci = binomtest(int(sum(flags)), len(flags)).proportion_ci(confidence_level=confidence, method="wilson")
    return [float(ci.low), float(ci.high)]


def compare(landscapes: list[Landscape], strategies: tuple[str, ...], seeds: int, budget: int | None,
            drift: float, visit_noise: bool | str = True,
            first: dict[str, list[Knobs]] | None = None) -> dict:
    """Every strategy on every landscape; with ``first`` (a landscape's name -> the scale model's first
    proposals for it), each strategy again on those landscapes, seeded with them (``<strategy>+model``
    rows, compared in ``model_first``; the scoreboard counts the plain rows)."""
    visit_noise = visit_mode(visit_noise)
    first = first or {}
    rows: list[dict] = []
    pooled: dict[str, list] = {}
    for land in landscapes:
        for strategy in strategies:
            for seeded in ([None, first[land.name]] if first.get(land.name) else [None]):
                row, curves = evaluate(land, strategy, seeds, plan_for(land, budget), drift, visit_noise, seeded)
                rows.append(row)
                pooled.setdefault(row["strategy"], []).extend(curves)
    info = {}
    for land in landscapes:
        plan = plan_for(land, budget)
        steps = plan.measure_steps
        info[land.name] = {"best": land.best, "default": land.true_score(land.space.base),
                           "plan": dict(vars(plan)),  # (what ran on it: its budget and block steps)
                           "points": len(land.knobs), "names": list(land.space.names), "block_steps": steps,
                           "exhaustive_within_3pct": exhaustive_pick(land, steps, visit_noise=visit_noise),
                           "visit_noise": {"sigma": land.visit_sigma, "seconds": land.visit_seconds,
                                           "replayed": visit_noise != "off", "mode": visit_noise}
                           if land.visit_sigma > 0 else None,
                           "truth_ceiling_within_3pct": truth_ceiling(land),
                           "recording_drift_removed": (land.recorded or {}).get("drift_removed"),
                           "scenario_problem": None if budget else _scenario_budget(land)[1]}
    board = scoreboard([r for r in rows if "first_proposals" not in r])
    board["ceiling"] = ceiling(info)
    return {"rows": rows, "curves": {s: _median_curve(c) for s, c in pooled.items()}, "landscapes": info,
            "scoreboard": board,
            "model_first": model_first(rows),
            "seeds": seeds, "drift": drift, "visit_noise": visit_noise != "off", "visit_noise_mode": visit_noise,
            "plan": dict(vars(Plan())),  # the defaults; each landscape's own: landscapes.<name>.plan
            "target": f"locked within {100 * (1 - WITHIN):.0f}% of the landscape's best"}


def scoreboard(rows: list[dict]) -> dict:
    """On how many landscapes each strategy meets each target (``TARGET_*``), and, on the within-3 % share,
    how each strategy fares against each other one landscape by landscape (ahead, level or behind: the
    shares compared as they are, not their intervals).  Only landscapes every strategy ran count."""
    by = {(r["strategy"], r["landscape"]): r for r in rows}
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    lands = [name for name in dict.fromkeys(r["landscape"] for r in rows)
             if all((s, name) in by for s in strategies)]
    targets = {}
    for s in strategies:
        mine = [by[s, name] for name in lands]
        targets[s] = {"landscapes": len(lands),
                      "samples_to_lock": sum(r["median_samples_to_lock"] <= TARGET_SAMPLES for r in mine),
                      "within_3pct": sum(r["locked_within_3pct_frac"] >= TARGET_WITHIN - 1e-9 for r in mine),
                      "worse_than_default": sum(r["locked_worse_than_default_frac"] <= TARGET_WORSE + 1e-9
                                                for r in mine)}
    versus = {}
    for s in strategies:
        for o in strategies:
            if o == s:
                continue
            diffs = [by[s, name]["locked_within_3pct_frac"] - by[o, name]["locked_within_3pct_frac"] for name in lands]
            versus[f"{s} vs {o}"] = {"ahead": sum(d > 1e-9 for d in diffs), "level": sum(abs(d) <= 1e-9 for d in diffs),
                                     "behind": sum(d < -1e-9 for d in diffs)}
    return {"targets": targets, "within_3pct_versus": versus}


def ceiling(info: dict[str, dict]) -> dict:
    """For scale beside the targets: on how many landscapes the within-3 % target is met by measuring every
    point once, with an exact reference, and keeping the best (``exhaustive_within_3pct``: as many blocks as
    the grid has points, every one of them costing nothing to pair), and on how many the recording knows
    its own best that well (``truth_ceiling_within_3pct``: the best point against its visits resampled)."""
    lands = list(info.values())
    known = [i["truth_ceiling_within_3pct"] for i in lands if i.get("truth_ceiling_within_3pct") is not None]
    return {"landscapes": len(lands),
            "exhaustive_within_3pct": sum(i["exhaustive_within_3pct"] >= TARGET_WITHIN - 1e-9 for i in lands),
            "exhaustive_blocks": sorted(i["points"] for i in lands)[len(lands) // 2] if lands else 0,
            "recording_knows_best": sum(k >= TARGET_WITHIN - 1e-9 for k in known), "recording_known": len(known)}


def model_first(rows: list[dict]) -> dict:
    """For each strategy run both ways, landscape by landscape: what starting from the scale model's first
    proposals changed (``<strategy>+model`` against ``<strategy>``, the same seeds): on how many it
    locked with fewer, as many or more samples (medians), and within 3 % more often, as often or less."""
    by = {(r["strategy"], r["landscape"]): r for r in rows}
    out = {}
    for (label, name), seeded in by.items():
        if "first_proposals" not in seeded:
            continue
        strategy = label.removesuffix("+model")
        plain = by.get((strategy, name))
        if plain is None:
            continue
        entry = out.setdefault(strategy, {"landscapes": 0, "samples": [0, 0, 0], "within_3pct": [0, 0, 0]})
        entry["landscapes"] += 1
        for key, field, sign in (("samples", "median_samples_to_lock", -1), ("within_3pct", "locked_within_3pct_frac", 1)):
            d = sign * (seeded[field] - plain[field])
            entry[key][0 if d > 1e-9 else 2 if d < -1e-9 else 1] += 1
    return {s: {"landscapes": e["landscapes"],
                "samples_to_lock": dict(zip(("fewer", "same", "more"), e["samples"])),
                "within_3pct": dict(zip(("ahead", "level", "behind"), e["within_3pct"]))} for s, e in out.items()}


def exhaustive_pick(landscape: Landscape, steps: int, draws: int = 2000, seed: int = 0,
                    visit_noise: bool | str = True) -> float:
    """A yardstick for the noise, not a strategy: measure **every** grid point once (a block of ``steps``
    steps drawn from its recorded ones, against an exact reference, no drift) and keep the best measured;
    the fraction of ``draws`` in which that lands within 3 % of the best.  Where it is low, one block
    cannot rank configurations 3 % apart on this landscape, whatever the search.  With ``visit_noise``,
    where the landscape replays the host's state between visits, a block's steps come from recorded visits
    as the replay draws them (:class:`~tunelab.tuning.replay.Objective`): one visit, or as many as the
    block's time spans, its steps split evenly among them ("pooled": each moved to a state drawn from
    every point's visits)."""
    blocks = exhaustive_blocks(landscape, steps, draws, seed, visit_noise)
    picked = landscape.means[np.argmax(blocks, axis=1)]
    return float(np.mean(picked >= WITHIN * landscape.best))


def exhaustive_blocks(landscape: Landscape, steps: int, draws: int = 2000, seed: int = 0,
                      visit_noise: bool | str = True) -> np.ndarray:
    """The blocks :func:`exhaustive_pick` measures: ``draws`` x points, each a block's mean log rate."""
    mode = visit_mode(visit_noise)
    rng = np.random.default_rng(seed)
    blocks = np.empty((draws, len(landscape.knobs)))
    for i, pool in enumerate(landscape.step_pools):
        visits = landscape.visit_pools[i] if mode != "off" and landscape.visit_pools is not None else None
        if visits:
            spans = max(1, round(steps * float(np.mean(pool)) / landscape.visit_seconds))
            logs = np.log(landscape.samples_per_step / np.concatenate(visits))
            sizes = np.asarray([v.size for v in visits])
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            span_of_step = np.arange(steps) * spans // steps
            chosen = rng.integers(len(visits), size=(draws, spans))[:, span_of_step]
            picks = starts[chosen] + (rng.random((draws, steps)) * sizes[chosen]).astype(int)
            moved = logs[picks]
            if mode == "pooled":  # each visit's steps moved from its own state to one drawn from all points'
                own, states = landscape.visit_states
                donors = states[rng.integers(states.size, size=(draws, spans))][:, span_of_step]
                moved = moved - own[i][chosen] + donors
            blocks[:, i] = moved.mean(axis=1)
        elif pool.size:
            logs = np.log(landscape.samples_per_step / pool)
            blocks[:, i] = logs[rng.integers(pool.size, size=(draws, steps))].mean(axis=1)
        else:
            noise = rng.normal(0.0, landscape.sigma, (draws, steps)).mean(axis=1)
            blocks[:, i] = math.log(landscape.means[i]) + noise
    return blocks


def truth_ceiling(landscape: Landscape, draws: int = 2000, seed: int = 0) -> float | None:
    """A ceiling from the recording itself, not a strategy: the landscape's truth is each point's mean over
    a few visits, so it is known only to a standard error.  Resample every point's visits (with
    replacement) and score the recorded best point against the resampled best: the fraction of ``draws``
    in which it is within 3 %.  A tuner that always locked the best point would score about this in
    ``locked_within_3pct_frac`` if the landscape were recorded again; where it is below the target, the
    recording cannot tell the target from its own noise.  None when a point has fewer than 2 visits."""
    visits = landscape.visit_scores
    if not visits or any(v.size < 2 for v in visits):
        return None
    rng = np.random.default_rng(seed)
    top = int(np.argmax(landscape.means))
    means = np.column_stack([v[rng.integers(v.size, size=(draws, v.size))].mean(axis=1) for v in visits])
    return float(np.mean(means[:, top] >= WITHIN * means.max(axis=1)))


def _median_curve(curves: list[list[float]]) -> list[float]:
    """Per block, the median over runs (a run that locked keeps its locked value)."""
    if not curves:
        return []
    length = max(len(c) for c in curves)
    padded = np.asarray([c + [c[-1]] * (length - len(c)) for c in curves])
    return np.median(padded, axis=0).tolist()


# ---- command line -------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench tuner`` under the ``bench`` sub-command parsers."""
    p = subparsers.add_parser("tuner", help="search strategies replayed on recorded landscapes (no training)")
    named_input(p.add_argument("--landscape", type=input_file, action="append", default=None, metavar="FILE",
                               help="a landscape JSON from bench landscape, or a shipped landscape's name (repeatable; "
                                    f"default: every shipped one: {', '.join(shipped_landscapes())})"),
                lambda name: _landscape_path(Path(name)),
                lambda args: [] if args.model_file is not None else sorted(LANDSCAPE_DIR.glob("*.json")))
    p.add_argument("--seeds", type=positive_int, default=20, help="runs per strategy and landscape (default 20)")
    p.add_argument("--budget", type=positive_int, default=None, metavar="SAMPLES",
                   help="exploration blocks per run (default: the landscape's scenario budget, as tunelab tune "
                        f"runs it; {Plan().budget_samples} without one)")
    p.add_argument("--drift", type=fraction, default=0.05,
                   help="host drift amplitude as a fraction of step time (default 0.05)")
    p.add_argument("--strategies", type=choice_list(tuple(STRATEGIES)), default=list(STRATEGIES),
                   help=f"comma-separated, from {','.join(STRATEGIES)}")
    p.add_argument("--visit-noise", choices=VISIT_MODES, default="recorded",
                   help="the host's state from visit to visit, where a landscape's visits differ beyond their "
                        "steps: replayed as recorded, a visit of the point at a time (default); pooled (a visit of "
                        "the point moved to the state of a visit drawn from every point's: one host state for all "
                        "configurations); or off (every step drawn from the point's pool of all visits, as replays "
                        "did before 2026-11-27)")
    p.add_argument("--first-from-model", type=input_file, default=None, metavar="FILE",
                   help="a fitted scale model (tunelab model fit --out FILE): run each strategy again on every "
                        "landscape it has proposals for, starting from its predicted best settings among the "
                        "landscape's, as tunelab tune does on hardware without stored trials (rows "
                        "<strategy>+model); not for GPU landscapes, which the model does not cover")
    m = p.add_argument_group("the scale model as the objective (instead of recorded landscapes)")
    m.add_argument("--model-file", type=input_file, default=None, metavar="FILE",
                   help="a fitted model (tunelab model fit --out FILE): its predicted step times, with noise")
    named_input(m.add_argument("--scenario", default=None,
                               help=f"the workload's scenario (name or file; default {MODEL_SCENARIO})"), scenario_input,
                lambda args: [] if args.model_file is None else [p for p in [scenario_input(MODEL_SCENARIO)] if p])
    m.add_argument("--hosts", type=positive_int, action="append", default=None, metavar="N",
                   help="hosts of the modelled topology (repeatable; default 2)")
    m.add_argument("--ranks-per-host", type=positive_int, default=None, metavar="K", help="default 1")
    m.add_argument("--link-gbps", type=link_gbps, default=None, metavar="G",
                   help="the link between hosts (default: the model's one fitted link; another speed is "
                        "derived from the nearest fitted one)")
    m.add_argument("--model-noise", type=fraction, default=None,
                   help="per-step noise (log sigma) added to predicted step times (default 0.03)")
    add_output_flags(p)
    p.set_defaults(func=_cmd)
    return p


def _cmd(args: argparse.Namespace) -> int:
    from .common import format_table

    model_only = {"--scenario": args.scenario, "--hosts": args.hosts, "--ranks-per-host": args.ranks_per_host,
                  "--link-gbps": args.link_gbps, "--model-noise": args.model_noise}
    if args.model_file is not None:
        if args.landscape:
            raise UsageError("--model-file replaces recorded landscapes: drop --landscape")
        landscapes = _model_landscapes(args)
    else:
        given = [flag for flag, value in model_only.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} the scale model's "
                             "objective: give --model-file too (or drop them to replay recorded landscapes)")
        if args.landscape:  # files the command line names: what is wrong with them is a usage error
            landscapes = []
            for path in args.landscape:
                try:
                    landscapes.append(Landscape.load(_landscape_path(path)))
                except TunelabError as exc:
                    raise UsageError(str(exc)) from None
        else:
            paths = sorted(LANDSCAPE_DIR.glob("*.json"))
            if not paths:
                raise TunelabError(f"no landscapes shipped in {LANDSCAPE_DIR}")
            landscapes = [Landscape.load(p) for p in paths]
    first = _first_from_model(args.first_from_model, landscapes, args.model_file) \
        if args.first_from_model is not None else None
    result = compare(landscapes, tuple(args.strategies), args.seeds, args.budget, args.drift, args.visit_noise, first)
    print(f"# tuner  seeds={args.seeds}  drift=±{100 * args.drift:g}%  visit noise {args.visit_noise}  "
          "scored: the locked configuration; "
          "samples: measured blocks until the lock, the default's reference blocks included")
    for name, info in result["landscapes"].items():
        print(f"# {name}: {info['points']} points over {','.join(info['names'])}; best {info['best']:.2f} "
              f"samples/s, default {info['default']:.2f} ({info['default'] / info['best']:.3f} of best); "
              f"measuring every point once ({info['block_steps']} steps, exact reference) and keeping the best "
              f"lands within 3 % in {info['exhaustive_within_3pct']:.2f} of draws")
        if info["truth_ceiling_within_3pct"] is not None:
            print(f"#   its truth is each point's mean over its visits: the best point, scored against the visits "
                  f"resampled, is within 3 % of their best in {info['truth_ceiling_within_3pct']:.2f} of draws "
                  "(how well the recording knows its own best)")
        if info["scenario_problem"]:
            print(f"#   {info['scenario_problem']}")
        if info["recording_drift_removed"]:
            removed = info["recording_drift_removed"]
            print(f"#   the host drifted while it was recorded (sd {100 * removed['sigma']:.2f} % along the visiting "
                  f"order, lag-1 autocorrelation {removed['lag1']:.2f}): taken out of its steps, the replay's own "
                  "drift stands in for it")
        if info["visit_noise"]:
            vn = info["visit_noise"]
            print(f"#   its visits differ beyond their steps: the host's state, sd {100 * vn['sigma']:.1f} % for "
                  f"{vn['seconds']:.1f} s at a time, " + {"recorded": "replayed as each point's visits recorded it",
                                                          "pooled": "replayed pooled over every point's visits",
                                                          "off": "left out (--visit-noise off)"}[vn["mode"]])
    ci = f"{100 * SHARE_CONFIDENCE:g}% CI"
    shown = [{**r, "within_text": _interval_text(r["locked_within_3pct_interval"]),
              "worse_text": _interval_text(r["locked_worse_than_default_interval"])} for r in result["rows"]]
    print(format_table(shown, [
        ("landscape", "landscape", ""), ("strategy", "strategy", ""), ("budget", "budget", "g"),
        ("median_samples_to_lock", "samples", "g"), ("median_steps_to_lock", "steps", "g"),
        ("locked_within_3pct_frac", "within3%", ".2f"), ("within_text", f"{ci}", ""),
        ("locked_worse_than_default_frac", "worse>1%", ".2f"), ("worse_text", f"{ci}", ""),
        ("adopted_frac", "adopted", ".2f"), ("median_locked_vs_best", "locked/best", ".3f"),
        ("locked_low_end_held_frac", "low held", ".2f")]))
    print(f"# CI: the fraction's {ci} (Wilson score) over {args.seeds} seeds")
    print("# low held: of the runs that locked a configuration, how often its true gain over the default "
          "(a ratio of geometric means, as blocks score) reached the low end of the interval it was locked with "
          f"(one-sided {50 + 50 * Plan().confidence:g} %; more for a lock from exploration, whose interval holds "
          "for every configuration explored at once)")
    _print_scoreboard(result["scoreboard"])
    for strategy, m in result["model_first"].items():
        n, k = m["samples_to_lock"], m["within_3pct"]
        print(f"# {strategy}+model vs {strategy}, on the {m['landscapes']} landscapes with first proposals: "
              f"median samples to lock fewer on {n['fewer']}, the same on {n['same']}, more on {n['more']}; "
              f"within 3 % ahead on {k['ahead']}, level on {k['level']}, behind on {k['behind']}")
    return finish(args, result, "tuner", "bench")


def _first_from_model(path: Path, landscapes: list[Landscape], model_file: Path | None) -> dict[str, list[Knobs]]:
    """Each landscape's first proposals from the scale model at ``path`` (printed as ``tune`` prints them),
    by name; a file that does not exist or cannot be read as a model is a usage error."""
    from ..model.fit import ScaleModel
    from ..model.tuner import landscape_proposals

    if model_file is not None:
        raise UsageError("--first-from-model seeds strategies on recorded landscapes; with --model-file the "
                         "model is the objective itself: drop one")
    if not path.is_file():
        raise UsageError(f"--first-from-model {path}: no such file")
    model = ScaleModel.load(path)  # (read once: what is wrong with it stops here, not per landscape)
    first = {}
    for land in landscapes:
        proposals, lines = landscape_proposals(path, land, model=model)
        for line in lines:
            print(line)
        if proposals:
            first[land.name] = proposals
    return first


def _print_scoreboard(board: dict) -> None:
    targets = board["targets"]
    if not targets:
        return
    count = next(iter(targets.values()))["landscapes"]
    print(f"# targets met, of {count} landscape{'s' if count != 1 else ''}: median samples to lock <= "
          f"{TARGET_SAMPLES}, locked within 3 % in >= {TARGET_WITHIN:.2f} of seeds, more than 1 % worse than the "
          f"default in <= {TARGET_WORSE:.2f}")
    for strategy, t in targets.items():
        print(f"#   {strategy}: {t['samples_to_lock']}, {t['within_3pct']}, {t['worse_than_default']}")
    c = board.get("ceiling")
    if c and c["landscapes"]:
        print(f"#   for scale, every point measured once against an exact reference (a median "
              f"{c['exhaustive_blocks']} blocks) and the best kept: within 3 % in >= {TARGET_WITHIN:.2f} of "
              f"draws on {c['exhaustive_within_3pct']} of {c['landscapes']}; the recording's own best, its "
              f"visits resampled, on {c['recording_knows_best']} of {c['recording_known']}")
    first = next(iter(targets))
    for pair, v in board["within_3pct_versus"].items():
        if pair.startswith(f"{first} vs "):
            print(f"# within 3 %, {pair}: ahead on {v['ahead']}, level on {v['level']}, behind on {v['behind']}")


def _interval_text(interval: list[float]) -> str:
    return f"[{interval[0]:.2f}, {interval[1]:.2f}]"


def _model_landscapes(args: argparse.Namespace) -> list[Landscape]:
    """One landscape per ``--hosts`` from the fitted model (UsageError, exit 2, on a bad file or link)."""
    from ..model.costs import Topology
    from ..model.fit import ScaleModel
    from ..model.step import Workload
    from ..model.tuner import recorded_landscape

    # a bad file, an ambiguous link or a parameter the topology needs but was not fitted: usage errors
    hosts, per_host = args.hosts or [2], args.ranks_per_host or 1
    model, link = ScaleModel.load(args.model_file), "none"
    if any(h > 1 for h in hosts):  # (within one host there is no link to name)
        model, link = model.for_link(args.link_gbps)
    alone = [h for h in hosts if h * per_host < 2]
    if alone:
        raise UsageError(f"--hosts {alone[0]} with {per_host} rank a host is one rank, whose "
                         "gradients are their own allreduce: no knob changes its step (2 ranks or more)")
    work = Workload.from_scenario(args.scenario or MODEL_SCENARIO)
    noise = 0.03 if args.model_noise is None else args.model_noise
    return [recorded_landscape(model, work, Topology(h, per_host, link if h > 1 else "none"), noise, seed=h)
            for h in hosts]


def shipped_landscapes() -> list[str]:
    """Names of the landscapes shipped with tunelab (``--landscape NAME`` takes them)."""
    return sorted(p.stem for p in LANDSCAPE_DIR.glob("*.json"))


def _landscape_path(path: Path) -> Path:
    """``path`` as given, or the shipped landscape of that name when no such file exists."""
    shipped = LANDSCAPE_DIR / f"{path.name}.json"
    if not path.exists() and path.parent == Path(".") and shipped.is_file():
        return shipped
    return path
