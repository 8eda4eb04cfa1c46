"""``tunelab bench tuner``: search strategies compared on recorded landscapes, without training.

A landscape (``tunelab bench landscape``) holds samples/s for a grid of knob settings, each measured
several times.  The simulated objective answers any knobs a strategy asks for with the score of the
nearest grid point (in the search space's normalised coordinates: log2 sizes, log cycle time; a
categorical knob must match exactly) plus Gaussian noise with that point's observed spread, so a
strategy pays for noisy measurements as it would live.  Quality is the number of samples until the
best-so-far *measured* point is truly (noise-free) within 5 % of the grid's best.

Strategies, each measuring the default configuration first as a live session does:

* ``tunelab``: the live tuner (``tunelab.tuning.tuner.Tuner``), told and asked exactly as
  ``TuningSession`` does, stopping where the session would (convergence);
* ``random``: uniform samples of the same space;
* ``horovod``: Horovod's autotune protocol: for each combination of the boolean knobs, four fixed
  starting points (fusion MiB, cycle ms) = (4, 5), (32, 50), (16, 25), (8, 10), then Bayesian
  optimisation with a fresh Gaussian process until that combination has 21 samples.  It searches
  the same continuous knobs as the others (segment size starts at its default), so the comparison
  is between search protocols, not between search spaces.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TunelabError
from ..knobs import Knobs, MiB
from ..report.auto import add_report_flag, write_outputs
from ..tuning.space import SearchSpace
from ..tuning.tuner import quiet_repeats

STRATEGIES = ("tunelab", "random", "horovod")
TARGET = 0.95  # within 5 % of the grid's best true score
HOROVOD_STARTS = ((4, 5.0), (32, 50.0), (16, 25.0), (8, 10.0))  # (fusion MiB, cycle ms)
HOROVOD_SAMPLES = 21  # per combination of the boolean knobs
LANDSCAPE_DIR = Path(__file__).resolve().parent / "landscapes"

History = list[tuple[Knobs, float]]  # (knobs, measured score) in measuring order
Measure = Callable[[Knobs], float]


# ---- landscapes and the simulated objective -----------------------------------------------------------
def normalised(space: SearchSpace, knobs: Knobs) -> tuple[np.ndarray, tuple[Any, ...]]:
    """(continuous coordinates in [0, 1] as the tuner's GP sees them, categorical values)."""
    from skopt.space import Categorical

    coords: list[float] = []
    cats: list[Any] = []
    for dim, x in zip(space.skopt_dimensions(), space.to_point(knobs)):
        if isinstance(dim, Categorical):
            cats.append(x)
        elif dim.prior == "log-uniform":
            coords.append((math.log(x) - math.log(dim.low)) / (math.log(dim.high) - math.log(dim.low)))
        else:
            coords.append((x - dim.low) / (dim.high - dim.low))
    return np.asarray(coords, dtype=np.float64), tuple(cats)


@dataclass
class Landscape:
    name: str
    space: SearchSpace
    knobs: list[Knobs]
    means: np.ndarray  # true score of each grid point: the mean of its visits
    stds: np.ndarray   # the spread of its visits (the simulated measurement noise)

    def __post_init__(self) -> None:
        keys = [normalised(self.space, k) for k in self.knobs]
        self._coords = np.stack([c for c, _ in keys]) if keys else np.empty((0, 0))
        self._cats = [c for _, c in keys]

    @classmethod
    def from_dict(cls, doc: dict, name: str) -> Landscape:
        try:
            space = SearchSpace(tuple(doc["space"]["names"]), Knobs(**doc["space"]["base"]))
            points = doc["points"]
            scores = [np.asarray(p["scores"], dtype=np.float64) for p in points]
            knobs = [Knobs(**p["knobs"]) for p in points]
        except (KeyError, TypeError, ValueError) as exc:
            raise TunelabError(f"landscape {name}: not a landscape file ({type(exc).__name__}: {exc})") from None
        if not points or any(s.size == 0 for s in scores):
            raise TunelabError(f"landscape {name}: no measured points")
        stds = [float(np.std(s, ddof=1)) if s.size > 1 else 0.0 for s in scores]
        return cls(name, space, knobs, np.asarray([s.mean() for s in scores]), np.asarray(stds))

    @classmethod
    def load(cls, path: Path) -> Landscape:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TunelabError(f"cannot read landscape {path}: {exc}") from None
        return cls.from_dict(doc, Path(path).stem)

    @property
    def best(self) -> float:
        return float(self.means.max())

    def nearest(self, knobs: Knobs) -> int:
        coords, cats = normalised(self.space, knobs)
        dist = np.sqrt(((self._coords - coords) ** 2).sum(axis=1)) if coords.size else np.zeros(len(self.knobs))
        dist = np.where([c == cats for c in self._cats], dist, np.inf)
        if not np.isfinite(dist).any():
            raise TunelabError(f"landscape {self.name}: no grid point with {dict(zip(self.space.names, cats))}")
        return int(np.argmin(dist))

    def true_score(self, knobs: Knobs) -> float:
        return float(self.means[self.nearest(knobs)])


class Objective:
    """A measurement: the nearest grid point's score plus seeded Gaussian noise of its observed spread."""

    def __init__(self, landscape: Landscape, seed: int, noise: bool = True) -> None:
        self.landscape, self.noise = landscape, noise
        self.rng = np.random.default_rng(seed)
        self.calls = 0

    def __call__(self, knobs: Knobs) -> float:
        self.calls += 1
        i = self.landscape.nearest(knobs)
        mean = float(self.landscape.means[i])
        jitter = float(self.rng.normal(0.0, self.landscape.stds[i])) if self.noise else 0.0
        return max(mean + jitter, 0.01 * mean)  # a wide spread must not yield a throughput <= 0


# ---- strategies ---------------------------------------------------------------------------------------
def run_tunelab(space: SearchSpace, measure: Measure, budget: int, seed: int) -> History:
    """Default first, then ask/tell, stopping on the budget or on convergence, as ``TuningSession`` does."""
    from ..tuning.tuner import Tuner

    tuner = Tuner(space, seed=seed)
    history: History = []
    knobs = space.base
    while True:
        score = measure(knobs)
        history.append((knobs, score))
        tuner.tell(knobs, score)
        if len(history) >= budget or not tuner.searchable or tuner.converged():
            return history
        knobs = tuner.ask()


def run_random(space: SearchSpace, measure: Measure, budget: int, seed: int) -> History:
    """Default first, then points drawn uniformly from the tuner's space (log scales included)."""
    from skopt.space import Space

    knobs = [space.base]
    if space.names and budget > 1:
        draws = Space(space.skopt_dimensions()).rvs(budget - 1, random_state=np.random.RandomState(seed))
        knobs += [space.to_knobs(p) for p in draws]
    return [(k, measure(k)) for k in knobs]


def run_horovod(space: SearchSpace, measure: Measure, budget: int, seed: int) -> History:
    """Default first, then per boolean combination: Horovod's four starts and a fresh GP, 21 samples."""
    history: History = [(space.base, measure(space.base))]
    for combo in _boolean_combinations(space):
        search = _HorovodSearch(space, combo, seed)
        for _ in range(HOROVOD_SAMPLES if search.sub.names else 1):
            if len(history) >= budget:
                return history
            knobs = search.ask()
            score = measure(knobs)
            search.tell(knobs, score)
            history.append((knobs, score))
    return history


def _boolean_combinations(space: SearchSpace) -> list[dict[str, bool]]:
    names = [n for n in space.names if n == "hierarchical"]
    combos: list[dict[str, bool]] = [{}]
    for name in names:
        combos = [{**c, name: v} for c in combos for v in (False, True)]
    return combos


class _HorovodSearch:
    """One combination's search over the continuous knobs: fixed starts, then EI on its own GP."""

    def __init__(self, space: SearchSpace, combo: dict[str, bool], seed: int) -> None:
        from skopt import Optimizer

        self.sub = SearchSpace(tuple(n for n in space.names if n not in combo), space.base.replace(**combo))
        starts = []
        for mib, ms in HOROVOD_STARTS:
            values = {"fusion_threshold_bytes": mib * MiB, "cycle_time_ms": ms}
            starts.append(self.sub.base.replace(**{k: v for k, v in values.items() if k in self.sub.names}))
        self.starts = starts
        self.told = 0
        self.reference: float | None = None
        self.opt = (Optimizer(self.sub.skopt_dimensions(), base_estimator="GP", acq_func="EI",
                              n_initial_points=len(starts), random_state=seed) if self.sub.names else None)

    def ask(self) -> Knobs:
        if self.opt is None:
            return self.sub.base
        if self.told < len(self.starts):
            return self.starts[self.told]
        with quiet_repeats():
            return self.sub.to_knobs(self.opt.ask())

    def tell(self, knobs: Knobs, score: float) -> None:
        self.told += 1
        if self.opt is None:
            return
        self.reference = self.reference or score
        with quiet_repeats():
            self.opt.tell(self.sub.to_point(knobs), -score / self.reference)


RUNNERS: dict[str, Callable[[SearchSpace, Measure, int, int], History]] = {
    "tunelab": run_tunelab, "random": run_random, "horovod": run_horovod}


# ---- quality ------------------------------------------------------------------------------------------
def best_so_far(landscape: Landscape, history: History, budget: int) -> list[float]:
    """True score of the best-so-far measured point after each sample; a strategy that stopped early
    keeps its final choice for the rest of the budget."""
    curve: list[float] = []
    best_measured, best_true = -math.inf, math.nan
    for knobs, score in history:
        if score > best_measured:
            best_measured, best_true = score, landscape.true_score(knobs)
        curve.append(best_true)
    return curve + [curve[-1]] * (budget - len(curve))


def samples_to_reach(curve: list[float], target: float) -> int:
    """1-based index of the first sample at or above ``target``; len(curve) + 1 if never."""
    for i, value in enumerate(curve):
        if value >= target:
            return i + 1
    return len(curve) + 1


def evaluate(landscape: Landscape, strategy: str, seeds: int, budget: int) -> tuple[dict, list[list[float]]]:
    """One table row (samples to 5 % over seeds) and every seed's best-so-far curve."""
    curves, needed, used = [], [], []
    target = TARGET * landscape.best
    for seed in range(seeds):
        objective = Objective(landscape, seed)
        history = RUNNERS[strategy](landscape.space, objective, budget, seed)
        if len(history) > budget or objective.calls != len(history):
            raise TunelabError(f"strategy {strategy} measured {objective.calls} times, budget {budget}")
        curve = best_so_far(landscape, history, budget)
        curves.append(curve)
        needed.append(samples_to_reach(curve, target))
        used.append(len(history))
    row = {"landscape": landscape.name, "strategy": strategy,
           "median_samples_to_5pct": float(np.median(needed)), "p25": float(np.percentile(needed, 25)),
           "p75": float(np.percentile(needed, 75)), "reached": sum(n <= budget for n in needed),
           "seeds": seeds, "samples_used": float(np.median(used)),
           "final_vs_best": float(np.median([c[-1] for c in curves])) / landscape.best}
    return row, curves


def compare(landscapes: list[Landscape], strategies: tuple[str, ...], seeds: int, budget: int) -> dict:
    """Rows per (landscape, strategy); ``curves``: per strategy the median over seeds (and landscapes) of
    best-so-far as a fraction of the grid's best; ``landscape_curves``: the same in samples/s."""
    rows, pooled = [], {s: [] for s in strategies}
    per_landscape: dict[str, dict[str, list[float]]] = {}
    for land in landscapes:
        per_landscape[land.name] = {}
        for strategy in strategies:
            row, curves = evaluate(land, strategy, seeds, budget)
            rows.append(row)
            per_landscape[land.name][strategy] = np.median(curves, axis=0).tolist()
            pooled[strategy] += [[v / land.best for v in c] for c in curves]
    info = {land.name: {"best": land.best, "default": land.true_score(land.space.base),
                        "points": len(land.knobs), "names": list(land.space.names)} for land in landscapes}
    return {"rows": rows, "curves": {s: np.median(c, axis=0).tolist() for s, c in pooled.items()},
            "landscape_curves": per_landscape, "landscapes": info, "seeds": seeds, "max_samples": budget,
            "target": TARGET}


# ---- command line -------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench tuner`` under the ``bench`` sub-command parsers."""
    from ..cli import _choice_list, _positive_int

    p = subparsers.add_parser("tuner", help="search strategies replayed on recorded landscapes (no training)")
    p.add_argument("--landscape", type=Path, action="append", default=None, metavar="FILE",
                   help="a landscape JSON from bench landscape (repeatable; default: the shipped ones)")
    p.add_argument("--seeds", type=_positive_int, default=20, help="runs per strategy (default 20)")
    p.add_argument("--max-samples", type=_positive_int, default=40, help="samples per run (default 40)")
    p.add_argument("--strategies", type=_choice_list(STRATEGIES), default=list(STRATEGIES),
                   help=f"comma-separated, from {','.join(STRATEGIES)}")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write results as JSON")
    add_report_flag(p)
    p.set_defaults(func=_cmd)
    return p


def _cmd(args: argparse.Namespace) -> int:
    from .common import format_table

    paths = args.landscape or sorted(LANDSCAPE_DIR.glob("*.json"))
    if not paths:
        raise TunelabError(f"no landscapes given and none shipped in {LANDSCAPE_DIR}")
    landscapes = [Landscape.load(p) for p in paths]
    result = compare(landscapes, tuple(args.strategies), args.seeds, args.max_samples)
    print(f"# tuner  seeds={args.seeds}  max_samples={args.max_samples}  target: within "
          f"{100 * (1 - TARGET):.0f}% of the grid's best (never reached counts {args.max_samples + 1})")
    for name, info in result["landscapes"].items():
        print(f"# {name}: {info['points']} points over {','.join(info['names'])}; best {info['best']:.2f} "
              f"samples/s, default {info['default']:.2f} ({info['default'] / info['best']:.3f} of best)")
    rows = [{**r, "reached_of": f"{r['reached']}/{r['seeds']}"} for r in result["rows"]]
    print(format_table(rows, [("landscape", "landscape", ""), ("strategy", "strategy", ""),
                              ("median_samples_to_5pct", "median", "g"), ("p25", "p25", "g"),
                              ("p75", "p75", "g"), ("reached_of", "reached", ""),
                              ("samples_used", "used", "g"), ("final_vs_best", "final/best", ".3f")]))
    write_outputs(result, args.json, "tuner", "bench" if args.report else None)
    return 0
