"""How decisions become a plan's records, the same for solved and fixed plans.

The buckets a plan is made for (their shares of the exposure mix), each
bucket's record with its decisions re-simulated (``memory.simulate``), the
zero bucket's, and the table of unit costs a plan file repeats. ``planner``
fills them with the ILP's decisions, ``fixed`` with given ones, so both
carry the same predictions.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..planfile import PEAK_PARTS, BucketPlan, BucketSpec, OptionCost, Plan, PlanUnit, SolverStats
from ..tracefile import Trace
from ..vocabulary import COMPRESS_PREFIX, RECOMPUTE, STORE
from .budget import format_bytes, format_seconds
from .memory import CostModel, simulate
from .mix import bucket_shares, default_exposure_mix, load_exposure_mix
from .timeline import memory_timeline
from .risk import PROXY_FACTOR, PROXY_LAYERS, BucketShare, bucket_specs, format_error, plan_risk, zero_bucket


def mix_exposures(exposure_mix: Sequence[float] | str | os.PathLike | None) -> tuple[float, ...]:
    """The exposure mix to plan for: given, read from a file, or GRPO's default."""
    if exposure_mix is None:
        return default_exposure_mix()
    if isinstance(exposure_mix, (str, os.PathLike)):
        return load_exposure_mix(exposure_mix)
    return tuple(float(x) for x in exposure_mix)


def planned_shares(buckets: int | Sequence[BucketSpec | tuple], exposures: Sequence[float],
                   gradient_exposures: Sequence[float] | None = None) -> list[BucketShare]:
    """Each bucket's share of the mix (``mix.bucket_shares``), lowest range first."""
    return sorted(bucket_shares(bucket_specs(buckets, exposures), exposures, gradient_exposures),
                  key=lambda s: s.spec.lo)


def _proxy_note(model: CostModel) -> tuple[bool, tuple[str, ...]]:
    """Whether any sensitivity is the proxy rather than measured, and the note that says so."""
    pairs = [c.proxy for u in model.units for c in u.codecs.values()]
    if not any(pairs):
        return False, ()
    return True, (f"sensitivity of {sum(pairs)} of {len(pairs)} (unit, codec) pairs is the proxy "
                  f"gain(kind) x rel_l2 x sqrt({PROXY_LAYERS} / layers), gains measured on the small "
                  f"policy, {PROXY_FACTOR} for other kinds (risk.py); calibrate the trace to measure it",)


def bucket_plan(model: CostModel, share: BucketShare, decisions: Mapping[str, str], *,
                solver: SolverStats | None, notes: tuple[str, ...] = ()) -> BucketPlan:
    """One bucket's record: decisions in trace order and their re-simulated predictions."""
    prediction = simulate(model, decisions)
    proxy, proxy_notes = _proxy_note(model)
    return BucketPlan(
        bucket=share.spec, skip=False, decisions=tuple((u.key, decisions[u.key]) for u in model.units),
        memory_bytes=prediction.memory_bytes, kept_bytes=prediction.kept_bytes,
        transient_bytes=prediction.transient_bytes, time_s=prediction.time_s,
        risk=plan_risk(model, decisions, share.error), proxy_sensitivity=proxy,
        notes=(*notes, *proxy_notes), solver=solver, sample_share=share.samples, mass_share=share.mass,
        error_share=share.error, peak_at=prediction.peak.at,
        peak_parts={name: getattr(prediction.peak, name) for name in PEAK_PARTS},
    )


def skip_bucket(samples: float | None = None) -> BucketPlan:
    """The zero bucket's record: no backward, no decisions."""
    return BucketPlan(bucket=zero_bucket(), skip=True, decisions=(), memory_bytes=0, kept_bytes=0,
                      transient_bytes=0, time_s=0.0, risk=0.0, proxy_sensitivity=False, solver=None,
                      notes=("exposure 0: the sample reaches no parameter, backward is skipped",),
                      sample_share=samples, mass_share=None if samples is None else 0.0,
                      error_share=None if samples is None else 0.0)


def plan_units(model: CostModel) -> tuple[PlanUnit, ...]:
    """Each unit's size and option costs at the planned shape, as the plan file repeats them."""
    return tuple(
        PlanUnit(key=u.key, layer=u.layer, kind=u.kind, bytes=u.bytes, options=tuple(
            OptionCost(option=o, bytes=u.kept_bytes(o), time_s=u.time_s(o)) for o in u.options))
        for u in model.units
    )


def memory_records(trace: Trace, model: CostModel, plans: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """A plan's memory beyond its buckets' peaks, as ``Plan`` fields: the timeline
    (``timeline.py``) of ``plans`` (``{bucket: decisions}``) with GC's and
    store-all's, the trace's trained and frozen parameter bytes (None where
    the trace did not record them), which ``devicefit`` adds to the peaks, and
    GC's peak under eager autograd."""
    return {"timeline": memory_timeline(trace, model, plans),
            "trained_param_bytes": sum(trace.param_bytes.values()) if trace.param_bytes else None,
            "frozen_param_bytes": trace.frozen_param_bytes, "gc_eager_bytes": model.gc_eager_bytes}


def bucket_summary(b: BucketPlan) -> str:
    """One line on a bucket's record: its shares, predictions and how many units take each option."""
    counts: dict[str, int] = {}
    for _, option in b.decisions:
        kind = "compress" if option.startswith(COMPRESS_PREFIX) else option
        counts[kind] = counts.get(kind, 0) + 1
    mix = ", ".join(f"{counts.get(k, 0)} {k}" for k in (STORE, "compress", RECOMPUTE))
    return (f"bucket {b.bucket.name} (samples {b.sample_share:.0%}, mass {b.mass_share:.0%}, "
            f"error share {b.error_share:.0%}): "
            f"memory {format_bytes(b.memory_bytes)}, recovery {format_seconds(b.time_s)}, "
            f"{format_error(b.risk, cosine=False)} ({mix})")


def predicted_error(plan: Plan) -> float:
    """The plan's predicted relative gradient error of the whole update: sqrt(sum of bucket risks)."""
    return math.sqrt(sum(b.risk for b in plan.buckets if not b.skip))
