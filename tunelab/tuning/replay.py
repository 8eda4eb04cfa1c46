"""A recorded landscape as the tuning driver's objective: step times replayed, with noise and drift.

A landscape (``tunelab bench landscape``) holds, for a grid of knob settings, every visit's measured
step times (files recorded before step times were kept hold each visit's median samples/s).  Asked for
any knobs, the objective answers with the nearest grid point in the search space's unit coordinates (a
boolean knob must match exactly): each simulated step's time is drawn from that point's recorded step
times (or, for old files, log-normal noise of the file's pooled relative spread around the point's
mean), slowed or sped by a seeded host drift, so the driver sees what a live run would: noisy steps on a
host whose speed wanders.  Replays are bit-exact for a seed.  Where the host itself drifted while the
landscape was recorded (:func:`recording_drift`), that drift is taken out of the recorded steps first:
the replay's own drift stands in for it.

Steps are not the only noise a recording holds.  Where its visits of one point differ by more than their
steps can explain (:func:`visit_noise`: a one-way random-effects analysis of the log step rates, tested
at 1 %), the host's state itself changed from visit to visit: another process busy for seconds, a
transition after a knob change.  Drawn one by one from a pool of all visits, those steps would average
that away inside a block.  So such a landscape replays its visits as they were recorded, in two stages
(:class:`Objective`): at every knob change (where the recording began a visit), and again once the
visit drawn has held as long as it took when recorded (``visit_seconds``, a recorded visit's mean
time with its discarded steps, for a visit of the mean length) while the knobs stay, one of the
point's recorded visits is drawn, and each step is drawn from that visit's steps.  A
block as long as a visit replays one visit, a block four times as long about four; every replayed step
was recorded.

Whose state a point's block carries is a choice.  Replayed as recorded, each point carries its own few
visits' states, so a point that happened to record an unlucky visit stays noisier than the others
(the default's six visits on the bert landscape of today's engine vary by 4 %, the grid's by 11 %),
although a robust test finds no point's visits more spread than another's (Levene, p 0.15-0.98 on every
shipped recording: the host's state is one heavy-tailed distribution).  ``visit_noise="pooled"`` replays
that reading: a point's block takes the steps of one of its own visits (their pattern, and the point's
own step noise) moved to the state of a visit drawn from every point's (:meth:`Landscape.visit_states`:
a visit's mean log rate less its point's), so every configuration, the reference's included, sees the
same host.  Those steps are the recorded ones moved by the difference of two recorded states.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import TunelabError
from ..files import read_json
from ..knobs import Knobs
from .driver import Driver
from .space import SearchSpace

STEP_SPREAD_OF_BLOCK = 1.35  # a median of 3 steps varies about 1/1.35 as much as one step


@dataclass
class Landscape:
    name: str
    space: SearchSpace
    knobs: list[Knobs]
    step_pools: list[np.ndarray]  # per point: recorded step times in seconds, the recording's drift taken
                                  # out (empty for old files)
    means: np.ndarray             # true samples/s of each point: the mean over its recorded steps/visits
    sigma: float                  # old files: pooled relative spread of one step (log units)
    samples_per_step: float = 1.0
    recorded: dict | None = None  # how it was recorded: scenario, discard_steps, measure_steps, and
                                  # drift_removed (sigma, lag1) when its own drift was taken out
    visit_scores: list[np.ndarray] | None = None  # per point: each visit's samples/s (drift taken out):
                                                  # how well the recording knows each point's mean
    visit_sigma: float = 0.0      # the host's state from visit to visit (log sd) beyond the steps' own
                                  # noise, where the recording shows one (:func:`visit_noise`); else 0
    visit_seconds: float = 0.0    # how long such a state holds: a recorded visit's mean time, its
                                  # discarded steps included
    visit_pools: list[list[np.ndarray]] | None = None  # per point, each visit's step times (drift taken
                                                       # out), where a state is replayed; else None

    def __post_init__(self) -> None:
        keys = [self.space.unit_point(k) for k in self.knobs]
        cats = self.space.booleans()
        self._coords = np.asarray([[x for n, x in zip(self.space.names, u) if n not in cats] for u in keys])
        self._cats = [tuple(getattr(k, n) for n in cats) for k in self.knobs]
        self._cache: dict[Knobs, int] = {}

    @classmethod
    def from_dict(cls, doc: dict, name: str, where: str | None = None) -> Landscape:
        """The landscape ``name`` of a recording's JSON ``doc``; what is wrong with it is a TunelabError
        naming ``where`` (the file as given; by default ``name``)."""
        where = where or name
        problem = _header_problem(doc)
        if problem is not None:
            raise TunelabError(f"landscape {where}: {problem}")
        try:
            space = SearchSpace(tuple(doc["space"]["names"]), Knobs(**doc["space"]["base"]))
            points = doc["points"]
            knobs = [Knobs(**p["knobs"]) for p in points]
            per_step = float(doc.get("samples_per_step", 1.0))
            pools = [np.asarray([t for visit in p.get("steps_s", []) for t in visit], dtype=np.float64)
                     for p in points]
            scores = [np.asarray(p["scores"], dtype=np.float64) for p in points]
        except (KeyError, TypeError, ValueError) as exc:
            raise TunelabError(f"landscape {where}: not a landscape file ({type(exc).__name__}: {exc})") from None
        if not points or any(s.size == 0 for s in scores) \
                or any(not np.all(np.isfinite(s) & (s > 0) & (s <= MAX_SCORE)) for s in scores):
            raise TunelabError(f"landscape {where}: no measured points, or a score that is not a positive number "
                               f"up to {MAX_SCORE:g} samples/s")
        from ..model.data import MAX_TIME_S as high  # (a recorded step's time, as the scale model reads one)
        from ..model.data import MIN_TIME_S as low
        if not (math.isfinite(per_step) and per_step > 0) \
                or any(p.size and not np.all(np.isfinite(p) & (p >= low) & (p <= high)) for p in pools):
            raise TunelabError(f"landscape {where}: samples_per_step must be a positive number and every step "
                               f"time one from {low:g} to {high:g} s")
        bare = [i for i, p in enumerate(pools) if p.size == 0]
        if bare and len(bare) < len(pools):  # (the replay would drop every point's steps for the scores)
            raise TunelabError(f"landscape {where}: point {bare[0]} has no recorded steps, and others have")
        seen: dict[Knobs, int] = {}
        for i, k in enumerate(knobs):  # (the replay answers the first; the truth might be the other)
            if seen.setdefault(k, i) != i:
                raise TunelabError(f"landscape {where}: points {seen[k]} and {i} have the same knobs")
        for flag in space.booleans():  # the search asks for both sides of every boolean knob
            missing = {False, True} - {bool(getattr(k, flag)) for k in knobs}
            if missing:
                raise TunelabError(f"landscape {where}: {flag} is searched but no point has {flag}={missing.pop()}")
        recorded = {k: doc[k] for k in ("scenario", "discard_steps", "measure_steps", "block_seconds")
                    if doc.get(k) is not None}
        recorded["layout"] = _layout(doc)
        if all(p.size for p in pools):
            visits = [[np.asarray(v, dtype=np.float64) for v in p["steps_s"]] for p in points]
            drift = recording_drift(points, doc.get("order"))
            if drift is not None:  # the replay adds its own drift: take the recording's out of its steps
                visits = drift.apply(visits)
                recorded["drift_removed"] = drift.summary()
            pools = [np.concatenate(v) for v in visits]
            means = np.asarray([float(np.mean(per_step / p)) for p in pools])
            scored = [np.asarray([float(np.mean(per_step / v)) for v in vs if v.size]) for vs in visits]
            between = visit_noise(visits, int(recorded.get("discard_steps", 0)))
            if between is not None:  # the host's state: visits replayed whole, one per visit-long stretch
                recorded["visit_noise"] = {"sigma": between.sigma, "seconds": between.seconds,
                                           "p_value": between.p_value}
                return cls(name, space, knobs, pools, means, 0.0, per_step, recorded, scored,
                           between.sigma, between.seconds, [[v for v in vs if v.size] for vs in visits])
            return cls(name, space, knobs, pools, means, 0.0, per_step, recorded, scored)
        logs = [np.log(s) for s in scores]
        pooled = [x - x.mean() for x in logs if x.size > 1]  # each point's n visits give n - 1 degrees of freedom
        dof = sum(x.size - 1 for x in pooled)
        block_sigma = float(np.sqrt(np.sum(np.concatenate(pooled) ** 2) / dof)) if pooled else 0.02
        means = np.asarray([float(np.mean(s)) for s in scores])
        return cls(name, space, knobs, [np.empty(0)] * len(knobs), means, block_sigma * STEP_SPREAD_OF_BLOCK,
                   recorded=recorded, visit_scores=scores)

    @classmethod
    def load(cls, path: Path) -> Landscape:
        try:
            doc = read_json(path)
        except OSError as exc:
            raise TunelabError(f"cannot read landscape {path}: {exc.strerror or exc}") from None
        except ValueError as exc:  # not UTF-8, or not JSON
            raise TunelabError(f"landscape {path} is not a landscape JSON file ({' '.join(str(exc).split())})") from None
        return cls.from_dict(doc, Path(path).stem, str(path))

    @property
    def best(self) -> float:
        return float(self.means.max())

    @functools.cached_property
    def mean_visit_steps_s(self) -> float:
        """The mean over every recorded visit of its measured steps' time: a visit in play lasts
        ``visit_seconds`` times its own steps' time over this (:class:`Objective`)."""
        return float(np.mean([v.sum() for vs in self.visit_pools or [] for v in vs])) if self.visit_pools else 0.0

    @functools.cached_property
    def visit_states(self) -> tuple[list[np.ndarray], np.ndarray] | None:
        """Where visits are replayed (``visit_pools``): per point, each visit's state (its steps' mean log
        rate less the point's, over all its steps), and every point's states together; else None."""
        if self.visit_pools is None:
            return None
        own = []
        for visits in self.visit_pools:
            logs = [np.log(self.samples_per_step / v) for v in visits]
            centre = float(np.concatenate(logs).mean())
            own.append(np.asarray([float(x.mean()) - centre for x in logs]))
        return own, np.concatenate(own)

    def nearest(self, knobs: Knobs) -> int:
        if knobs in self._cache:
            return self._cache[knobs]
        cats = self.space.booleans()
        u = [x for n, x in zip(self.space.names, self.space.unit_point(knobs)) if n not in cats]
        dist = np.sqrt(((self._coords - np.asarray(u)) ** 2).sum(axis=1)) if u else np.zeros(len(self.knobs))
        want = tuple(getattr(knobs, n) for n in cats)
        dist = np.where([c == want for c in self._cats], dist, np.inf)
        if not np.isfinite(dist).any():
            raise TunelabError(f"landscape {self.name}: no grid point with {dict(zip(cats, want))}")
        self._cache[knobs] = int(np.argmin(dist))
        return self._cache[knobs]

    def true_score(self, knobs: Knobs) -> float:
        return float(self.means[self.nearest(knobs)])

    def true_log_rate(self, knobs: Knobs) -> float:
        """The mean log samples/s of the nearest point's steps: what a block's score estimates (the
        driver's ratios and intervals are ratios of geometric means, not of :meth:`true_score`)."""
        i = self.nearest(knobs)
        pool = self.step_pools[i]
        return float(np.mean(np.log(self.samples_per_step / pool))) if pool.size else math.log(self.means[i])


MAX_BLOCK_STEPS = 100_000     # steps a recorded block measured or discarded
MAX_SCORE = 1e12              # samples/s a recorded block can mean


def _header_problem(doc: object) -> str | None:
    """What is wrong with a landscape file's top level (None when nothing): the searched knob names, how
    its blocks were measured, its scenario's name and the samples per step."""
    from .space import SCALES

    if not isinstance(doc, dict):
        return "not a landscape file (not a JSON object)"
    space = doc.get("space")
    names = space.get("names") if isinstance(space, dict) else None
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return "not a landscape file (space.names is not a list of knob names)"
    unknown = [n for n in names if n not in SCALES]
    if unknown:
        return f"space.names has {unknown[0]!r}, not a searched knob ({', '.join(SCALES)})"
    for key, low in (("discard_steps", 0), ("measure_steps", 1)):
        value = doc.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_BLOCK_STEPS:
            return f"{key} must be an integer from {low} to {MAX_BLOCK_STEPS}, got {value!r:.40}"
    seconds = doc.get("block_seconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not 0 < seconds < math.inf):
        return f"block_seconds must be a positive number of seconds, got {seconds!r}"
    if "scenario" in doc and not isinstance(doc["scenario"], str):
        return f"scenario must be a scenario's name, got {doc['scenario']!r}"
    per_step = doc.get("samples_per_step", 1.0)
    if isinstance(per_step, bool) or not isinstance(per_step, (int, float)) or not 0 < per_step <= 1e6:
        return f"samples_per_step must be a number in (0, 1e6], got {per_step!r}"
    return None


@dataclass(frozen=True)
class RecordingDrift:
    """The host's drift while a landscape was recorded, as a log-rate offset per visit (in visiting order):
    the running median of the other visits' residuals (each visit's mean log rate less its point's mean)
    over one round of visits around it.  Rounds visit every point in a fresh shuffled order, so the
    points' own effects cancel out of the residuals and what remains in their trend is the host."""

    visits: tuple[tuple[int, int], ...]  # (point, visit) in visiting order
    offsets: np.ndarray                  # log-rate offset of each visit (mean 0)
    lag1: float                          # lag-1 autocorrelation of the residuals that showed it

    def apply(self, visits: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
        """Every point's step times, visit by visit (as ``visits`` holds them), with each visit's offset
        taken out (a slow visit's steps shortened); ``visits`` is left as it is."""
        steps = [list(v) for v in visits]
        for (i, j), off in zip(self.visits, self.offsets):
            steps[i][j] = steps[i][j] * math.exp(float(off))
        return steps

    def summary(self) -> dict:
        return {"sigma": float(np.std(self.offsets)), "lag1": self.lag1}


def recording_drift(points: list[dict], order: object) -> RecordingDrift | None:
    """The recording's host drift, when its visiting ``order`` is known and matches the visits, and its
    residuals are autocorrelated beyond chance (lag-1 autocorrelation above ``2 / sqrt(n)``): a host that
    slowed down for minutes while the grid was recorded.  A replay draws each step from its point's pool,
    so drift left in the pools would come back as step noise that no paired reference can cancel, on top
    of the drift the replay adds itself.  Otherwise None: nothing is changed."""
    if not isinstance(order, list) or not all(isinstance(i, int) and 0 <= i < len(points) for i in order):
        return None
    seen = [0] * len(points)
    visits = []
    for i in order:
        visits.append((i, seen[i]))
        seen[i] += 1
    if any(n != len(p["steps_s"]) for n, p in zip(seen, points)) or min(seen, default=0) < 2 \
            or any(len(v) == 0 for p in points for v in p["steps_s"]):
        return None
    logs = [[-float(np.mean(np.log(v))) for v in p["steps_s"]] for p in points]
    centre = [float(np.mean(x)) for x in logs]
    res = np.asarray([logs[i][j] - centre[i] for i, j in visits])
    n = len(res)
    if n < 8 or float(np.std(res)) == 0.0:
        return None
    lag1 = float(np.corrcoef(res[:-1], res[1:])[0, 1])
    if not lag1 > 2.0 / math.sqrt(n):
        return None
    half = max(2, len(points) // 2)  # one round of visits around each
    window = [np.concatenate([res[max(0, t - half):t], res[t + 1:t + 1 + half]]) for t in range(n)]
    trend = np.asarray([np.median(w) for w in window])
    trend -= float(np.mean(trend))
    # A median of w residuals carries (pi / 2) s^2 / w of their own noise: shrink the trend by the share of
    # its variance that is signal, so a drift too small to tell from that noise moves nothing.
    own = math.pi / 2.0 * float(np.var(res - trend)) * float(np.mean([1.0 / len(w) for w in window]))
    signal = max(0.0, 1.0 - own / float(np.var(trend))) if float(np.var(trend)) > 0 else 0.0
    if signal == 0.0:  # no trend its own noise cannot explain: nothing to take out
        return None
    return RecordingDrift(tuple(visits), signal * trend, lag1)


VISIT_NOISE_P = 0.01  # visits must differ beyond their steps' noise at this level to be replayed as such


@dataclass(frozen=True)
class VisitNoise:
    """What a recording's visits of one point differ by beyond their steps' own noise."""

    sigma: float    # log sd of the host's state from visit to visit
    seconds: float  # a visit's mean time, its discarded steps included: how long a state held, at least
    p_value: float  # of the F test that the visits differ more than their steps explain


def visit_noise(visits: list[list[np.ndarray]], discard_steps: int = 0,
                level: float = VISIT_NOISE_P) -> VisitNoise | None:
    """The between-visit variance of a recording's log step rates, pooled over its points (one-way
    random-effects ANOVA with visits as groups nested in points: ``(MSB - MSW) / n0``), when the F test
    says the visits differ beyond their steps at ``level``; else None (every point needs visits of two
    or more steps, and two or more visits).  ``visits``: per point, each visit's measured step times;
    each visit also ran ``discard_steps`` unmeasured steps after its knob change, counted in its time at
    its own mean step."""
    from scipy.stats import f as f_dist

    ss_within = ss_between = n0_sum = 0.0
    df_within = df_between = 0
    seconds = []
    for point in visits:
        logs = [np.log(v) for v in point if v.size]
        if len(logs) < 2 or any(x.size < 2 for x in logs):
            return None
        sizes = np.asarray([x.size for x in logs], dtype=float)
        centre = float(np.concatenate(logs).mean())
        ss_within += sum(float(((x - x.mean()) ** 2).sum()) for x in logs)
        ss_between += sum(x.size * (float(x.mean()) - centre) ** 2 for x in logs)
        df_within += int(sizes.sum() - sizes.size)
        df_between += sizes.size - 1
        n0_sum += float(sizes.sum() - (sizes ** 2).sum() / sizes.sum())
        seconds += [float(v.sum()) * (v.size + discard_steps) / v.size for v in point if v.size]
    if not visits or df_within == 0 or ss_within == 0.0:
        return None
    ms_within, ms_between = ss_within / df_within, ss_between / df_between
    p_value = float(f_dist.sf(ms_between / ms_within, df_between, df_within))
    if p_value >= level:
        return None
    var = (ms_between - ms_within) / (n0_sum / df_between)
    return VisitNoise(math.sqrt(var), float(np.mean(seconds)), p_value)


@dataclass(frozen=True)
class Drift:
    """The host's speed over time: a factor on step times, ``exp(amplitude * wave(t))`` with ``wave`` two
    seeded sines (periods ``period_s`` and about a third of it) scaled to stay within [-1, 1]."""

    amplitude: float = 0.05
    period_s: float = 120.0
    seed: int = 0

    def factor(self, t_s: float) -> float:
        if self.amplitude == 0:
            return 1.0
        p1, p2, ratio = _drift_phases(self.seed)
        short = self.period_s / ratio
        wave = 0.7 * math.sin(2 * math.pi * t_s / self.period_s + p1) + 0.3 * math.sin(2 * math.pi * t_s / short + p2)
        return math.exp(self.amplitude * wave)


@functools.lru_cache(maxsize=256)
def _drift_phases(seed: int) -> tuple[float, float, float]:
    rng = np.random.default_rng(10_000 + seed)
    p1, p2 = rng.uniform(0.0, 2 * math.pi, 2)
    return float(p1), float(p2), float(rng.uniform(3.0, 4.5))


class Objective:
    """Step times of a landscape (or of ``later`` from ``switch_s`` seconds on: an optimum that moves).

    Where the landscape carries a host state between visits (``visit_pools``), one of the point's recorded
    visits is drawn (from a random stream of its own) at every change of knobs or of landscape and again
    once it has held as long as it did when recorded (``visit_seconds`` for a visit of the mean length)
    under the same knobs, and each step is drawn from that
    visit's steps (``visit_noise`` "recorded", or True); "pooled" moves that visit's steps to the state of
    a visit drawn from every point's (see the module's notes); "off" (or False) draws every step from the
    point's pool of all its visits, as replays did before 2026-11-27 (a host whose state moves at every
    step)."""

    def __init__(self, landscape: Landscape, seed: int, drift: Drift | None = None,
                 later: Landscape | None = None, switch_s: float = math.inf, visit_noise: bool | str = True) -> None:
        self.landscape, self.later, self.switch_s = landscape, later, switch_s
        self.drift = drift or Drift(0.0)
        self.rng = np.random.default_rng(seed)
        self.t_s = 0.0
        self.visit_noise = visit_mode(visit_noise)
        self._state_rng = np.random.default_rng([seed, 0x5EED])
        self._state_of: tuple[int, Knobs] | None = None
        self._state_until = -math.inf
        self._visit: np.ndarray | None = None

    def _pool(self, land: Landscape, i: int, knobs: Knobs) -> np.ndarray:
        """The steps this step is drawn from: point ``i``'s pool, or the visit in play."""
        visits = land.visit_pools[i] if self.visit_noise != "off" and land.visit_pools is not None else None
        if not visits:
            return land.step_pools[i]
        if self._state_of != (id(land), knobs) or self.t_s >= self._state_until:
            v = int(self._state_rng.integers(len(visits)))
            self._visit = visits[v]
            if self.visit_noise == "pooled":
                own, states = land.visit_states
                self._visit = visits[v] * math.exp(float(own[i][v]) - float(states[self._state_rng.integers(states.size)]))
            # A state holds as long as its visit took when recorded: a slow visit took longer.  (Held for
            # one length whatever the visit, slow states were cut short and fast ones ran whole, so a
            # point with a slow visit replayed up to 5 % faster than its recorded steps.)
            held = land.visit_seconds * float(self._visit.sum()) / land.mean_visit_steps_s
            self._state_of, self._state_until = (id(land), knobs), self.t_s + held
        return self._visit

    def current(self) -> Landscape:
        return self.later if self.later is not None and self.t_s >= self.switch_s else self.landscape

    def step_s(self, knobs: Knobs) -> float:
        land = self.current()
        i = land.nearest(knobs)
        pool = self._pool(land, i, knobs)
        if pool.size:
            base = float(pool[self.rng.integers(pool.size)])
        else:
            base = land.samples_per_step / (land.means[i] * math.exp(self.rng.normal(0.0, land.sigma)))
        step = base * self.drift.factor(self.t_s)
        self.t_s += step
        return step


VISIT_MODES = ("recorded", "pooled", "off")


def visit_mode(visit_noise: bool | str) -> str:
    """``visit_noise`` as one of :data:`VISIT_MODES` (True is "recorded", False "off")."""
    if isinstance(visit_noise, bool):
        return "recorded" if visit_noise else "off"
    if visit_noise not in VISIT_MODES:
        raise ValueError(f"visit_noise must be one of {', '.join(VISIT_MODES)}, got {visit_noise!r}")
    return visit_noise


def simulate(driver: Driver, objective: Objective, max_steps: int = 5000) -> Driver:
    """Run ``driver`` on ``objective`` until it locks (or, retuning, for ``max_steps`` steps)."""
    for _ in range(max_steps):
        driver.step_done(objective.step_s(driver.knobs))
        if not driver.tuning and not driver.plan.retune:
            break
    return driver


def synthetic(name: str, space: SearchSpace, grid: dict[str, list[object]], speed: Callable[[Knobs], float],
              noise: float, seed: int = 0, visits: int = 3, steps_per_visit: int = 3,
              visit_noise: float = 0.0) -> Landscape:
    """A landscape with a known truth: ``speed(knobs)`` steps/s at each grid point, recorded as
    ``visits`` x ``steps_per_visit`` step times (after one discarded step, as ``bench landscape``
    records) with log-normal noise ``noise``, each visit's steps moved together by a log-normal host
    state of sd ``visit_noise`` (for tests and checks)."""
    rng = np.random.default_rng(seed)
    states = np.random.default_rng([seed, 1])  # (a stream of its own: without visit noise nothing moves)
    names = list(grid)
    points = []
    for combo in itertools.product(*(grid[n] for n in names)):
        knobs = space.base.replace(**dict(zip(names, combo)))
        offsets = states.normal(0.0, visit_noise, visits) if visit_noise > 0 else np.zeros(visits)
        steps = [[float(math.exp(rng.normal(0.0, noise) - offsets[v]) / speed(knobs)) for _ in range(steps_per_visit)]
                 for v in range(visits)]
        points.append({"knobs": knobs.as_dict(), "scores": [1.0 / float(np.median(v)) for v in steps],
                       "steps_s": steps})
    doc = {"space": {"names": list(space.names), "base": space.base.as_dict()}, "points": points,
           "samples_per_step": 1.0, "discard_steps": 1}
    return Landscape.from_dict(doc, name)


def _layout(doc: dict) -> dict:
    """Where a recording ran, as far as it says: ranks, nodes, the device, the emulated link, the lab's
    hosts and link, the host's cores and the replay's element type (what the scale model's first
    proposals for it need: :func:`tunelab.model.tuner.landscape_proposals`)."""
    hardware = doc.get("hardware") if isinstance(doc.get("hardware"), dict) else {}
    gpus = hardware.get("gpu_count")
    device = doc.get("device") or ("cuda" if isinstance(gpus, int) and gpus > 0 else None)
    return {"world_size": doc.get("world_size"), "nodes": doc.get("nodes"), "device": device,
            "link_gbps": doc.get("link_gbps"), "lab": hardware.get("lab"), "cpu_cores": hardware.get("cpu_cores"),
            "dtype": doc.get("dtype")}
