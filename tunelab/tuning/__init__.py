"""Bayesian tuning of the engine's knobs during real training: search space, tuner, live session."""
