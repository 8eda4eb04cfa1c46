"""Drift-robust scores: a candidate's throughput as a ratio to interleaved blocks of the reference.

Everything is in natural-log units: a block's score is log(samples/s), a candidate's paired score is
its log score minus the reference's log score interpolated at the candidate's position between the
two reference blocks around it (or the last one before it while the next is not measured yet).  A
linear drift of the host cancels out of a bracketed ratio.

How noisy each ratio is comes from :mod:`.noise` (step noise inside blocks, per configuration, and
what the reference blocks add between them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Paired:
    log_ratio: float
    refs: tuple[tuple[float, float, int | None], ...]  # (position, weight, steps or None) of each reference used

    @property
    def weight2(self) -> float:
        """Sum of the references' squared interpolation weights (see :meth:`.noise.Noise.pair_var`)."""
        return sum(w * w for _, w, _ in self.refs)

    @property
    def per_step(self) -> float | None:
        """Sum of weight^2 / steps of those references (None: their steps not given)."""
        if any(k is None for _, _, k in self.refs):
            return None
        return sum(w * w / k for _, w, k in self.refs)


@dataclass(frozen=True)
class Interval:
    """A gain (candidate / reference) with its two-sided confidence interval."""

    gain: float
    low: float
    high: float
    n: int  # paired measurements behind it

    def text(self) -> str:
        return f"{self.gain:.3f}x [{self.low:.3f}, {self.high:.3f}]"

    def as_dict(self) -> dict[str, float]:
        return {"gain": self.gain, "low": self.low, "high": self.high, "n": self.n}


def paired(position: float, log_score: float, refs: list[tuple[float, ...]],
           bracket: bool = True) -> Paired | None:
    """``log_score`` at ``position`` against ``refs`` ((position, log score[, steps]), in order): the two
    around it interpolated when ``bracket`` and both exist, else the nearest one before it (or after
    it).  With each reference's steps given, ``per_step`` weighs its share of the variance by them."""
    before = [r for r in refs if r[0] < position]
    after = [r for r in refs if r[0] > position]
    def steps(r: tuple[float, ...]) -> int | None:
        return int(r[2]) if len(r) > 2 else None

    if bracket and before and after:
        r0, r1 = before[-1], after[0]
        w1 = (position - r0[0]) / (r1[0] - r0[0])
        return Paired(log_score - ((1.0 - w1) * r0[1] + w1 * r1[1]),
                      ((r0[0], 1.0 - w1, steps(r0)), (r1[0], w1, steps(r1))))
    nearest = before[-1] if before else (after[0] if after else None)
    if nearest is None:
        return None
    return Paired(log_score - nearest[1], ((nearest[0], 1.0, steps(nearest)),))


def reference_weights(pairs: list[Paired]) -> dict[float, tuple[float, int | None]]:
    """Each reference block's weight in the mean of ``pairs``' log ratios, and its steps (by position).
    Ratios that share a reference block (a finalist re-measured between references: F R F R ...) are not
    independent: the block between two of them is subtracted from both, so its weight in the mean is the
    sum of its weights over the pairs, and its variance counts with that weight squared, not once per pair."""
    n = len(pairs)
    weights: dict[float, tuple[float, int | None]] = {}
    for p in pairs:
        for position, w, k in p.refs:
            weights[position] = (weights.get(position, (0.0, k))[0] + w / n, k)
    return weights


def interval_of_mean(mean: float, variance: float, df: float, confidence: float, n: int) -> Interval:
    """A mean log ratio of ``n`` pairs with the variance of that mean: its t-interval in ratio units."""
    from .noise import t_quantile

    half = t_quantile(confidence, df) * math.sqrt(max(0.0, variance))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)
