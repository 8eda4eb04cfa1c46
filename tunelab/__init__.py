"""tunelab: a Bayesian autotuning lab for data-parallel training communication."""

__version__ = "0.1.0"
