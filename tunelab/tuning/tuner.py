"""The Bayesian optimizer: scikit-optimize's ``Optimizer`` with a Gaussian-process surrogate.

Scores are samples/s; the optimizer minimises ``-score / reference`` (the default config's
score), which keeps the GP's targets near -1 whatever the model's throughput.  Convergence:
the expected improvement of the next proposal, relative to the best so far, has stayed below
``min_gain`` for ``patience`` consecutive proposals.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..knobs import Knobs
from .space import SearchSpace


@dataclass
class Observation:
    knobs: Knobs
    score: float
    spread: float = 0.0


@dataclass
class Tuner:
    space: SearchSpace
    seed: int = 0
    # 8 random points before the GP leads (about twice the searched dimensions), then stop when the
    # expected gain stays under 0.2 % for 5 proposals: noisy, flat landscapes need that much patience.
    initial_points: int = 8
    min_gain: float = 0.002
    patience: int = 5
    reference: float | None = None  # the default config's score (set by the first tell)
    history: list[Observation] = field(default_factory=list)

    def __post_init__(self) -> None:
        from skopt import Optimizer

        self._opt = Optimizer(self.space.skopt_dimensions(), base_estimator="GP", acq_func="EI",
                              acq_optimizer="sampling", n_initial_points=self.initial_points,
                              random_state=self.seed)
        self._quiet = 0
        self._pending: list[tuple[Knobs, float]] = []

    @property
    def searchable(self) -> bool:
        return bool(self.space.names)

    def warm_start(self, observations: list[tuple[Knobs, float]]) -> None:
        """Stored trials (knobs, samples/s) of this profile: they reach the GP once this run's default has
        been measured, normalised by it, so the search starts where earlier runs left off."""
        self._pending = list(observations)

    def tell(self, knobs: Knobs, score: float, spread: float = 0.0) -> None:
        """Record a measured configuration (the first one told sets the reference)."""
        if self.reference is None:
            self.reference = score
        self.history.append(Observation(knobs, score, spread))
        if not self.searchable:
            return
        with quiet_repeats():
            self._opt.tell(self.space.to_point(knobs), -score / self.reference)
        pending, self._pending = getattr(self, "_pending", []), []
        if pending:
            points = [self.space.to_point(self.space.base.replace(**_searched(k, self.space.names)))
                      for k, _ in pending]
            with quiet_repeats():
                self._opt.tell(points, [-s / self.reference for _, s in pending])

    def ask(self) -> Knobs:
        with quiet_repeats():
            point = self._opt.ask()
        self._update_patience(point)
        return self.space.to_knobs(point)

    def best(self) -> Observation:
        return max(self.history, key=lambda o: o.score)

    def converged(self) -> bool:
        return self.searchable and self._quiet >= self.patience

    def expected_gain(self, point: list[Any]) -> float | None:
        """Expected improvement of ``point`` over the best so far, relative to it (None before a model)."""
        if not self._opt.models:
            return None
        from skopt.acquisition import gaussian_ei

        x = self._opt.space.transform([point])
        y_best = min(self._opt.yi)
        return float(gaussian_ei(x, self._opt.models[-1], y_opt=y_best)[0]) / abs(y_best)

    def _update_patience(self, point: list[Any]) -> None:
        gain = self.expected_gain(point)
        if gain is not None and gain < self.min_gain:
            self._quiet += 1
        elif gain is not None:
            self._quiet = 0


def _searched(knobs: Knobs, names: tuple[str, ...]) -> dict[str, object]:
    return {n: getattr(knobs, n) for n in names}


@contextlib.contextmanager
def quiet_repeats() -> Iterator[None]:
    """Silence scikit-optimize's warning that a proposal repeats a measured point (it then proposes
    a random one, which is what we want: with noisy scores a repeat is a sensible proposal, not a
    problem for the user to read about)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The objective has been evaluated at point",
                                category=UserWarning)
        yield
