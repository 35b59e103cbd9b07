"""The planner: traces in, per-bucket store / compress / recompute plans out.

Knows no torch (plans are made offline, on any machine). Modules in the order
a plan is made:

- ``budget``:  parse memory budgets (``6GiB``, ``1.10x-gc``, ``0.5x-store``).
- ``risk``:    sensitivity x exposure, default exposure buckets and risk budget.
- ``memory``:  the memory / time model at a shape; ``simulate`` re-checks plans.
- ``ilp``:     the ILP per bucket (PuLP + CBC) and the min-memory ILP.
- ``planner``: ``solve`` ties them together and verifies every answer.
- ``fixed``:   plans with given decisions (baselines), checked the same way.
- ``pareto``:  the memory-time curve over a range of budgets.
- ``synthetic``: roofline-costed decoder traces for tests and demos.
"""

from ..planfile import BucketSpec
from .budget import Budget, format_bytes, parse_budget
from .fixed import fixed_plan, uniform_codec
from .ilp import SolverOptions, SolverUnavailableError
from .memory import CostModel, Prediction, cost_model, simulate
from .pareto import ParetoCurve, ParetoPoint, pareto_curve
from .planner import DEFAULT_BUDGET, InfeasibleBudgetError, solve
from .risk import DEFAULT_NUM_BUCKETS, DEFAULT_RISK_BUDGET, PROXY_FACTOR, default_buckets

__all__ = [
    "Budget", "BucketSpec", "CostModel", "DEFAULT_BUDGET", "DEFAULT_NUM_BUCKETS",
    "DEFAULT_RISK_BUDGET", "InfeasibleBudgetError", "PROXY_FACTOR", "ParetoCurve", "ParetoPoint",
    "Prediction", "SolverOptions", "SolverUnavailableError", "cost_model", "default_buckets",
    "fixed_plan", "format_bytes", "pareto_curve", "parse_budget", "simulate", "solve", "uniform_codec",
]
