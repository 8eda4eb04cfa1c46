"""The scale model: an α-β-γ model of every allreduce path, fitted on bench runs, and a step-time
model of a workload under the engine's knobs, to predict what the lab cannot run (up to 1024 ranks).

* :mod:`.costs` — the cost formulas (linear in the parameters), the :class:`~.costs.Topology`;
* :mod:`.data` — bench allreduce JSON files as observations;
* :mod:`.fit` — robust relative-error fit, the saved :class:`~.fit.ScaleModel`;
* :mod:`.step` — the coordinator's cycles, fusion and overlap, simulated: step time;
* :mod:`.predict` — tables per size and algorithm, the flat vs hierarchical crossover, knob grids;
* :mod:`.tuner` — first proposals for an unseen topology and the model as a tuning objective;
* :mod:`.report` — the report's figures (measured vs predicted, extrapolation).

Nothing heavy is imported here: ``import tunelab.model`` loads no numpy-heavy module until used.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Topology": "costs", "Observation": "data", "ModelInputError": "data", "load_bench": "data",
    "load_many": "data", "ScaleModel": "fit", "ModelError": "fit", "fit_model": "fit", "relative_errors": "fit",
    "Workload": "step", "simulate_step": "step", "crossover": "predict", "allreduce_table": "predict",
    "step_table": "predict", "predicted_best": "tuner", "ModelObjective": "tuner", "model_landscape": "tuner",
}

__all__ = [
    "ModelError", "ModelInputError", "ModelObjective", "Observation", "ScaleModel", "Topology", "Workload",
    "allreduce_table", "crossover", "fit_model", "load_bench", "load_many", "model_landscape", "predicted_best",
    "relative_errors", "simulate_step", "step_table",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tunelab.model' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
