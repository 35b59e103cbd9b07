"""What a hilore method planned, as its worker reads it: the bucket a batch runs, the record.

A worker runs each step under one exposure bucket (``choose_bucket``) and
records what the backend compiled (``plan_summary``): budgets, each bucket's
predicted bytes and error, digests that say whether two workers ran the same
plan, and the partitioner's saved bytes. ``step_cosines`` reads from that
record the gradient cosine a step's bucket is promised.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..solver.risk import error2_to_cosine
from ..vocabulary import to_plan_exposure


def choose_bucket(backend: Any, exposures: torch.Tensor) -> str | None:
    """The plan's bucket for a microbatch holding every sample: that of the largest exposure.

    One forward runs the whole batch under one bucket, so it must be the
    bucket that covers its most exposed sample. None when nothing was compiled.

    Raises:
        RuntimeError: the backend fell back to Inductor's partition; measured,
            that would pass Inductor's default off as the hilore method.
    """
    graphs = getattr(backend, "graphs", None) or []
    if not graphs:
        return None
    if graphs[0].plan is None:
        raise RuntimeError("the hilore backend planned nothing and fell back to Inductor's partition "
                           "(its HiLoReWarning in the worker log says why)")
    # Plans state exposure per sample as if it were the whole batch (vocabulary).
    return graphs[0].plan.bucket_for(to_plan_exposure(float(exposures.max()), exposures.numel()))


def plan_summary(backend: Any) -> dict[str, Any]:
    """What a hilore backend compiled: graphs, decision counts, predicted and saved bytes."""
    graphs = getattr(backend, "graphs", None) or []
    out: dict[str, Any] = {"graphs": len(graphs)}
    if not graphs:
        return out
    plan = graphs[0].plan
    out.update(budget=plan.budget, budget_bytes=plan.budget_bytes, gc_bytes=plan.gc_bytes,
               store_bytes=plan.store_bytes, gc_eager_bytes=plan.gc_eager_bytes,
               predicted_memory_bytes={b.bucket.name: b.memory_bytes for b in plan.buckets if not b.skip},
               risk_budget=plan.risk_budget,
               bucket_error={b.bucket.name: {"risk": b.risk, "error_share": b.error_share}
                             for b in plan.buckets if not b.skip},
               decisions_digest=_decisions_digest(plan),
               bucket_digests={b.bucket.name: _decisions_digest(plan, b) for b in plan.buckets if not b.skip})
    # What the partitioner applied; empty where Inductor's graph cache served
    # the compiled graph and no partitioner ran (a bench's timed worker).
    out["records"] = [
        {"bucket": r.bucket, "counts": dict(r.counts), "saved_bytes": r.saved_bytes,
         "default_saved_bytes": r.default_saved_bytes}
        for g in graphs for r in g.records
    ]
    return out


def _decisions_digest(plan: Any, bucket: Any = None) -> str:
    """A short hash of every bucket's decisions, or of one ``bucket``'s (a ``BucketPlan``):
    equal digests, the same plan (the same compiled step under that bucket)."""
    if bucket is not None:
        text = json.dumps(list(bucket.decisions))
    else:
        text = json.dumps([[b.bucket.name, b.skip, list(b.decisions)] for b in plan.buckets])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def step_cosines(summary: dict[str, Any], bucket: str | None) -> dict[str, float]:
    """What a plan says of the gradient cosine of one step run under ``bucket``.

    The risk budget bounds the whole update's squared error, ``sum_b q_b
    s_b^2`` over the buckets' error shares ``q_b``. A step that is one
    bucket's microbatch alone has the error ``s_b`` of that bucket's plan:
    ``predicted_cosine`` is the cosine its predicted ``s_b^2 = risk_b / q_b``
    guarantees, ``cosine_bound`` the one the budget leaves it,
    ``risk_budget / q_b``. For the exposure-blind plan (``q = 1``) the bound is
    the update's own target. Empty where the plan did not record its mix.
    """
    error = summary.get("bucket_error", {}).get(bucket) or {}
    share = error.get("error_share")
    if not share or "risk_budget" not in summary:
        return {}
    return {"error_share": share, "predicted_cosine": error2_to_cosine(error["risk"] / share),
            "cosine_bound": error2_to_cosine(summary["risk_budget"] / share)}
