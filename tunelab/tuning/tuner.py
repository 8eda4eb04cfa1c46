"""tunelab's search strategy: a Gaussian process over the joint knob space, expected improvement.

The GP is scikit-optimize's (``skopt.learning.GaussianProcessRegressor``, a Matern 5/2 kernel with a
length scale per knob).  Values told are paired log ratios (a candidate's log samples/s minus the
reference's around it), each with its own variance; the GP takes those variances as per-point noise
(its ``alpha``, one per point: skopt's ``Optimizer`` takes one noise level for all), so a
noisy sample pulls the surface less than a clean one and repeated points average out.  Inputs are the
knobs' unit coordinates (:meth:`SearchSpace.unit_point`).  The first ``initial_points`` proposals are
a Latin hypercube; then each proposal maximises expected improvement over the best posterior mean among measured
points, over random candidates and perturbations of the best ones.  Convergence: the best expected
improvement stayed below ``min_gain`` (relative) for ``patience`` proposals in a row.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..knobs import Knobs
from .space import SearchSpace
from .strategies import Observation, Told


@dataclass
class Tuner(Told):
    """The GP strategy (``tunelab``); ``ask``/``tell`` as every strategy in :mod:`.strategies`."""

    space: SearchSpace
    seed: int = 0
    initial_points: int = 5
    min_gain: float = 0.003
    patience: int = 3
    candidates: int = 1500
    name: str = "tunelab"

    def __post_init__(self) -> None:
        super().__init__(self.space)
        self._rng = np.random.default_rng(self.seed)
        self._quiet = 0
        self._asked = 0
        self._model: Any = None
        self._design: np.ndarray | None = None
        self.last_ei: float | None = None

    def ask(self) -> Knobs:
        self._asked += 1
        fresh = self._asked <= self.initial_points or len(self.live) < 2
        if not self.space.names:
            return self.space.base
        if fresh:
            return self.space.from_unit(self._initial_design()[(self._asked - 1) % max(1, self.initial_points)].tolist())
        model = self.fit()
        pool = self._candidate_pool()
        mu, sd = model.predict(pool)
        best = float(np.max(model.predict(self._x())[0]))
        ei = expected_improvement(mu, sd, best)
        i = int(np.argmax(ei))
        self.last_ei = float(ei[i])
        self._quiet = self._quiet + 1 if self.last_ei < self.min_gain else 0
        return self.space.from_unit(pool[i].tolist())

    def take_design_place(self) -> None:
        """A setting asked from elsewhere (the scale model's first proposals, :class:`.strategies.SeededStrategy`)
        takes the next place of the initial design: the design's other points still spread over the
        space, and the model-driven proposals begin as early as without it (added on top, two proposals
        put two more blocks before them)."""
        if self._asked < self.initial_points:
            self._asked += 1

    def _initial_design(self) -> np.ndarray:
        """A Latin hypercube over the unit cube: the first proposals spread over every knob's range."""
        if self._design is None:
            from scipy.stats import qmc

            n = max(1, self.initial_points)
            self._design = qmc.LatinHypercube(d=len(self.space.names), seed=self.seed).random(n)
        return self._design

    def retell(self, i: int, value: float, variance: float) -> None:
        super().retell(i, value, variance)
        self._model = None

    def converged(self) -> bool:
        return bool(self.space.names) and self._quiet >= self.patience

    def ranked(self) -> list[Knobs]:
        """Measured configurations, best posterior mean first (a noisy lucky sample is not trusted)."""
        distinct = list(dict.fromkeys(o.knobs for o in self.live))
        if len(self.live) < 2 or not self.space.names:
            return super().ranked()
        mu, _ = self.fit().predict(np.asarray([self.space.unit_point(k) for k in distinct]))
        return [distinct[i] for i in np.argsort(-mu, kind="stable")]

    def recommend(self) -> Knobs | None:
        """The configuration the model believes fastest, measured or not, among the measured ones and points
        around the best of them, by posterior mean less half a standard deviation (no wild guesses)."""
        if len(self.live) < 2 or not self.space.names:
            return super().recommend()
        model = self.fit()
        d = len(self.space.names)
        top = np.asarray([self.space.unit_point(k) for k in self.ranked()[:3]])
        near = [np.clip(c + self._rng.normal(0.0, 0.06, (self.candidates // 5, d)), 0.0, 1.0) for c in top]
        pool = np.asarray([self.space.unit_point(self.space.from_unit(u.tolist()))
                           for u in np.concatenate([top, *near])])
        mu, sd = model.predict(pool)
        return self.space.from_unit(pool[int(np.argmax(mu - 0.5 * sd))].tolist())

    def estimate(self, knobs: Knobs) -> tuple[float, float]:
        """The posterior mean and standard deviation at ``knobs`` (neighbours inform it too)."""
        if len(self.live) < 2 or not self.space.names:
            return super().estimate(knobs)
        mu, sd = self.fit().predict(np.asarray([self.space.unit_point(knobs)]))
        return float(mu[0]), float(sd[0])

    def upper_bound(self, z: float) -> float:
        """The highest posterior mean + ``z`` sd over the measured points and a random pool."""
        if len(self.live) < 2 or not self.space.names:
            return super().upper_bound(z)
        mu, sd = self.fit().predict(np.concatenate([self._x(), self._candidate_pool()]))
        return float(np.max(mu + z * sd))

    def fit(self) -> _Model:
        live = self.live
        if self._model is None or self._model.n != len(live):
            self._model = _Model.fit(self._x(live), np.asarray([o.value for o in live]),
                                     np.asarray([o.variance for o in live]), self.seed)
        return self._model

    def _x(self, live: list[Observation] | None = None) -> np.ndarray:
        """Unit coordinates of the observations not withdrawn (``live``: :attr:`live`, when the caller has it)."""
        return np.asarray([self.space.unit_point(o.knobs) for o in (self.live if live is None else live)],
                          dtype=np.float64)

    def _candidate_pool(self) -> np.ndarray:
        d = len(self.space.names)
        pool = [self._rng.random((self.candidates, d))]
        top = np.asarray([self.space.unit_point(k) for k in self.ranked()[:3]])
        for centre in top:
            pool.append(np.clip(centre + self._rng.normal(0.0, 0.08, (self.candidates // 10, d)), 0.0, 1.0))
        raw = np.concatenate(pool)
        # What is measured is the rounded knob value: score that, not the raw coordinate.
        return np.asarray([self.space.unit_point(self.space.from_unit(u.tolist())) for u in raw])


@dataclass
class _Model:
    """A fitted GP on normalised targets: ``predict`` returns mean and std in the told units."""

    gp: Any
    offset: float
    scale: float
    n: int

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray, variance: np.ndarray, seed: int) -> _Model:
        # scikit-optimize's GP and kernels (scikit-learn's, with the gradients skopt's own optimizers
        # use); each point's noise is its own variance (``alpha``), which skopt's optimizers do not take
        from skopt.learning import GaussianProcessRegressor
        from skopt.learning.gaussian_process.kernels import ConstantKernel, Matern

        offset = float(np.mean(y))
        scale = max(float(np.std(y)), math.sqrt(float(np.mean(variance))), 1e-3)
        kernel = ConstantKernel(1.0, (1e-2, 1e2)) * Matern(length_scale=np.full(x.shape[1], 0.3),
                                                            length_scale_bounds=(0.05, 5.0), nu=2.5)
        gp = GaussianProcessRegressor(kernel=kernel, alpha=variance / scale ** 2 + 1e-6, normalize_y=False,
                                      n_restarts_optimizer=1, random_state=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter of the hyper-parameter fit
            gp.fit(x, (y - offset) / scale)
        return cls(gp, offset, scale, len(y))

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mu, sd = self.gp.predict(x, return_std=True)
        return mu * self.scale + self.offset, sd * self.scale


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """Expected improvement over ``best`` of a maximised quantity (log units: relative gain)."""
    from scipy.stats import norm

    sd = np.maximum(sd, 1e-9)
    z = (mu - best) / sd
    return (mu - best) * norm.cdf(z) + sd * norm.pdf(z)
