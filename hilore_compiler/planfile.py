"""The plan: one store / compress / recompute decision per recovery unit and bucket.

``hilore.plan/v1`` is what the solver writes and the compile backend reads. It
is torch-free, like the trace, and holds everything ``hilore show`` needs
(per-unit bytes and the cost of each option at the planned shape) so that a
plan can be read and diffed without its trace.

The exposure buckets partition exposure: the ``zero`` bucket is the single
point exposure == 0 (no backward needed, plan ``skip``); every other bucket is
the half-open range ``(lo, hi]`` (``vocabulary.in_bucket``), ``hi`` may be
infinite (``null`` in JSON).

This module holds the records and writes them; ``planload`` reads and checks them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .jsonio import write_json_atomic
# The option words, the zero bucket's name and the interval rule live in
# ``vocabulary``; re-exported here because plan readers import them from here.
from .vocabulary import COMPRESS_PREFIX, RECOMPUTE, SKIP, STORE, ZERO_BUCKET, in_bucket, is_option  # noqa: F401

if TYPE_CHECKING:  # the trace reader validates plans too: no import at run time
    from .tracefile import Trace

PLAN_SCHEMA = "hilore.plan/v1"


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """An exposure range ``(lo, hi]`` planned for at one representative exposure.

    Positional for convenience: ``BucketSpec("b0", 0.0, 0.5, 0.5)``.
    """

    name: str
    lo: float
    hi: float
    #: The exposure the risk constraint is evaluated at (usually ``hi``, the
    #: worst case inside the range, so the risk bound holds for every sample).
    exposure: float


@dataclass(frozen=True, slots=True, kw_only=True)
class OptionCost:
    """What one option costs for one unit at the planned shape."""

    option: str
    #: Bytes kept across the forward/backward boundary (0 for recompute).
    bytes: int
    #: Seconds added to the step (recompute, or encode + decode).
    time_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanUnit:
    """A recovery unit as the plan saw it: where it is, its size, its options."""

    key: str
    layer: int | None
    kind: str
    #: Bytes when stored, at the planned shape.
    bytes: int
    options: tuple[OptionCost, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverStats:
    """How the ILP solve of one bucket went."""

    #: ``optimal``, or ``feasible`` when CBC stopped (time limit) before proving it.
    status: str
    seconds: float
    #: Minimised recovery seconds as CBC reports them.
    objective: float
    #: Relative MIP gap CBC reported (0.0 when optimal), None when unknown.
    gap: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketPlan:
    """The decisions for one exposure bucket and what they are predicted to cost."""

    bucket: BucketSpec
    #: True for the zero bucket: no backward, no decisions.
    skip: bool
    #: ``(unit key, option)`` in trace order; empty when ``skip``.
    decisions: tuple[tuple[str, str], ...]
    #: Kept bytes plus the largest recovery transient (re-simulated, not the ILP's).
    memory_bytes: int
    kept_bytes: int
    transient_bytes: int
    time_s: float
    #: This bucket's predicted share of the whole update's squared relative
    #: gradient error: error_share x sum over compressed units of
    #: sensitivity^2 (``solver/risk.py``). The buckets' risks add up.
    risk: float
    #: True if some compressed unit's sensitivity was the rel_l2 proxy.
    proxy_sensitivity: bool
    solver: SolverStats | None
    notes: tuple[str, ...] = ()
    #: The exposure mix the plan was solved for: this bucket's share of a
    #: batch's samples, of its coefficient mass and of its squared exposure
    #: (the error share, ``solver/risk.py``); None: not recorded.
    sample_share: float | None = None
    mass_share: float | None = None
    error_share: float | None = None
    #: Where the predicted peak falls (``"backward of outside"``, ``"loss"``,
    #: ``"end of backward"``) and its parts besides kept bytes (``PEAK_PARTS``),
    #: whose ``peak_total`` is ``transient_bytes``; None / empty: not recorded.
    peak_at: str | None = None
    peak_parts: Mapping[str, int] = field(default_factory=dict)


#: The parts of a bucket's ``transient_bytes`` at its peak (``solver.stepterms.PeakParts``):
#: four alive besides kept bytes, and ``freed``, the kept bytes backward has
#: already released there, which count against them (``validate.peak_total``).
PEAK_PARTS = ("rebuilt", "workspace", "weight_gradients", "outputs", "freed")


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthPoint:
    """A range plan's predictions at one sequence length of its range."""

    seq_len: int
    #: The length's share of the length mix the plan's time was minimised over.
    weight: float
    #: The memory ceiling at this length (``x-gc`` budgets follow GC's peak here).
    budget_bytes: int
    gc_bytes: int
    store_bytes: int
    #: Per bucket with decisions: predicted peak bytes and recovery seconds here.
    memory_bytes: Mapping[str, int] = field(default_factory=dict)
    time_s: Mapping[str, float] = field(default_factory=dict)


#: ``MemoryTimeline``'s names of the references every plan is set against.
TIMELINE_GC = "gc"
TIMELINE_STORE_ALL = "store-all"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryTimeline:
    """The step's predicted memory phase by phase (``solver.timeline``), for GC,
    store-all and each bucket with decisions: what ``hilore show --plot`` draws."""

    #: The phases in the order the step runs them: ``forward of layer <i>``
    #: (and of ``outside``), ``loss``, ``backward of <segment>``, ``end of backward``.
    phases: tuple[str, ...]
    #: Per series (``"gc"``, ``"store-all"``, a bucket's name): the bytes alive
    #: at each phase's worst moment, above what the process held before the
    #: step; a bucket's maximum is its ``memory_bytes``, GC's ``gc_bytes``.
    bytes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A complete plan for one model at one shape (or a range of sequence lengths) and one memory budget."""

    model: str
    #: The trace's fingerprint; the backend refuses a plan made for another graph.
    fingerprint: str
    batch: int
    #: The planned shape; for a range plan, its longest length, where sizes,
    #: ``budget_bytes``, the references and the buckets' predictions are given.
    seq_len: int
    #: The budget as given (``"1.10x-gc"``) and in bytes at this shape.
    budget: str
    budget_bytes: int
    #: The trace's gradient-checkpointing and store-all bytes at this shape.
    gc_bytes: int
    store_bytes: int
    risk_budget: float
    codecs: tuple[str, ...]
    cost_source: str
    buckets: tuple[BucketPlan, ...]
    units: tuple[PlanUnit, ...]
    notes: tuple[str, ...] = ()
    #: The sequence lengths ``(lo, hi)`` the plan holds for (``solver.lengths``):
    #: it fits the ceiling at each of them; None: ``seq_len`` alone.
    seq_range: tuple[int, int] | None = None
    #: Predictions at lengths across ``seq_range`` (empty for a one-shape plan).
    lengths: tuple[LengthPoint, ...] = ()
    #: The predicted memory phase by phase (None: not recorded, in older plans).
    timeline: MemoryTimeline | None = None
    #: Bytes of the trained parameters (so of their gradients) and of the
    #: frozen ones (a LoRA model's base weights), from the trace; None where
    #: it did not record them. What the process holds besides the step
    #: (``solver.devicefit``).
    trained_param_bytes: int | None = None
    frozen_param_bytes: int | None = None
    #: GC's predicted peak when eager autograd runs the step rather than a compiled
    #: backward (``solver.stepterms.StepTerms.eager``); None in older plans.
    gc_eager_bytes: int | None = None
    #: The trace the plan was solved from, when it was solved in this process
    #: (``solve``); never written to the file. The backend re-solves from it
    #: for a batch or length the plan does not cover.
    trace: Trace | None = field(default=None, repr=False, compare=False)

    @property
    def length_range(self) -> tuple[int, int]:
        """``(lo, hi)``: the sequence lengths this plan was made to hold for."""
        return self.seq_range or (self.seq_len, self.seq_len)

    def covers(self, seq_len: int) -> bool:
        """Whether the plan was made to hold at this sequence length."""
        lo, hi = self.length_range
        return lo <= seq_len <= hi

    @property
    def bucket_names(self) -> tuple[str, ...]:
        return tuple(b.bucket.name for b in self.buckets)

    def bucket(self, name: str) -> BucketPlan:
        for b in self.buckets:
            if b.bucket.name == name:
                return b
        raise KeyError(f"no bucket {name!r} in plan; buckets are {list(self.bucket_names)}")

    def decisions(self, bucket: str) -> dict[str, str]:
        """``{unit key: option}`` for ``bucket`` (empty for the skip bucket)."""
        return dict(self.bucket(bucket).decisions)

    def bucket_for(self, exposure: float) -> str:
        """The bucket a sample of this exposure runs in (the top one above all ranges)."""
        if exposure < 0:
            raise ValueError(f"exposure is a sum of magnitudes, cannot be {exposure}")
        solved = [b.bucket for b in self.buckets if not b.skip]
        if exposure == 0 and any(b.skip for b in self.buckets):
            return next(b.bucket.name for b in self.buckets if b.skip)
        for spec in solved:
            if in_bucket(exposure, spec.lo, spec.hi):
                return spec.name
        return max(solved, key=lambda s: s.exposure).name

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "shape": {"batch": self.batch, "seq_len": self.seq_len,
                      **({"seq_range": list(self.seq_range)} if self.seq_range else {})},
            "budget": {"given": self.budget, "bytes": self.budget_bytes},
            "references": {"gc_bytes": self.gc_bytes, "store_bytes": self.store_bytes,
                           **({"gc_eager_bytes": self.gc_eager_bytes} if self.gc_eager_bytes is not None else {})},
            "risk_budget": self.risk_budget,
            "codecs": list(self.codecs),
            "cost_source": self.cost_source,
            "notes": list(self.notes),
            "buckets": [_bucket_json(b) for b in self.buckets],
            "units": [_unit_json(u) for u in self.units],
            **({"lengths": [_length_json(p) for p in self.lengths]} if self.lengths else {}),
            **({"timeline": {"phases": list(self.timeline.phases),
                             "bytes": {k: list(v) for k, v in self.timeline.bytes.items()}}}
               if self.timeline is not None else {}),
            **({"parameters": {"trained_bytes": self.trained_param_bytes, "frozen_bytes": self.frozen_param_bytes}}
               if self.trained_param_bytes is not None or self.frozen_param_bytes is not None else {}),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan atomically as ``hilore.plan/v1`` JSON.

        The payload is first read back as ``load_plan`` would read the file,
        so a plan that ``hilore show`` or the backend would reject is never
        written (FormatError instead).
        """
        from .planload import plan_from_json  # the reader builds Plans: imported late, not in a cycle

        payload = json.loads(json.dumps(self.to_json()))
        plan_from_json(payload, where=f"plan for {path}")
        return write_json_atomic(path, payload)


def _bucket_json(b: BucketPlan) -> dict[str, Any]:
    spec = b.bucket
    return {
        "name": spec.name,
        "lo": spec.lo,
        "hi": None if math.isinf(spec.hi) else spec.hi,
        "exposure": spec.exposure,
        "plan": SKIP if b.skip else "decisions",
        "decisions": dict(b.decisions),
        "predicted": {
            "memory_bytes": b.memory_bytes,
            "kept_bytes": b.kept_bytes,
            "transient_bytes": b.transient_bytes,
            "time_s": b.time_s,
            "risk": b.risk,
            **({"peak_at": b.peak_at, "peak_parts": dict(b.peak_parts)} if b.peak_at is not None else {}),
        },
        "proxy_sensitivity": b.proxy_sensitivity,
        "mix": {"sample_share": b.sample_share, "mass_share": b.mass_share, "error_share": b.error_share},
        "solver": None if b.solver is None else {
            "status": b.solver.status, "seconds": b.solver.seconds,
            "objective": b.solver.objective, "gap": b.solver.gap,
        },
        "notes": list(b.notes),
    }


def _length_json(p: LengthPoint) -> dict[str, Any]:
    return {"seq_len": p.seq_len, "weight": p.weight, "budget_bytes": p.budget_bytes, "gc_bytes": p.gc_bytes,
            "store_bytes": p.store_bytes, "memory_bytes": dict(p.memory_bytes), "time_s": dict(p.time_s)}


def _unit_json(u: PlanUnit) -> dict[str, Any]:
    return {
        "key": u.key, "layer": u.layer, "kind": u.kind, "bytes": u.bytes,
        "options": {o.option: {"bytes": o.bytes, "time_s": o.time_s} for o in u.options},
    }
