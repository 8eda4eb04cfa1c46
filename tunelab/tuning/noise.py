"""How noisy a block is: per-configuration step noise from inside the blocks, plus what the host adds
between blocks, read from the reference blocks.

A block's statistic is the mean of its measured steps' log samples/s.  Two things make it wander:

* **step noise** inside a block (scheduling, stragglers, the step's own variance).  Every block with two
  or more steps estimates it, so it is known with many degrees of freedom after a few blocks.  It
  differs between configurations (a tiny cycle time or an unfused gradient set jitters more), so each
  configuration's estimate is its own pooled within-block variance shrunk toward the pool of all blocks
  (``SHRINK_DF`` pseudo degrees of freedom);
* **block-level noise** ``tau^2``: what successive reference blocks differ by beyond their step noise
  (a host busy for seconds, a drift that bends between two references).  It is the reference blocks'
  mean square successive difference / 2 less their step noise, blended with a small prior.

A paired ratio's variance is the candidate block's variance plus the interpolated reference's (its
squared weights), each with ``tau^2``; the mean of several ratios that share reference blocks counts
each block once, with its total weight (:meth:`.driver.Driver.interval_of`).  The t-quantile of an
interval uses Welch-Satterthwaite degrees of freedom of the two parts, the step part's from the
finalist's and the reference's own step variances (:meth:`Noise.steps_df`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

STEP_PRIOR_SIGMA = 0.03  # one step's log noise assumed before any block is measured (3 %)
STEP_PRIOR_DF = 2
SHRINK_DF = 4            # a configuration's own step noise weighs as much as this many pooled df
TAU_PRIOR_SIGMA = 0.01   # block-level noise assumed before references tell (1 %)
TAU_PRIOR_DF = 2


@dataclass(frozen=True)
class Noise:
    """Step variances per configuration (log units), the pooled one, and the block-level ``tau2``."""

    step_var: dict[Hashable, float]
    pooled_var: float
    df_steps: int
    tau2: float
    df_tau: int
    step_df: dict[Hashable, float] | None = None  # each configuration's step variance's own degrees of freedom
    ref_ms: float = 0.0        # the reference blocks' mean square successive difference / 2 (0: none)
    ref_expected: float = 0.0  # ... what their step noise alone would give
    ref_diffs: int = 0         # ... over this many differences

    def bounded(self, beta: float) -> Noise:
        """This model with ``tau2`` at its upper ``1 - beta`` confidence limit, taken as known (infinite
        degrees of freedom): the variance of a difference of successive references (``ref_ms`` over
        ``ref_diffs`` degrees of freedom) at its chi-square limit, less their step noise.  With two or
        three references' differences the estimate of ``tau2`` is often far below the host's by chance;
        an interval that clears with ``tau2`` anywhere in its confidence set does not rest on that chance
        (Berger and Boos: a test's size grows by at most ``beta``)."""
        if self.ref_diffs < 1:
            return self
        from scipy.stats import chi2

        limit = self.ref_ms * self.ref_diffs / float(chi2.ppf(beta, self.ref_diffs)) - self.ref_expected
        return dataclasses.replace(self, tau2=max(self.tau2, limit), df_tau=10 ** 6)

    def df_of(self, config: Hashable) -> float:
        """Degrees of freedom of ``config``'s step variance: a configuration's own (its within-block df
        and the pooled variance it is shrunk toward, blended by Satterthwaite), the pool's otherwise."""
        return (self.step_df or {}).get(config, float(self.df_steps))

    def steps_df(self, parts: Sequence[tuple[float, Hashable]]) -> float:
        """Satterthwaite degrees of freedom of a sum of step-variance terms ``(coefficient x that
        configuration's step variance, configuration)``: a finalist measured in few steps contributes few
        degrees of freedom, however many the reference's blocks have."""
        total = sum(v for v, _ in parts)
        if total <= 0:
            return float(self.df_steps)
        return total ** 2 / sum(v * v / self.df_of(c) for v, c in parts)

    def block_var(self, config: Hashable, steps: int) -> float:
        """Variance of one block's mean log rate from its step noise alone."""
        return self.step_var.get(config, self.pooled_var) / max(1, steps)

    def pair_var(self, config: Hashable, steps: int, ref: Hashable, weight2: float,
                 per_step: float) -> tuple[float, float]:
        """(step part, block part) of a paired ratio's variance: ``weight2`` is the sum of the
        reference blocks' squared interpolation weights, ``per_step`` the sum of each one's squared
        weight over its number of steps."""
        steps_part = self.block_var(config, steps) + per_step * self.step_var.get(ref, self.pooled_var)
        return steps_part, self.tau2 * (1.0 + weight2)

    def df(self, steps_part: float, block_part: float, df_steps: float | None = None) -> float:
        """Welch-Satterthwaite degrees of freedom of a sum of the two parts (``df_steps``: the step part's,
        when known better than the pool's, :meth:`steps_df`)."""
        total = steps_part + block_part
        df_s = self.df_steps if df_steps is None else df_steps
        if total <= 0:
            return float(df_s)
        return total ** 2 / (steps_part ** 2 / df_s + block_part ** 2 / self.df_tau)


def estimate(blocks: Sequence[tuple[Hashable, Sequence[float]]], ref: Hashable,
             ref_blocks: Sequence[Sequence[float]]) -> Noise:
    """``blocks``: (configuration, the steps' log rates) of every block so far; ``ref``: the reference
    configuration; ``ref_blocks``: its blocks in order (disturbed ones already set aside)."""
    ss: dict[Hashable, float] = {}
    dfs: dict[Hashable, int] = {}
    for config, logs in blocks:
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        ss[config] = ss.get(config, 0.0) + sum((x - mean) ** 2 for x in logs)
        dfs[config] = dfs.get(config, 0) + len(logs) - 1
    df_all = sum(dfs.values())
    pooled = (STEP_PRIOR_DF * STEP_PRIOR_SIGMA ** 2 + sum(ss.values())) / (STEP_PRIOR_DF + df_all)
    per_config = {c: (SHRINK_DF * pooled + ss[c]) / (SHRINK_DF + dfs[c]) for c in ss}
    df_pool = STEP_PRIOR_DF + df_all
    # each blend's own df (Satterthwaite): the pooled part with the pool's, its own part with its own;
    # no more than the pool's (its own steps are in the pool too: the two parts are not independent)
    per_df = {c: min(float(df_pool), _blend_df(SHRINK_DF * pooled / (SHRINK_DF + dfs[c]), df_pool,
                                               ss[c] / (SHRINK_DF + dfs[c]), dfs[c]))
              for c in ss}
    means = [sum(b) / len(b) for b in ref_blocks if b]
    diffs = [b - a for a, b in itertools.pairwise(means)]
    tau2 = TAU_PRIOR_SIGMA ** 2
    ms = expected = 0.0
    if diffs:
        step_var = per_config.get(ref, pooled) if any(len(b) > 1 for b in ref_blocks) else 0.0
        expected = sum(step_var / len(b) for b in ref_blocks if b) / len(means)
        ms = sum(d * d / 2.0 for d in diffs) / len(diffs)
        excess = max(0.0, ms - expected)
        tau2 = (TAU_PRIOR_DF * TAU_PRIOR_SIGMA ** 2 + len(diffs) * excess) / (TAU_PRIOR_DF + len(diffs))
    return Noise(per_config, pooled, df_pool, tau2, TAU_PRIOR_DF + len(diffs), per_df, ms, expected, len(diffs))


def _blend_df(a: float, df_a: float, b: float, df_b: float) -> float:
    """Satterthwaite degrees of freedom of ``a + b``, two independent variance estimates (``df_b`` >= 1: a
    configuration's own within-block df)."""
    if a + b <= 0:
        return float(df_a + df_b)
    return (a + b) ** 2 / (a * a / df_a + b * b / df_b)


def t_quantile(confidence: float, df: float) -> float:
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.5 + confidence / 2.0, max(1.0, df)))


def sigma_of(noise: Noise, config: Hashable, steps: int) -> float:
    """One block's total sigma (log units) for ``config``."""
    return math.sqrt(noise.block_var(config, steps) + noise.tau2)
