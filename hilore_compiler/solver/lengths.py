"""Plans over a range of sequence lengths: one plan from ``lo`` to ``hi``, or a few.

GRPO batches change length every step. Decisions are per unit key, not per
shape, so one plan can serve many lengths if it

- fits the memory ceiling at every length of the range. The ILP holds it
  under the ceiling at the longest length ``hi``; the plan is then
  re-simulated at each length of a grid over the range. An ``x-gc`` ceiling
  follows GC's peak, which at short lengths is mostly weight gradients, so a
  plan that fits at ``hi`` can overrun it at ``lo``: then ``hi``'s budget is
  tightened by the overrun and the plan solved again (``MAX_TIGHTENINGS``).
- is fast over the lengths a run meets (the length mix): each option's
  seconds are the mix-weighted mean of its seconds at the grid's lengths
  (seconds scale with a unit's bytes, ``memory.py``).

Where the range is wide, the fastest plan for short sequences may store what
the plan for long ones must recompute. ``solve_length_buckets`` then splits
the range at grid lengths into length buckets, each with a range plan of its
own, choosing the split by dynamic programming over contiguous ranges. A
length bucket costs a compiled variant per distinct exposure-bucket plan, so
a split is kept only where it saves more than ``LENGTH_BUCKET_PRICE`` of the
one-plan's mixed recovery time.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

from ..planfile import LengthPoint, Plan
from ..tracefile import Trace
from .budget import format_bytes, parse_budget
from .cbc import check_cbc
from .memory import CostModel, simulate
from .planner import (ceiling_headroom, InfeasibleBudgetError, check_gc_peak, plan_model, prepare,
                      Progress)
from .risk import parse_risk_budget

#: Lengths the range is checked and priced at: the ends and points between,
#: spaced evenly in log(length) since sizes and costs grow with the length.
GRID_POINTS = 5
#: How often a plan that overruns a shorter length's ceiling is solved again
#: with the budget at ``hi`` tightened by the overrun; each try shrinks it by
#: the largest overrun found, so more than a few means the ceiling cannot hold.
MAX_TIGHTENINGS = 4
#: How much further than the overrun each tightening goes (see ``solve_range``).
TIGHTENING_MARGIN = 0.005
#: The share of the one-plan's mixed recovery time a split into length
#: buckets must save per extra bucket: each costs a compile per distinct
#: plan, and the time model's error (seconds scaled by bytes) is about this size.
LENGTH_BUCKET_PRICE = 0.02


def length_grid(lo: int, hi: int, points: int = GRID_POINTS) -> tuple[int, ...]:
    """``points`` lengths from ``lo`` to ``hi`` spaced evenly in log(length), both ends included."""
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"a sequence-length range needs 1 <= lo <= hi, got {lo}:{hi}")
    if lo == hi or points < 2:
        return (hi,)
    ratio = (hi / lo) ** (1 / (points - 1))
    return tuple(sorted({lo, hi, *(round(lo * ratio**k) for k in range(1, points - 1))}))


def length_weights(grid: Sequence[int], length_mix: Sequence[int] | None) -> tuple[float, ...]:
    """Each grid length's share of the mix: sample lengths go to the nearest grid length.

    No mix: lengths uniform over ``[grid[0], grid[-1]]``, each grid length
    standing for the lengths nearer to it than to its neighbours.
    """
    if len(grid) == 1:
        return (1.0,)
    if length_mix:
        counts = [0] * len(grid)
        for length in length_mix:
            counts[min(range(len(grid)), key=lambda i: abs(grid[i] - length))] += 1
        return tuple(c / len(length_mix) for c in counts)
    edges = [grid[0], *((a + b) / 2 for a, b in zip(grid, grid[1:])), grid[-1]]
    span = grid[-1] - grid[0]
    return tuple((hi - lo) / span for lo, hi in zip(edges, edges[1:]))


def mixed_time_model(models: Sequence[CostModel], weights: Sequence[float]) -> CostModel:
    """The last (longest) model with each option's seconds replaced by their mix-weighted mean."""
    last = models[-1]

    def mean(get) -> float:
        return sum(w * get(m) for m, w in zip(models, weights))

    units = []
    for u in last.units:
        codecs = {name: dataclasses.replace(c, time_s=mean(lambda m: m.unit(u.key).codecs[name].time_s))
                  for name, c in u.codecs.items()}
        units.append(dataclasses.replace(u, recompute_time_s=mean(lambda m: m.unit(u.key).recompute_time_s),
                                         codecs=codecs))
    return dataclasses.replace(last, units=tuple(units))


def _ceilings(models: Sequence[CostModel], budget: Any, gc_peak_bytes: int | None) -> list[int]:
    """The ceiling at each model's length. A measured GC peak is the longest length's;
    shorter lengths scale it by GC's modelled peak there."""
    hi = models[-1]
    return [budget.bytes_at(gc_bytes=(gc_peak_bytes * m.gc_bytes // hi.gc_bytes if gc_peak_bytes else m.gc_bytes),
                            store_bytes=m.store_bytes) for m in models]


def solve_range(trace: Trace | str | os.PathLike, seq_range: tuple[int, int], budget: str | int | float = "1.10x-gc",
                *, risk_budget: float | str | None = None, buckets: Any = 3, codecs: Sequence[str] | str | None = None,
                batch: int | None = None, length_mix: Sequence[int] | None = None, exposure_mix: Any = None,
                gradient_exposures: Sequence[float] | None = None, loss_ratio: float | None = None,
                gc_peak_bytes: int | None = None, accumulate_gradients: bool = False, options: Any = None,
                progress: Progress | None = None, grid_points: int = GRID_POINTS) -> Plan:
    """One plan that holds at every sequence length in ``seq_range = (lo, hi)``.

    Arguments as in ``solve``; ``length_mix``: sample lengths of a typical run
    (default: uniform over the range), over which recovery time is minimised.
    ``gc_peak_bytes`` is GC's measured peak at ``hi``. The plan's sizes and
    predictions are at ``hi``; ``plan.lengths`` has them at each grid length.
    """
    from .risk import DEFAULT_RISK_BUDGET

    check_cbc()
    check_gc_peak(gc_peak_bytes)
    lo, hi = seq_range
    grid = length_grid(lo, hi, grid_points)
    weights = length_weights(grid, length_mix)
    error2 = parse_risk_budget(DEFAULT_RISK_BUDGET if risk_budget is None else risk_budget)
    models = []
    for length in grid:
        trace, model = prepare(trace, codecs=codecs, batch=batch, seq_len=length, loss_ratio=loss_ratio,
                               accumulate_gradients=accumulate_gradients)
        models.append(model)
    parsed = parse_budget(budget)
    ceilings = _ceilings(models, parsed, gc_peak_bytes)
    headroom = ceiling_headroom(parsed, gc_peak_bytes)
    mixed = mixed_time_model(models, weights)
    solve_kwargs = dict(budget=parsed, risk_budget=error2, buckets=buckets, exposure_mix=exposure_mix,
                        gradient_exposures=gradient_exposures, loss_ratio=loss_ratio, gc_peak_bytes=gc_peak_bytes,
                        accumulate_gradients=accumulate_gradients, options=options, progress=progress)
    at_hi = ceilings[-1]
    for _ in range(MAX_TIGHTENINGS + 1):
        plan = plan_model(trace, mixed, budget_bytes=at_hi, **solve_kwargs)
        points = _length_points(plan, models, weights, ceilings)
        over = [(p.seq_len, max(p.memory_bytes.values()), math.floor(p.budget_bytes * (1 - headroom)))
                for p in points]
        worst = min(ceiling / memory for _, memory, ceiling in over)
        if worst >= 1 - 1e-9:
            break
        # Past the overrun by a margin: a plan tightened by exactly the
        # overrun can recompute a different unit and overrun by a hair again.
        at_hi = math.floor(at_hi * (worst - TIGHTENING_MARGIN))
    else:
        length, memory, ceiling = min(over, key=lambda o: o[2] / o[1])
        raise InfeasibleBudgetError(
            f"memory budget {parsed.text} cannot hold over sequence lengths {lo}:{hi}: a plan that fits at "
            f"{hi} needs {format_bytes(memory)} at {length}, over its ceiling {format_bytes(ceiling)}; "
            f"plan a narrower range (length buckets) or raise the budget",
            bucket="all", budget_bytes=ceiling, min_budget_bytes=memory)
    note = (f"range plan: holds for sequence lengths {lo} to {hi} (checked at {list(grid)}); recovery "
            f"seconds minimised over the length mix {[round(w, 3) for w in weights]}")
    return dataclasses.replace(plan, budget_bytes=ceilings[-1], seq_range=(lo, hi) if lo < hi else None,
                               lengths=points if lo < hi else (), notes=(*plan.notes, note))


def _length_points(plan: Plan, models: Sequence[CostModel], weights: Sequence[float],
                   ceilings: Sequence[int]) -> tuple[LengthPoint, ...]:
    """The plan's buckets re-simulated at each grid length."""
    solved = [b for b in plan.buckets if not b.skip]
    points = []
    for model, weight, ceiling in zip(models, weights, ceilings):
        predictions = {b.bucket.name: simulate(model, dict(b.decisions)) for b in solved}
        points.append(LengthPoint(seq_len=model.seq_len, weight=weight, budget_bytes=ceiling,
                                  gc_bytes=model.gc_bytes, store_bytes=model.store_bytes,
                                  memory_bytes={k: p.memory_bytes for k, p in predictions.items()},
                                  time_s={k: p.time_s for k, p in predictions.items()}))
    return tuple(points)


def mixed_time_s(plan: Plan) -> float:
    """A range plan's recovery seconds over its length and exposure mixes (weights as planned)."""
    solved = {b.bucket.name: b.sample_share or 0.0 for b in plan.buckets if not b.skip}
    total = sum(solved.values()) or 1.0
    if not plan.lengths:
        return sum(share * plan.bucket(k).time_s for k, share in solved.items()) / total
    return sum(p.weight * sum(share * p.time_s[k] for k, share in solved.items()) / total for p in plan.lengths)


def solve_length_buckets(trace: Trace | str | os.PathLike, seq_range: tuple[int, int],
                         budget: str | int | float = "1.10x-gc", *, max_buckets: int = 3,
                         length_mix: Sequence[int] | None = None, progress: Progress | None = None,
                         **kwargs: Any) -> tuple[Plan, ...]:
    """Range plans over contiguous length buckets that together cover ``seq_range``, shortest first.

    Splits at grid lengths (``length_grid``) into at most ``max_buckets``
    parts, minimising the summed mixed recovery time plus
    ``LENGTH_BUCKET_PRICE`` x the one-plan's time per extra bucket; one plan
    when no split pays. Splits are priced on the exposure-blind problem (one
    exposure bucket: a third of the ILP, and the same trade between lengths),
    then the chosen length buckets are solved in full. ``kwargs`` as in ``solve_range``.
    """
    say = progress or (lambda _msg: None)
    lo, hi = seq_range
    grid = length_grid(lo, hi)
    if max_buckets <= 1 or len(grid) < 3:
        return (solve_range(trace, seq_range, budget, length_mix=length_mix, progress=progress, **kwargs),)
    if isinstance(trace, (str, os.PathLike)):
        from .limits import PlanningLimits, load_bounded

        trace = load_bounded(trace, PlanningLimits())
    weights = length_weights(grid, length_mix)
    pricing = {**kwargs, "buckets": [("b0", 0.0, math.inf, 1.0)]}
    priced: dict[tuple[int, int], Plan | None] = {}

    def sub_range(i: int, j: int) -> tuple[tuple[int, int], Sequence[int] | None]:
        start = lo if i == 0 else grid[i - 1] + 1
        return (start, grid[j]), [n for n in length_mix if start <= n <= grid[j]] if length_mix else None

    def cost(i: int, j: int) -> float:
        """Weighted mixed recovery time of the blind plan for grid lengths i..j (from just above grid[i-1])."""
        if (i, j) not in priced:
            lengths, mix = sub_range(i, j)
            try:
                priced[i, j] = solve_range(trace, lengths, budget, length_mix=mix, grid_points=j - i + 2, **pricing)
            except InfeasibleBudgetError:
                priced[i, j] = None
        plan = priced[i, j]
        return math.inf if plan is None else sum(weights[i:j + 1]) * mixed_time_s(plan)

    one = cost(0, len(grid) - 1)
    # best[j][k]: least cost of covering grid lengths 0..j with k buckets, and the split.
    best: list[dict[int, tuple[float, list[tuple[int, int]]]]] = [dict() for _ in grid]
    for j in range(len(grid)):
        best[j][1] = (cost(0, j), [(0, j)])
        for k in range(2, max_buckets + 1):
            options = [(best[i - 1][k - 1][0] + cost(i, j), best[i - 1][k - 1][1] + [(i, j)])
                       for i in range(1, j + 1) if k - 1 in best[i - 1]]
            if options:
                best[j][k] = min(options, key=lambda o: o[0])
    price = LENGTH_BUCKET_PRICE * one
    total, split = min(((c + price * (k - 1), s) for k, (c, s) in best[-1].items()), key=lambda o: o[0])
    say(f"length buckets over {lo}:{hi}: {[sub_range(i, j)[0] for i, j in split]} (blind mixed recovery "
        f"{total * 1e3:.2f} ms with {LENGTH_BUCKET_PRICE:.0%} of one plan's {one * 1e3:.2f} ms per extra bucket)")
    return tuple(solve_range(trace, lengths, budget, length_mix=mix, progress=progress,
                             grid_points=GRID_POINTS if len(split) == 1 else j - i + 2, **kwargs)
                 for (i, j), (lengths, mix) in ((ij, sub_range(*ij)) for ij in split))


def plan_for_length(plans: Sequence[Plan], seq_len: int) -> Plan | None:
    """The plan of the length bucket holding ``seq_len``, or None when none does."""
    return next((p for p in plans if p.covers(seq_len)), None)
