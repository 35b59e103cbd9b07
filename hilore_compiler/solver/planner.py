"""solve(): a trace and a memory budget in, a checked per-bucket plan out.

One ILP per exposure bucket (``ilp.py``), solved from the highest exposure
down: that bucket has the tightest risk budget, so if any bucket is
infeasible it is the first one, and the smallest budget reported for it makes
every bucket feasible. The solver's answer is not trusted: each plan is
re-simulated with the same model (``memory.simulate``) and checked.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..planfile import COMPRESS_PREFIX, STORE, BucketPlan, BucketSpec, OptionCost, Plan, PlanUnit, SolverStats
from ..tracefile import Trace, load_trace
from .budget import format_bytes, format_seconds, parse_budget
from .ilp import SolverOptions, check_cbc, solve_min_memory, solve_min_time
from .memory import CostModel, Prediction, cost_model, plan_risk, rule_violations, simulate
from .risk import DEFAULT_NUM_BUCKETS, DEFAULT_RISK_BUDGET, PROXY_FACTOR, bucket_specs, zero_bucket

DEFAULT_BUDGET = "1.10x-gc"
#: Re-simulated memory (risk) may exceed the budget (risk budget) by this
#: fraction before the plan is rejected: CBC accepts binaries within 1e-6 of 0
#: or 1, which can shift a sum by about that fraction. Real disagreements
#: between the ILP and the model are far larger.
TOLERANCE = 1e-6

Progress = Callable[[str], None]


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget; the message names the smallest that does."""

    def __init__(self, message: str, *, bucket: str, budget_bytes: int, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes


def allowed_codecs(trace: Trace, codecs: Sequence[str] | str | None) -> tuple[str, ...]:
    """The codecs the planner may use: all the trace measured, or those named."""
    known = sorted({name for u in trace.units for name in u.codecs})
    if codecs is None:
        return tuple(known)
    if isinstance(codecs, str):
        codecs = [c.strip() for c in codecs.split(",") if c.strip()]
    unknown = [c for c in codecs if c not in known]
    if unknown:
        raise ValueError(f"unknown codec(s) {unknown}: the trace of {trace.model} measured {known}")
    return tuple(dict.fromkeys(codecs))


def prepare(trace: Trace | str | os.PathLike, *, codecs: Sequence[str] | str | None,
            batch: int | None, seq_len: int | None) -> tuple[Trace, CostModel]:
    """Load the trace if given a path and evaluate its costs at the planned shape."""
    if isinstance(trace, (str, os.PathLike)):
        trace = load_trace(trace)
    if not isinstance(trace, Trace):
        raise TypeError(f"solve() needs a Trace or a trace file path, got {type(trace).__name__}")
    batch = trace.batch if batch is None else batch
    seq_len = trace.seq_len if seq_len is None else seq_len
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    model = cost_model(trace, batch=batch, seq_len=seq_len, codecs=allowed_codecs(trace, codecs))
    return trace, model


def verify(model: CostModel, decisions: dict[str, str], *, budget_bytes: int | None,
           exposure: float, risk_budget: float) -> tuple[Prediction, float]:
    """Re-simulate the solver's plan; raise if it breaks a rule, the budget or the risk."""
    problems = rule_violations(model, decisions)
    if problems:
        raise RuntimeError("solver plan breaks the model's rules, the ILP and the memory model "
                           "disagree: " + "; ".join(problems[:3]))
    prediction = simulate(model, decisions)
    if budget_bytes is not None and prediction.memory_bytes > budget_bytes * (1 + TOLERANCE):
        raise RuntimeError(
            f"solver plan needs {prediction.memory_bytes} bytes, over the budget {budget_bytes}: "
            "the ILP and the memory model disagree"
        )
    risk = plan_risk(model, decisions, exposure)
    if risk > risk_budget * (1 + TOLERANCE) + 1e-12:
        raise RuntimeError(f"solver plan has risk {risk:.4g}, over the risk budget {risk_budget:.4g}")
    return prediction, risk


def _proxy_note(model: CostModel) -> tuple[bool, tuple[str, ...]]:
    pairs = [c.proxy for u in model.units for c in u.codecs.values()]
    if not any(pairs):
        return False, ()
    return True, (f"sensitivity of {sum(pairs)} of {len(pairs)} (unit, codec) pairs is the proxy "
                  f"rel_l2 x {PROXY_FACTOR}; calibrate the trace to measure it",)


def _infeasible(model: CostModel, spec: BucketSpec, *, budget_text: str, budget_bytes: int,
                risk_budget: float, need: int) -> InfeasibleBudgetError:
    """The error for an infeasible bucket, naming ``need``, the smallest feasible budget."""
    # Round the ratio up, so that passing it back as a budget is feasible.
    ratio = f", {math.ceil(need / model.gc_bytes * 1000) / 1000:.3f}x-gc" if model.gc_bytes > 0 else ""
    return InfeasibleBudgetError(
        f"memory budget {budget_text} ({format_bytes(budget_bytes)}) is infeasible for bucket "
        f"{spec.name} (exposure {spec.exposure:g}, risk budget {risk_budget:g}) at batch "
        f"{model.batch}, seq_len {model.seq_len}: the smallest feasible budget is "
        f"{format_bytes(need)} ({need} bytes{ratio})",
        bucket=spec.name, budget_bytes=budget_bytes, min_budget_bytes=need,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LeastMemory:
    """The least-memory plan under the rules and a bucket's risk budget."""

    decisions: dict[str, str]
    memory_bytes: int
    #: False when CBC stopped before proving it least (then memory_bytes is an upper bound).
    proven: bool
    seconds: float


def least_memory(model: CostModel, *, exposure: float, risk_budget: float,
                 options: SolverOptions) -> LeastMemory:
    """Solve the min-memory ILP and re-simulate its plan."""
    least = solve_min_memory(model, exposure=exposure, risk_budget=risk_budget, options=options)
    decisions = dict(least.decisions)
    need = verify(model, decisions, budget_bytes=None, exposure=exposure,
                  risk_budget=risk_budget)[0].memory_bytes
    return LeastMemory(decisions=decisions, memory_bytes=need, proven=least.status == "optimal",
                       seconds=least.seconds)


def plan_bucket(model: CostModel, spec: BucketSpec, *, budget_text: str, budget_bytes: int,
                risk_budget: float, options: SolverOptions,
                start: dict[str, str] | None = None) -> BucketPlan:
    """Solve, check and record one bucket's plan; InfeasibleBudgetError if none fits.

    The least-memory plan is found first (a fraction of a second): it decides
    feasibility and is the fallback start for the time ILP, with ``start``
    (a plan of a higher-exposure bucket, feasible here too) preferred.
    """
    least = least_memory(model, exposure=spec.exposure, risk_budget=risk_budget, options=options)
    fits = least.memory_bytes <= budget_bytes
    infeasible = dict(model=model, spec=spec, budget_text=budget_text, budget_bytes=budget_bytes,
                      risk_budget=risk_budget, need=least.memory_bytes)
    if not fits and least.proven:
        raise _infeasible(**infeasible)
    result = solve_min_time(model, budget_bytes=budget_bytes, exposure=spec.exposure,
                            risk_budget=risk_budget, options=options,
                            start=start if start is not None else least.decisions if fits else None)
    if result is None:
        raise _infeasible(**infeasible)
    decisions = dict(result.decisions)
    prediction, risk = verify(model, decisions, budget_bytes=budget_bytes,
                              exposure=spec.exposure, risk_budget=risk_budget)
    proxy, notes = _proxy_note(model)
    return BucketPlan(
        bucket=spec, skip=False, decisions=tuple((u.key, decisions[u.key]) for u in model.units),
        memory_bytes=prediction.memory_bytes, kept_bytes=prediction.kept_bytes,
        transient_bytes=prediction.transient_bytes, time_s=prediction.time_s, risk=risk,
        proxy_sensitivity=proxy, notes=notes,
        # Seconds of both ILPs: what planning this bucket cost.
        solver=SolverStats(status=result.status, seconds=least.seconds + result.seconds,
                           objective=result.objective, gap=result.gap),
    )


def _skip_bucket() -> BucketPlan:
    return BucketPlan(bucket=zero_bucket(), skip=True, decisions=(), memory_bytes=0, kept_bytes=0,
                      transient_bytes=0, time_s=0.0, risk=0.0, proxy_sensitivity=False, solver=None,
                      notes=("exposure 0: the sample reaches no parameter, backward is skipped",))


def _plan_units(model: CostModel) -> tuple[PlanUnit, ...]:
    return tuple(
        PlanUnit(key=u.key, layer=u.layer, kind=u.kind, bytes=u.bytes, options=tuple(
            OptionCost(option=o, bytes=u.kept_bytes(o), time_s=u.time_s(o)) for o in u.options))
        for u in model.units
    )


def _summary(b: BucketPlan) -> str:
    counts: dict[str, int] = {}
    for _, option in b.decisions:
        kind = "compress" if option.startswith(COMPRESS_PREFIX) else option
        counts[kind] = counts.get(kind, 0) + 1
    mix = ", ".join(f"{counts.get(k, 0)} {k}" for k in (STORE, "compress", "recompute"))
    return (f"bucket {b.bucket.name}: {b.solver.status} in {b.solver.seconds:.2f} s, "
            f"memory {format_bytes(b.memory_bytes)}, recovery {format_seconds(b.time_s)}, "
            f"risk {b.risk:.3g} ({mix})")


def solve(trace: Trace | str | os.PathLike, budget: str | int | float = DEFAULT_BUDGET,
          risk_budget: float = DEFAULT_RISK_BUDGET,
          buckets: int | Sequence[BucketSpec | tuple] = DEFAULT_NUM_BUCKETS,
          codecs: Sequence[str] | str | None = None, batch: int | None = None,
          seq_len: int | None = None, *, options: SolverOptions | None = None,
          progress: Progress | None = None) -> Plan:
    """Plan store / compress / recompute per recovery unit for every exposure bucket.

    ``budget``: ``"6GiB"``, ``"750MB"``, ``123456`` (bytes), ``"1.10x-gc"`` or
    ``"0.5x-store"``; it bounds activation bytes only (see ``budget.py``).
    ``buckets``: a count (default exposure levels, ``risk.default_buckets``) or
    explicit ``BucketSpec(name, lo, hi, exposure)`` / 4-tuples. The ``zero``
    bucket (plan ``skip``) is always added. ``codecs``: names the trace measured
    (default: all). ``batch`` / ``seq_len``: plan for another shape than traced.
    """
    check_cbc()
    options = options or SolverOptions()
    say = progress or (lambda _msg: None)
    if not (isinstance(risk_budget, (int, float)) and math.isfinite(risk_budget) and risk_budget >= 0):
        raise ValueError(f"risk budget must be a finite number >= 0, got {risk_budget!r}")
    trace, model = prepare(trace, codecs=codecs, batch=batch, seq_len=seq_len)
    parsed = parse_budget(budget)
    budget_bytes = parsed.bytes_at(gc_bytes=model.gc_bytes, store_bytes=model.store_bytes)
    specs = bucket_specs(buckets)
    say(f"planning {trace.model}: {len(model.units)} units at batch {model.batch}, seq_len "
        f"{model.seq_len}, budget {parsed.text} = {format_bytes(budget_bytes)}")
    solved: dict[str, BucketPlan] = {}
    start = None  # a higher-exposure bucket's plan satisfies a lower one's risk budget too
    for spec in sorted(specs, key=lambda s: s.exposure, reverse=True):
        solved[spec.name] = plan_bucket(model, spec, budget_text=parsed.text, budget_bytes=budget_bytes,
                                        risk_budget=float(risk_budget), options=options, start=start)
        start = dict(solved[spec.name].decisions)
        say(_summary(solved[spec.name]))
    notes = [*trace.notes]
    if (model.batch, model.seq_len) != (trace.batch, trace.seq_len):
        notes.append(f"planned for batch {model.batch}, seq_len {model.seq_len}; traced at batch "
                     f"{trace.batch}, seq_len {trace.seq_len}: sizes re-evaluated, seconds scaled by bytes")
    return Plan(
        model=trace.model, fingerprint=trace.fingerprint, batch=model.batch, seq_len=model.seq_len,
        budget=parsed.text, budget_bytes=budget_bytes, gc_bytes=model.gc_bytes,
        store_bytes=model.store_bytes, risk_budget=float(risk_budget),
        codecs=tuple(sorted({c for u in model.units for c in u.codecs})), cost_source=trace.cost_source,
        buckets=(_skip_bucket(), *(solved[s.name] for s in sorted(specs, key=lambda s: s.lo))),
        units=_plan_units(model), notes=tuple(notes),
    )
