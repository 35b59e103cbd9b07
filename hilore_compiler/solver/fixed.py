"""Plans whose decisions are given rather than solved (baselines, controls, tests).

The one uniform-plan builder of the project: the bench's uniform-codec
baseline, the eval's exposure-blind control and store-all arms all come from
``fixed_plan``. The decisions are still checked against the model's rules and
re-simulated, so a fixed plan carries the same predictions (memory, time,
risk over the exposure mix) as a solved one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence

from ..planfile import BucketSpec, Plan
from ..tracefile import Trace
from ..vocabulary import STORE, compress
from .memory import UnitCost, rule_violations
from .mix import zero_share
from .assembly import bucket_plan, memory_records, mix_exposures, plan_units, planned_shares, skip_bucket
from .planner import prepare
from .risk import DEFAULT_NUM_BUCKETS, bucket_specs

#: ``decide``: a function of a unit (at the planned shape) -> option, used in
#: every bucket, or ``{bucket name: {unit key: option}}``.
Decide = Callable[[UnitCost], str] | Mapping[str, Mapping[str, str]]


def fixed_plan(trace: Trace | str | os.PathLike, decide: Decide, *,
               buckets: int | Sequence[BucketSpec | tuple] = DEFAULT_NUM_BUCKETS, codecs=None,
               batch: int | None = None, seq_len: int | None = None,
               exposure_mix: Sequence[float] | str | os.PathLike | None = None,
               gradient_exposures: Sequence[float] | None = None,
               label: str = "fixed", loss_ratio: float | None = None, accumulate_gradients: bool = False) -> Plan:
    """A plan with given decisions; raises ValueError when a decision breaks the
    rules (recompute from a compressed unit, an unusable codec, a non-recomputable unit).

    ``loss_ratio``: the loss's peak over the graph outputs' bytes, and
    ``accumulate_gradients``, as in ``solve``; the predicted peaks leave the
    loss out when it is 0.

    The budget recorded is the largest bucket memory; the risk budget is the
    plans' own summed risk (nothing was solved against one).
    """
    trace, model = prepare(trace, codecs=codecs, batch=batch, seq_len=seq_len, loss_ratio=loss_ratio,
                           accumulate_gradients=accumulate_gradients)
    exposures = mix_exposures(exposure_mix)
    shares = planned_shares(buckets, exposures, gradient_exposures)
    plans, given = [], {}
    for share in shares:
        if callable(decide):
            decisions = {u.key: decide(u) for u in model.units}
        else:
            decisions = dict(decide[share.spec.name])
        problems = rule_violations(model, decisions)
        if problems:
            raise ValueError(f"{label} plan breaks the rules: " + "; ".join(problems[:3]))
        given[share.spec.name] = decisions
        plans.append(bucket_plan(model, share, decisions, solver=None,
                                 notes=(f"{label}: decisions given, not solved",)))
    budget_bytes = max(p.memory_bytes for p in plans)
    return Plan(
        model=trace.model, fingerprint=trace.fingerprint, batch=model.batch, seq_len=model.seq_len,
        budget=f"{budget_bytes}", budget_bytes=budget_bytes, gc_bytes=model.gc_bytes,
        store_bytes=model.store_bytes, risk_budget=sum(p.risk for p in plans),
        codecs=tuple(sorted({c for u in model.units for c in u.codecs})), cost_source=trace.cost_source,
        buckets=(skip_bucket(zero_share(exposures)), *plans), units=plan_units(model),
        notes=(f"{label} plan",), **memory_records(trace, model, given),
    )


def uniform_codec(codec: str | None) -> Callable[[UnitCost], str]:
    """Exposure- and cost-blind: ``compress:<codec>`` wherever usable, else store
    (``codec=None``: store everything)."""
    def decide(unit: UnitCost) -> str:
        option = None if codec is None else compress(codec)
        return option if option in unit.options else STORE
    return decide


def exposure_blind_plan(trace: Trace | str | os.PathLike, budget: str | int | float, *,
                        risk_budget: float | str | None = None,
                        buckets: int | Sequence[BucketSpec | tuple] = DEFAULT_NUM_BUCKETS,
                        codecs=None, batch: int | None = None, seq_len: int | None = None,
                        exposure_mix: Sequence[float] | str | os.PathLike | None = None,
                        gradient_exposures: Sequence[float] | None = None, loss_ratio: float | None = None,
                        gc_peak_bytes: int | None = None, accumulate_gradients: bool = False) -> Plan:
    """The control for exposure conditioning: the same memory and error budget,
    solved as if one bucket held the whole update (error share 1, the only safe
    assumption without exposure), its decisions repeated in every bucket so
    that it runs wherever the bucketed plan does. ``loss_ratio``,
    ``gc_peak_bytes`` and ``accumulate_gradients`` as in ``solve``."""
    from .planner import solve

    one = solve(trace, budget, risk_budget=risk_budget, buckets=[("b0", 0.0, float("inf"), 1.0)],
                codecs=codecs, batch=batch, seq_len=seq_len, exposure_mix=exposure_mix, loss_ratio=loss_ratio,
                gc_peak_bytes=gc_peak_bytes, accumulate_gradients=accumulate_gradients)
    decisions = one.decisions("b0")
    names = [s.name for s in bucket_specs(buckets, mix_exposures(exposure_mix))]
    plan = fixed_plan(trace, {n: decisions for n in names}, buckets=buckets, codecs=codecs, batch=batch,
                      seq_len=seq_len, exposure_mix=exposure_mix, gradient_exposures=gradient_exposures,
                      label="exposure-blind", loss_ratio=loss_ratio, accumulate_gradients=accumulate_gradients)
    return dataclasses.replace(plan, budget=one.budget, budget_bytes=one.budget_bytes,
                               risk_budget=one.risk_budget)
