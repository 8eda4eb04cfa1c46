"""Drift-robust scores: a candidate's throughput as a ratio to interleaved blocks of the reference.

Everything is in natural-log units: a block's score is log(samples/s), a candidate's paired score is
its log score minus the reference's log score interpolated at the candidate's position between the
two reference blocks around it (or the last one before it while the next is not measured yet).  A
linear drift of the host cancels out of a bracketed ratio.

The noise of one block, drift between neighbouring blocks included, is estimated from the reference
blocks alone by the mean square successive difference (von Neumann): ``sigma^2 = mean(diff^2) / 2``,
which a slow drift barely inflates, unlike the plain variance.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

PRIOR_SIGMA = 0.03  # block noise assumed before two reference blocks exist (3 %)


@dataclass(frozen=True)
class Paired:
    log_ratio: float
    weight2: float  # sum of squared interpolation weights of the references: var = sigma^2 (1 + weight2)


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


def block_sigma(ref_logs: list[float]) -> tuple[float, int]:
    """(sigma of one block's log score, degrees of freedom) from successive reference blocks; the
    prior (with 1 degree of freedom) blended in while there are few."""
    diffs = [b - a for a, b in itertools.pairwise(ref_logs)]
    prior_weight = 2.0
    total = PRIOR_SIGMA ** 2 * prior_weight + sum(d * d / 2.0 for d in diffs)
    return math.sqrt(total / (prior_weight + len(diffs))), max(1, len(diffs))


def paired(position: float, log_score: float, refs: list[tuple[float, float]],
           bracket: bool = True) -> Paired | None:
    """``log_score`` at ``position`` against ``refs`` ((position, log score), in order): the two around
    it interpolated when ``bracket`` and both exist, else the nearest one before it (or after it)."""
    before = [r for r in refs if r[0] < position]
    after = [r for r in refs if r[0] > position]
    if bracket and before and after:
        (p0, y0), (p1, y1) = before[-1], after[0]
        w1 = (position - p0) / (p1 - p0)
        return Paired(log_score - ((1.0 - w1) * y0 + w1 * y1), (1.0 - w1) ** 2 + w1 ** 2)
    nearest = before[-1] if before else (after[0] if after else None)
    if nearest is None:
        return None
    return Paired(log_score - nearest[1], 1.0)


def interval(pairs: list[Paired], sigma: float, df: int, confidence: float) -> Interval | None:
    """Mean paired log ratio and its t-interval, back in ratio units; None without pairs."""
    if not pairs:
        return None
    from scipy.stats import t as student_t

    n = len(pairs)
    mean = sum(p.log_ratio for p in pairs) / n
    se = sigma * math.sqrt(sum(1.0 + p.weight2 for p in pairs)) / n
    half = float(student_t.ppf(0.5 + confidence / 2.0, df)) * se
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)
