"""The memory-time Pareto curve of a trace: the fastest plan at a range of budgets."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..tracefile import Trace
from ..vocabulary import COMPRESS_PREFIX, RECOMPUTE, STORE
from .cbc import SolverOptions, check_cbc
from .ilp import BucketWeight
from .solving import solve_min_time
from .planner import least_memory, prepare, verify, verify_risk
from .risk import DEFAULT_RISK_BUDGET, parse_risk_budget

#: The curve is for one bucket holding a whole batch (all samples, all the
#: coefficient mass): the strictest case of the error budget, which every
#: bucketed plan can at least reach.
WHOLE_BATCH = "all"

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
    #: Share of the update's coefficient mass the curve's one bucket holds (1).
    exposure: float
    #: The budget on the update's squared relative gradient error.
    risk_budget: float
    gc_bytes: int
    store_bytes: int


def pareto_curve(trace: Trace | str | os.PathLike, *, points: int = DEFAULT_POINTS,
                 risk_budget: float | str | None = DEFAULT_RISK_BUDGET,
                 codecs: Sequence[str] | str | None = None, batch: int | None = None,
                 seq_len: int | None = None, options: SolverOptions | None = None) -> ParetoCurve:
    """Solve at ``points`` budgets evenly spaced from the least feasible to store-all,
    for one bucket holding the whole batch (see WHOLE_BATCH)."""
    if points < 2:
        raise ValueError(f"a curve needs at least 2 points, got {points}")
    check_cbc()
    options = options or SolverOptions()
    error2 = parse_risk_budget(risk_budget)
    _, model = prepare(trace, codecs=codecs, batch=batch, seq_len=seq_len)
    weights = [BucketWeight(name=WHOLE_BATCH, samples=1.0, error=1.0)]
    least = least_memory(model, weights=weights, risk_budget=error2, options=options)
    lo = least.memory_bytes
    hi = max(lo, model.store_bytes)  # storing everything: no recovery transient
    budgets = sorted({lo + (hi - lo) * i // (points - 1) for i in range(points)})
    curve, start = [], least.decisions
    for budget in budgets:  # ascending: each plan is a feasible start for the next budget
        result = solve_min_time(model, budget_bytes=budget, weights=weights, risk_budget=error2,
                                options=options, start=start)
        if result is None:  # cannot happen above the least feasible budget
            raise RuntimeError(f"budget {budget} infeasible above the least feasible {lo}")
        start = {WHOLE_BATCH: dict(result.decisions[WHOLE_BATCH])}
        prediction = verify(model, start[WHOLE_BATCH], budget_bytes=budget)
        verify_risk(model, start, weights, error2)
        chosen = list(start[WHOLE_BATCH].values())
        curve.append(ParetoPoint(
            budget_bytes=budget, memory_bytes=prediction.memory_bytes, time_s=prediction.time_s,
            stored=chosen.count(STORE), recomputed=chosen.count(RECOMPUTE),
            compressed=sum(o.startswith(COMPRESS_PREFIX) for o in chosen), status=result.status,
        ))
    return ParetoCurve(points=tuple(curve), exposure=1.0, risk_budget=error2,
                       gc_bytes=model.gc_bytes, store_bytes=model.store_bytes)
