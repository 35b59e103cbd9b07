"""Paired speed ratios across rounds of alternation, with a 95% t-interval.

Every round measures each method back to back (rounds.measure_rounds), so a
slow phase of a shared machine slows the methods of one round together. The
ratio of two methods within one round cancels it: for round r,
``ratio_r = median tokens/s of A's round-r steps / that of B's``. Across
rounds the log ratios are treated as independent normal samples: the
estimate is their geometric mean ``exp(mean)`` and the 95% interval
``exp(mean +- t * sd / sqrt(n))`` with Student's t at n - 1 degrees of
freedom. One round gives an estimate without an interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from .measure import StepSample

#: Two-sided 95% quantiles of Student's t (t_{0.975, df}) for df = 1..30,
#: from the standard table (scipy.stats.t.ppf(0.975, df) to 3 decimals); above
#: 30 the normal quantile 1.960 is within 2% of t.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the table above, the normal quantile beyond it."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T_975[df - 1] if df <= len(T_975) else statistics.NormalDist().inv_cdf(0.975)


@dataclass(frozen=True, slots=True, kw_only=True)
class PairedRatio:
    """Geometric-mean ratio of paired rounds and its 95% interval (None with one round)."""

    ratio: float
    low: float | None
    high: float | None
    #: Rounds both methods measured.
    rounds: int

    def format(self) -> str:
        """``1.14x [1.09, 1.19]``, or ``1.14x`` without an interval."""
        if self.low is None:
            return f"{self.ratio:.2f}x"
        return f"{self.ratio:.2f}x [{self.low:.2f}, {self.high:.2f}]"


def geometric_interval(ratios: list[float]) -> PairedRatio | None:
    """Geometric mean of ``ratios`` with the 95% t-interval on their logs; None if empty."""
    if not ratios:
        return None
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) == 1:
        return PairedRatio(ratio=math.exp(mean), low=None, high=None, rounds=1)
    half = t_quantile_975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return PairedRatio(ratio=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half),
                       rounds=len(logs))


def round_speeds(samples: Iterable[StepSample], tokens: int) -> dict[int, float]:
    """Median tokens/s of each round's steps, by round (warm-up steps have none)."""
    by_round: dict[int, list[float]] = {}
    for s in samples:
        if s.round is not None:
            by_round.setdefault(s.round, []).append(tokens / s.seconds)
    return {r: statistics.median(v) for r, v in by_round.items()}


def paired_ratio(samples: Iterable[StepSample], reference: Iterable[StepSample],
                 tokens: int) -> PairedRatio | None:
    """Speed of ``samples`` over ``reference``, paired by round; None without a common round."""
    mine, theirs = round_speeds(samples, tokens), round_speeds(reference, tokens)
    return geometric_interval([mine[r] / theirs[r] for r in sorted(mine) if r in theirs])


def format_paired(paired: dict | None) -> str:
    """A paired ratio as JSON holds it (``asdict(PairedRatio)``): ``1.140 [1.090, 1.190]``,
    ``1.140`` with one round, ``-`` without."""
    if paired is None:
        return "-"
    if paired["low"] is None:
        return f"{paired['ratio']:.3f}"
    return f"{paired['ratio']:.3f} [{paired['low']:.3f}, {paired['high']:.3f}]"
