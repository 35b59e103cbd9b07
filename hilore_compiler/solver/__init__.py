"""The planner: traces in, per-bucket store / compress / recompute plans out.

Knows no torch (plans are made offline, on any machine). Modules in the order
a plan is made:

- ``budget``:  parse memory budgets (``6GiB``, ``1.10x-gc``, ``0.5x-store``).
- ``risk``:    predicted error of the whole update: sensitivities, how they
               combine, the cosine target, default buckets.
- ``mix``:     the exposure mix (samples and coefficient mass per bucket).
- ``memory``:  the memory / time model at a shape; ``simulate`` re-checks plans.
- ``tying``:   which units the ILP decides together: block classes, a few patterns each.
- ``ilp``:     one ILP over all buckets (PuLP) and the min-memory ILP.
- ``solving``: how they are solved: bucket by bucket where exact, MIP starts.
- ``cbc``:     the CBC solver: found, run under a time limit, its bound read.
- ``planner``: ``solve`` ties them together and verifies every answer.
- ``assembly``: decisions into a plan's records (bucket shares, each bucket's
               re-simulated predictions, the unit table), for solved and fixed plans alike.
- ``timeline``: the predicted memory phase by phase, as plans record it (``show --plot``).
- ``devicefit``: a plan's peak plus the training state against its card's memory.
- ``lengths``: plans that hold over a range of sequence lengths, and length buckets.
- ``fixed``:   plans with given decisions (baselines, controls), checked the
               same way; the one uniform-plan builder.
- ``pareto``:  the memory-time curve over a range of budgets.
- ``synthetic``: roofline-costed decoder traces for tests and demos.
"""

from ..planfile import BucketSpec
from .assembly import predicted_error
from .budget import Budget, format_bytes, parse_budget
from .cbc import SolverOptions, SolverUnavailableError
from .fixed import fixed_plan, uniform_codec
from .memory import CostModel, Prediction, cost_model, simulate
from .pareto import ParetoCurve, ParetoPoint, pareto_curve
from .mix import bucket_shares, default_exposure_mix, load_exposure_mix, save_exposure_mix
from .planner import DEFAULT_BUDGET, InfeasibleBudgetError, infeasible_cause, solve
from .risk import (
    DEFAULT_NUM_BUCKETS,
    DEFAULT_RISK_BUDGET,
    DEFAULT_TARGET_COSINE,
    PROXY_FACTOR,
    cosine_to_error2,
    default_buckets,
    error2_to_cosine,
    format_error,
    parse_risk_budget,
)

__all__ = [
    "Budget", "BucketSpec", "CostModel", "DEFAULT_BUDGET", "DEFAULT_NUM_BUCKETS",
    "DEFAULT_RISK_BUDGET", "DEFAULT_TARGET_COSINE", "InfeasibleBudgetError", "PROXY_FACTOR", "infeasible_cause",
    "ParetoCurve", "ParetoPoint", "Prediction", "SolverOptions", "SolverUnavailableError",
    "bucket_shares", "cosine_to_error2", "cost_model", "default_buckets", "default_exposure_mix",
    "error2_to_cosine", "fixed_plan", "format_bytes", "format_error", "load_exposure_mix", "pareto_curve",
    "parse_budget", "parse_risk_budget", "predicted_error", "save_exposure_mix", "simulate", "solve",
    "uniform_codec",
]
