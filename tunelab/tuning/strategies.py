"""Search strategies behind one ask/tell interface, all driven by the same protocol (:mod:`.driver`).

A strategy proposes knobs (``ask``), learns a measured value (``tell(knobs, value, variance)``: the
paired log ratio to the reference and its variance), says when it has nothing left worth trying
(``converged``), ranks what it measured (``ranked``), and says what it believes of a configuration
(``estimate``) and of the whole space (``upper_bound``).  ``warm_start`` hands it earlier trials.

* ``tunelab``: a Gaussian process over the joint space (:class:`tunelab.tuning.tuner.Tuner`);
* ``random``: uniform draws of the same space (log scales included);
* ``horovod``: Horovod's autotune protocol: for each combination of the boolean knobs in turn, four
  fixed starting points (fusion MiB, cycle ms) = (4, 5), (32, 50), (16, 25), (8, 10), then a fresh
  Gaussian process with expected improvement until that combination has had 21 samples;
* ``coordinate``: coordinate descent as AutoCCL tunes NCCL: one knob at a time, a few values along it
  with the others at the incumbent, the best kept, then the next knob; converged after a full sweep
  that changed nothing (or ``sweeps`` sweeps).  Settings given from elsewhere (the scale model's first
  proposals, earlier trials) that measured better than the incumbent become it before the next line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..knobs import Knobs, MiB
from .space import SearchSpace

HOROVOD_STARTS = ((4, 5.0), (32, 50.0), (16, 25.0), (8, 10.0))  # (fusion MiB, cycle ms)
HOROVOD_SAMPLES = 21  # per combination of the boolean knobs


@dataclass(frozen=True)
class Observation:
    knobs: Knobs
    value: float     # paired log ratio to the reference: higher is faster
    variance: float


class Told:
    """What every strategy keeps: the observations, and a ranking by mean value per configuration."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.observations: list[Observation] = []

    def tell(self, knobs: Knobs, value: float, variance: float) -> None:
        self.observations.append(Observation(knobs, float(value), float(variance)))

    def retell(self, i: int, value: float, variance: float) -> None:
        """Replace the ``i``-th observation's value and variance (a better estimate of the same block);
        an infinite variance withdraws it (a block found next to a disturbed reference): it stays in
        ``observations``, where indices point, and leaves :attr:`live`, which the models read."""
        o = self.observations[i]
        self.observations[i] = Observation(o.knobs, float(value), float(variance))

    @property
    def live(self) -> list[Observation]:
        """The observations not withdrawn."""
        return [o for o in self.observations if math.isfinite(o.variance)]

    def warm_start(self, observations: list[Observation]) -> None:
        for o in observations:
            self.tell(o.knobs, o.value, o.variance)

    def means(self) -> dict[Knobs, float]:
        """Each measured configuration's mean told value (the observations not withdrawn)."""
        values: dict[Knobs, list[float]] = {}
        for o in self.live:
            values.setdefault(o.knobs, []).append(o.value)
        return {k: float(np.mean(v)) for k, v in values.items()}

    def ranked(self) -> list[Knobs]:
        means = self.means()
        return sorted(means, key=lambda k: -means[k])

    def recommend(self) -> Knobs | None:
        """The configuration to confirm first: by default the best measured one."""
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def converged(self) -> bool:
        return False

    def estimate(self, knobs: Knobs) -> tuple[float, float]:
        """(value, standard deviation) believed for ``knobs``: here the inverse-variance mean of its own
        observations ((0, inf) if it has none)."""
        mine = [o for o in self.live if o.knobs == knobs]
        if not mine:
            return 0.0, math.inf
        weights = [1.0 / max(o.variance, 1e-12) for o in mine]
        mean = sum(w * o.value for w, o in zip(weights, mine)) / sum(weights)
        return mean, math.sqrt(1.0 / sum(weights))

    def upper_bound(self, z: float) -> float:
        """The highest value any configuration may still have (estimate + ``z`` sd); without a model
        of the unmeasured space, unbounded."""
        return math.inf


class RandomSearch(Told):
    name = "random"

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        super().__init__(space)
        self._rng = np.random.default_rng(seed)

    def ask(self) -> Knobs:
        return self.space.from_unit(self._rng.random(len(self.space.names)).tolist())


class CoordinateDescent(Told):
    name = "coordinate"

    def __init__(self, space: SearchSpace, seed: int = 0, values_per_knob: int = 3, sweeps: int = 2) -> None:
        super().__init__(space)
        self.values_per_knob, self.sweeps = values_per_knob, sweeps
        self._rng = np.random.default_rng(seed)
        self.incumbent = space.base
        self._lined: set[Knobs] = {space.base}  # every configuration a line asked for (and the default)
        self._axis, self._sweep, self._changed = 0, 0, False
        self._line: list[Knobs] = []
        self._done = not space.names

    def ask(self) -> Knobs:
        if not self._line and not self._done:
            self._adopt_given()
            self._line = self._line_of(self.space.names[self._axis])
        pending = [k for k in self._line if k not in {o.knobs for o in self.observations}]
        return pending[0] if pending else self.incumbent

    def tell(self, knobs: Knobs, value: float, variance: float) -> None:
        super().tell(knobs, value, variance)
        measured = {o.knobs for o in self.observations}
        if self._line and all(k in measured for k in self._line):
            self._finish_line()

    def converged(self) -> bool:
        return self._done

    def _value(self, means: dict[Knobs, float], k: Knobs) -> float:
        # the default is the reference: 0 by definition until measured
        return means.get(k, 0.0 if k == self.space.base else -np.inf)

    def _adopt_given(self) -> None:
        """Before a line starts: a configuration measured outside every line (asked first from elsewhere,
        as the scale model's proposals are, or handed over by ``warm_start``) that measured better than
        the incumbent becomes the incumbent, so the descent walks from the best point it knows, as a
        warm-started coordinate search does; otherwise those points would be measured and then ignored."""
        means = self.means()
        given = [k for k in means if k not in self._lined]
        best = max(given, key=lambda k: means[k], default=None)
        if best is not None and means[best] > self._value(means, self.incumbent):
            self.incumbent, self._changed = best, True

    def _line_of(self, name: str) -> list[Knobs]:
        scale = self.space.scale(name)
        if scale.kind == "bool":
            values: list[object] = [not getattr(self.incumbent, name)]
        else:
            offset = self._rng.random() / self.values_per_knob  # a fresh grid along the axis each sweep
            values = [scale.from_unit(offset + i / self.values_per_knob) for i in range(self.values_per_knob)]
        line = [self.incumbent.replace(**{name: v}) for v in values]
        line = [k for k in dict.fromkeys(line) if k != self.incumbent]
        self._lined.update(line)
        return line

    def _finish_line(self) -> None:
        means = self.means()
        best = max([self.incumbent, *self._line], key=lambda k: self._value(means, k))
        if best != self.incumbent:
            self.incumbent, self._changed = best, True
        self._line = []
        self._axis += 1
        if self._axis == len(self.space.names):
            self._axis, self._sweep = 0, self._sweep + 1
            self._done = self._sweep >= self.sweeps or not self._changed
            self._changed = False


class HorovodProtocol(Told):
    name = "horovod"

    def __init__(self, space: SearchSpace, seed: int = 0) -> None:
        super().__init__(space)
        self.seed = seed
        self.combos = _boolean_combinations(space)
        self._combo, self._count = 0, 0
        self._search = self._fresh()

    def ask(self) -> Knobs:
        spent = self._count >= HOROVOD_SAMPLES or (not self._search.space.names and self._count >= 1)
        if spent and self._combo + 1 < len(self.combos):
            self._combo, self._count = self._combo + 1, 0
            self._search = self._fresh()
        self._count += 1
        starts = self._starts()
        if self._count <= len(starts):
            return starts[self._count - 1]
        return self._search.ask()

    def tell(self, knobs: Knobs, value: float, variance: float) -> None:
        super().tell(knobs, value, variance)
        if all(getattr(knobs, n) == v for n, v in self.combos[self._combo].items()):
            self._search.tell(knobs, value, variance)

    def retell(self, i: int, value: float, variance: float) -> None:
        old = self.observations[i]
        super().retell(i, value, variance)
        mine = self._search.observations
        for j, o in enumerate(mine):
            if o == old:
                self._search.retell(j, value, variance)
                break

    def converged(self) -> bool:
        last = self._combo == len(self.combos) - 1
        return last and (self._count >= HOROVOD_SAMPLES or not self._search.space.names)

    def _fresh(self) -> Told:
        from .tuner import Tuner

        sub = self.space.restricted(self.combos[self._combo])
        return Tuner(sub, seed=self.seed + self._combo, initial_points=0, patience=10 ** 9)

    def _starts(self) -> list[Knobs]:
        sub = self._search.space
        out = []
        for mib, ms in HOROVOD_STARTS:
            values = {"fusion_threshold_bytes": mib * MiB, "cycle_time_ms": ms}
            out.append(sub.base.replace(**{k: v for k, v in values.items() if k in sub.names}))
        return list(dict.fromkeys(out)) if sub.names else [sub.base]


def _boolean_combinations(space: SearchSpace) -> list[dict[str, object]]:
    combos: list[dict[str, object]] = [{}]
    for name in space.booleans():
        first = getattr(space.base, name)
        combos = [{**c, name: v} for c in combos for v in (first, not first)]
    return combos


def _tunelab(space: SearchSpace, seed: int) -> Told:
    from .tuner import Tuner

    return Tuner(space, seed=seed)


STRATEGIES: dict[str, Callable[[SearchSpace, int], Told]] = {
    "tunelab": _tunelab, "random": RandomSearch, "horovod": HorovodProtocol, "coordinate": CoordinateDescent}


class SeededStrategy:
    """A search strategy whose first asks are given settings (``tune``: the scale model's predicted best
    on a topology no profile has tuned; ``bench tuner --first-from-model``: the same on a landscape's
    layout), then its own; everything else (what it is told, its model, its stop) is the inner one's."""

    def __init__(self, inner: Any, first: Sequence[Knobs]) -> None:
        self.inner = inner
        self._first = list(first)

    def ask(self) -> Knobs:
        if not self._first:
            return self.inner.ask()
        take = getattr(self.inner, "take_design_place", None)
        if take is not None:  # a strategy with an initial design: the given setting takes one of its places
            take()
        return self._first.pop(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_strategy(name: str, space: SearchSpace, seed: int = 0) -> Told:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; strategies are {', '.join(STRATEGIES)}")
    return STRATEGIES[name](space, seed)
