"""What the tuner can take from the model (library only; the tuning driver wires it in).

* :func:`predicted_best` — the knob settings the model ranks best for a workload on a topology: the
  first proposals on a topology no profile has tuned yet (each says it came from the model).
* :class:`ModelObjective` — the model as an objective for the tuning driver, with the interface of
  the recorded landscapes' :class:`tunelab.tuning.replay.Objective` (``step_s(knobs)``, ``t_s``,
  ``current()`` and a ``landscape`` with ``space``, ``name``, ``best``, ``true_score``,
  ``samples_per_step``), so ``bench tuner`` strategies can run at sizes the lab cannot reach.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..knobs import Knobs
from ..tuning.plan import Plan
from .costs import Topology
from .fit import ScaleModel
from .predict import grid_knobs
from .step import Workload, simulate_step


@dataclass(frozen=True)
class Proposal:
    knobs: Knobs
    predicted_step_s: float
    source: str = "scale model"

    def describe(self, hier: bool = False) -> str:
        """One line as ``tune`` prints its blocks: sizes in binary units, switches on/off (``hier``: say
        hierarchical when off too, as for a job of several hosts)."""
        from ..tuning.run import describe

        return (f"{self.source}: {describe(self.knobs, hier=hier)} "
                f"(predicted {self.predicted_step_s * 1e3:.1f} ms/step)")


def predicted_best(model: ScaleModel, workload: Workload, topo: Topology, count: int = 3,
                   grid: dict[str, Sequence] | None = None, base: Knobs | None = None) -> list[Proposal]:
    """The ``count`` settings of the grid with the lowest predicted step time, best first (distinct
    settings; ``base`` holds pinned knobs)."""
    scored = [(simulate_step(model, workload, topo, k).step_s, i, k)
              for i, k in enumerate(grid_knobs(grid, topo, base))]
    scored.sort()
    return [Proposal(k, s) for s, _, k in scored[:count]]


@dataclass
class ModelLandscape:
    """The model seen as a landscape: what the tuning benchmark asks of a recorded one."""

    name: str
    space: Any  # tunelab.tuning.space.SearchSpace
    model: ScaleModel
    workload: Workload
    topo: Topology
    samples_per_step: float = 1.0
    grid: dict[str, Sequence] | None = None
    recorded: dict | None = None  # a recorded landscape's provenance (none: the tuner's default plan)
    _cache: dict[Knobs, float] = field(default_factory=dict, repr=False)

    def step_s(self, knobs: Knobs) -> float:
        if knobs not in self._cache:
            self._cache[knobs] = simulate_step(self.model, self.workload, self.topo, knobs).step_s
        return self._cache[knobs]

    def true_score(self, knobs: Knobs) -> float:
        """Samples/s the model predicts for ``knobs``."""
        return self.samples_per_step / self.step_s(knobs)

    @property
    def best(self) -> float:
        """The best predicted samples/s over the grid (the reference a locked result is scored against)."""
        return max(self.true_score(k) for k in grid_knobs(self.grid, self.topo, self.space.base))


class ModelObjective:
    """Simulated steps for the tuning driver: the model's step time times log-normal noise
    (``noise``: its sigma) and the seeded host drift of recorded replays."""

    def __init__(self, landscape: ModelLandscape, seed: int, noise: float = 0.03, drift: Any = None) -> None:
        from ..tuning.replay import Drift

        self.landscape = landscape
        self.noise = float(noise)
        self.drift = drift or Drift(0.0)
        self.rng = np.random.default_rng(seed)
        self.t_s = 0.0

    def current(self) -> ModelLandscape:
        return self.landscape

    def step_s(self, knobs: Knobs) -> float:
        base = self.landscape.step_s(knobs)
        step = base * math.exp(self.rng.normal(0.0, self.noise)) * self.drift.factor(self.t_s)
        self.t_s += step
        return step


def model_landscape(model: ScaleModel, workload: Workload, topo: Topology, pinned: dict[str, object] | None = None,
                    samples_per_step: float = 1.0) -> ModelLandscape:
    """A :class:`ModelLandscape` over the tuner's own search space for ``topo``."""
    from ..tuning.space import search_space

    space = search_space(dict(pinned or {}), topo.hosts)
    return ModelLandscape(f"model:{workload.name}@{topo.hosts}x{topo.ranks_per_host}", space, model, workload,
                          topo, samples_per_step)


def recorded_landscape(model: ScaleModel, workload: Workload, topo: Topology, noise: float = 0.03,
                       steps: int = 40, seed: int = 0, grid: dict[str, Sequence] | None = None,
                       samples_per_step: float = 1.0) -> Any:
    """The model's grid as a recorded landscape (:class:`tunelab.tuning.replay.Landscape`): each point
    gets ``steps`` step times, its predicted step time times seeded log-normal noise of sigma
    ``noise``.  ``bench tuner`` then runs every strategy through the same driver and replay as on a
    landscape measured in the lab, at any topology the model reaches (e.g. 256 hosts x 4 ranks)."""
    from ..tuning.replay import Landscape
    from ..tuning.space import search_space

    space = search_space({}, topo.hosts)
    points = grid_knobs(grid, topo, space.base)
    rng = np.random.default_rng(seed)
    pools = [simulate_step(model, workload, topo, k).step_s * np.exp(rng.normal(0.0, noise, steps))
             for k in points]
    means = np.asarray([float(np.mean(samples_per_step / p)) for p in pools])
    name = f"model:{workload.name}@{topo.hosts}x{topo.ranks_per_host}"
    return Landscape(name, space, points, pools, means, 0.0, samples_per_step,
                     {"source": "scale model", "topology": f"{topo.hosts}x{topo.ranks_per_host} {topo.link}"})


def default_model_path() -> Any:
    """Where ``tune`` looks for a scale model when none is given: ``$TUNELAB_HOME/scale-model.json``."""
    from ..config import tunelab_home

    return tunelab_home() / "scale-model.json"


def job_proposals(path: Any, p: dict[str, Any], hosts: int, ranks_per_host: int, link_gbps: float | None,
                  oversubscription: float, space: Any, count: int = 2,
                  grid: dict[str, Sequence] | None = None,
                  model: ScaleModel | None = None) -> tuple[list[Knobs], list[str]]:
    """First proposals for a tuning job from the model at ``path``: the ``count`` settings of the
    searched knobs with the lowest predicted step time (among ``grid``'s, by default the model's
    prediction grid), and lines saying so (or why there are none).  ``model``: that file already
    loaded (a caller asking for many jobs reads it once)."""
    from .data import ModelInputError
    from .fit import ModelError
    from .predict import DEFAULT_GRID

    try:
        model = ScaleModel.load(path) if model is None else model
        link = "none"
        if hosts > 1:  # (no speed known, on real hosts: the model's one fitted link, as predict takes it)
            model, link = model.for_link(link_gbps)
        element = np.dtype(p.get("replay_dtype") or "float32").itemsize if p.get("workload") == "replay" else 4
        work = Workload.of_model(str(p.get("name", p["model"])), p["model"], p.get("replay_forward_ms", 100.0),
                                 p.get("replay_backward_ms", 250.0), element)
        # a training scenario records no compute times: the model ranks its settings on a replay's defaults
        assumed = p.get("workload") != "replay"
        grid = {k: v for k, v in (DEFAULT_GRID if grid is None else grid).items() if k in space.names}
        if not grid:
            return [], []
        topo = Topology(hosts, ranks_per_host, link, oversubscription)
        best = predicted_best(model, work, topo, count, grid, space.base)
        default_s = simulate_step(model, work, topo, space.base).step_s
    except (ModelError, ModelInputError) as exc:  # a model file that does not fit this job, or that this
        # tunelab cannot read (an older format, a corrupt file): tune without it, and say so
        return [], [f"# scale model {path} not used: {exc}"]
    compute = (f"; compute assumed at {work.forward_ms:g} + {work.backward_ms:g} ms a step, as this "
               "training scenario records none" if assumed else "")
    where = f"{hosts} host{'s' if hosts != 1 else ''} x {ranks_per_host} rank{'s' if ranks_per_host != 1 else ''}"
    # only what the model expects to be worth a change: where it predicts every setting within the tuner's
    # minimum gain of the default (a compute-bound step, say), its ranking is a tie broken by grid order
    gain = Plan().min_gain
    best = [b for b in best if b.predicted_step_s * (1.0 + gain) <= default_s]
    if not best:
        return [], [(f"# scale model {path} ({where}, link {link}): no setting is predicted to beat the default "
                     f"knobs' {default_s * 1e3:.1f} ms/step by {100 * gain:g} %{compute}: no first proposals")]
    head = (f"# first proposals from the scale model {path} ({where}, link {link}; no stored trials to start from on this "
            f"hardware; the default knobs predicted at {default_s * 1e3:.1f} ms/step{compute}):")
    lines = [head] + [f"#   {b.describe(hier=hosts > 1)}" for b in best]
    return [b.knobs for b in best], lines


def landscape_proposals(path: Any, land: Any, count: int = 2,
                        model: ScaleModel | None = None) -> tuple[list[Knobs], list[str]]:
    """The first proposals ``tune`` would take from the model at ``path`` on the layout a recorded
    landscape ran on (its hosts or emulated nodes, ranks, link and the machine's cores, its scenario's
    workload), among the landscape's own grid settings, and the lines ``tune`` prints with them.  None,
    and a line saying why, for a landscape trained on GPUs (the model is the host path's; ``tune``
    takes no proposals there either) or one that does not record what the model needs."""
    from ..errors import ScenarioError
    from ..scenarios import load_scenario

    rec = land.recorded or {}
    layout = rec.get("layout") or {}
    why, sc, where = None, None, None
    if layout.get("device") == "cuda":
        why = "trained on GPUs, which the model does not cover"
    else:
        where = _recorded_layout(layout)
        if where is None or not rec.get("scenario"):
            why = "it does not record its scenario, ranks, nodes and cores as numbers"
    if why is None:
        try:
            sc = load_scenario(rec["scenario"])
        except ScenarioError as exc:
            why = f"its scenario cannot be loaded here ({str(exc).splitlines()[0]})"
    if why is not None or sc is None or where is None:
        return [], [f"# {land.name}: no first proposals from the scale model: {why}"]
    hosts, per_host, gbps, per_core = where
    gbps = gbps or sc.link_gbps
    p = {**sc.as_params(), "replay_dtype": layout.get("dtype")}
    grid = {n: sorted({getattr(k, n) for k in land.knobs}) for n in land.space.names}
    first, lines = job_proposals(path, p, hosts, per_host, gbps, per_core, land.space, count, grid, model)
    return first, [f"# {land.name}:"] + lines


def _recorded_layout(layout: dict) -> tuple[int, int, float | None, float] | None:
    """(hosts, ranks per host, link Gb/s or None, ranks per core) from a recording's layout: a lab's
    hosts, else its emulated nodes; None where it does not say, or says it in something other than numbers."""
    try:
        world, nodes, cores = int(layout["world_size"]), int(layout["nodes"]), int(layout["cpu_cores"])
        lab = layout.get("lab")
        if lab:
            hosts, per_host = int(lab["hosts"]), int(lab["ranks_per_host"])
            gbps = float(lab["link_gbps"]) if lab.get("link_gbps") is not None else None
        else:
            hosts, per_host = nodes, max(1, world // max(1, nodes))
            gbps = float(layout["link_gbps"]) if layout.get("link_gbps") is not None else None
    except (KeyError, TypeError, ValueError):
        return None
    if min(world, nodes, cores, hosts, per_host) < 1 or (gbps is not None and not gbps > 0):
        return None
    return hosts, per_host, gbps, world / cores
