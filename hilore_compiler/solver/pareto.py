"""The memory-time Pareto curve of a trace: the fastest plan at a range of budgets."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..planfile import COMPRESS_PREFIX, RECOMPUTE, STORE
from ..tracefile import Trace
from .ilp import SolverOptions, check_cbc, solve_min_time
from .planner import least_memory, prepare, verify
from .risk import DEFAULT_RISK_BUDGET, EXPOSURE_HIGH

#: Budgets on the curve by default: enough to see its knee, few enough to
#: solve a 32-layer trace in seconds.
DEFAULT_POINTS = 12


@dataclass(frozen=True, slots=True, kw_only=True)
class ParetoPoint:
    """The fastest plan within one budget."""

    budget_bytes: int
    memory_bytes: int
    time_s: float
    stored: int
    compressed: int
    recomputed: int
    status: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ParetoCurve:
    """Points from the smallest feasible budget up to store-all, and the references."""

    points: tuple[ParetoPoint, ...]
    exposure: float
    risk_budget: float
    gc_bytes: int
    store_bytes: int


def pareto_curve(trace: Trace | str | os.PathLike, *, points: int = DEFAULT_POINTS,
                 exposure: float = EXPOSURE_HIGH, risk_budget: float = DEFAULT_RISK_BUDGET,
                 codecs: Sequence[str] | str | None = None, batch: int | None = None,
                 seq_len: int | None = None, options: SolverOptions | None = None) -> ParetoCurve:
    """Solve at ``points`` budgets evenly spaced from the least feasible to store-all.

    ``exposure`` defaults to the highest default bucket's, where the risk budget
    binds hardest, so the curve is the one every bucket can at least reach.
    """
    if points < 2:
        raise ValueError(f"a curve needs at least 2 points, got {points}")
    check_cbc()
    options = options or SolverOptions()
    _, model = prepare(trace, codecs=codecs, batch=batch, seq_len=seq_len)
    least = least_memory(model, exposure=exposure, risk_budget=risk_budget, options=options)
    lo = least.memory_bytes
    hi = max(lo, sum(u.bytes for u in model.units))  # storing everything: no transient
    budgets = sorted({lo + (hi - lo) * i // (points - 1) for i in range(points)})
    curve, start = [], least.decisions
    for budget in budgets:  # ascending: each plan is a feasible start for the next budget
        result = solve_min_time(model, budget_bytes=budget, exposure=exposure,
                                risk_budget=risk_budget, options=options, start=start)
        if result is None:  # cannot happen above the least feasible budget
            raise RuntimeError(f"budget {budget} infeasible above the least feasible {lo}")
        start = dict(result.decisions)
        prediction, _ = verify(model, start, budget_bytes=budget, exposure=exposure,
                               risk_budget=risk_budget)
        chosen = list(start.values())
        curve.append(ParetoPoint(
            budget_bytes=budget, memory_bytes=prediction.memory_bytes, time_s=prediction.time_s,
            stored=chosen.count(STORE), recomputed=chosen.count(RECOMPUTE),
            compressed=sum(o.startswith(COMPRESS_PREFIX) for o in chosen), status=result.status,
        ))
    return ParetoCurve(points=tuple(curve), exposure=exposure, risk_budget=risk_budget,
                       gc_bytes=model.gc_bytes, store_bytes=model.store_bytes)
