"""Plans whose decisions are given rather than solved (baselines, tests, experts).

The decisions are still checked against the model's rules and re-simulated,
so a fixed plan carries the same predictions as a solved one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from ..planfile import BucketPlan, Plan
from ..tracefile import RecoveryUnit, Trace
from .memory import plan_risk, rule_violations, simulate
from .planner import _plan_units, _skip_bucket, prepare
from .risk import DEFAULT_NUM_BUCKETS, default_buckets


def fixed_plan(trace: Trace | str | os.PathLike,
               decide: Callable[[RecoveryUnit], str] | Mapping[str, Mapping[str, str]], *,
               buckets: int = DEFAULT_NUM_BUCKETS, codecs=None, batch: int | None = None,
               seq_len: int | None = None, label: str = "fixed") -> Plan:
    """A plan with given decisions in every bucket.

    ``decide``: a function unit -> option used for every bucket (e.g. int8
    everywhere it is usable), or ``{bucket name: {unit key: option}}``.
    Raises ValueError when a decision breaks the rules (recompute from a
    compressed unit, an unusable codec, a non-recomputable unit).
    """
    trace, model = prepare(trace, codecs=codecs, batch=batch, seq_len=seq_len)
    units = {u.key: u for u in trace.units}
    plans = []
    for spec in default_buckets(buckets):
        if callable(decide):
            decisions = {key: decide(unit) for key, unit in units.items()}
        else:
            decisions = dict(decide[spec.name])
        problems = rule_violations(model, decisions)
        if problems:
            raise ValueError(f"{label} plan breaks the rules: " + "; ".join(problems[:3]))
        prediction = simulate(model, decisions)
        plans.append(BucketPlan(
            bucket=spec, skip=False, decisions=tuple((u.key, decisions[u.key]) for u in model.units),
            memory_bytes=prediction.memory_bytes, kept_bytes=prediction.kept_bytes,
            transient_bytes=prediction.transient_bytes, time_s=prediction.time_s,
            risk=plan_risk(model, decisions, spec.exposure), proxy_sensitivity=False,
            solver=None, notes=(f"{label}: decisions given, not solved",),
        ))
    budget_bytes = max(p.memory_bytes for p in plans)
    return Plan(
        model=trace.model, fingerprint=trace.fingerprint, batch=model.batch, seq_len=model.seq_len,
        budget=f"{budget_bytes}", budget_bytes=budget_bytes, gc_bytes=model.gc_bytes,
        store_bytes=model.store_bytes, risk_budget=float("inf"),
        codecs=tuple(sorted({c for u in model.units for c in u.codecs})), cost_source=trace.cost_source,
        buckets=(_skip_bucket(), *plans), units=_plan_units(model), notes=(f"{label} plan",),
    )


def uniform_codec(codec: str) -> Callable[[RecoveryUnit], str]:
    """Exposure- and cost-blind compression: ``codec`` wherever usable, else store."""
    def decide(unit: RecoveryUnit) -> str:
        cost = unit.codecs.get(codec)
        return f"compress:{codec}" if cost is not None and cost.usable else "store"
    return decide
