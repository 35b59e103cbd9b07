"""The plan: one store / compress / recompute decision per recovery unit and bucket.

``hilore.plan/v1`` is what the solver writes and the compile backend reads. It
is torch-free, like the trace, and holds everything ``hilore show`` needs
(per-unit bytes and the cost of each option at the planned shape) so that a
plan can be read and diffed without its trace.

The exposure buckets partition exposure: the ``zero`` bucket is the single
point exposure == 0 (no backward needed, plan ``skip``); every other bucket is
the half-open range ``(lo, hi]`` (``vocabulary.in_bucket``), ``hi`` may be
infinite (``null`` in JSON).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jsonio import FormatError, read_json, require, write_json_atomic
from .validate import plan_problems, raise_problems
# The option words, the zero bucket's name and the interval rule live in
# ``vocabulary``; re-exported here because plan readers import them from here.
from .vocabulary import COMPRESS_PREFIX, RECOMPUTE, SKIP, STORE, ZERO_BUCKET, in_bucket, is_option  # noqa: F401

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
            "references": {"gc_bytes": self.gc_bytes, "store_bytes": self.store_bytes},
            "risk_budget": self.risk_budget,
            "codecs": list(self.codecs),
            "cost_source": self.cost_source,
            "notes": list(self.notes),
            "buckets": [_bucket_json(b) for b in self.buckets],
            "units": [_unit_json(u) for u in self.units],
            **({"lengths": [_length_json(p) for p in self.lengths]} if self.lengths else {}),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the plan atomically as ``hilore.plan/v1`` JSON.

        The payload is first read back as ``load_plan`` would read the file,
        so a plan that ``hilore show`` or the backend would reject is never
        written (FormatError instead).
        """
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


def _length_from_json(obj: Any, where: str) -> LengthPoint:
    obj = _as_object(obj, where)
    memory = require(obj, "memory_bytes", dict, where)
    times = require(obj, "time_s", dict, where)
    for name, value in [*memory.items(), *times.items()]:
        if isinstance(value, bool) or not isinstance(value, _NUM):
            raise FormatError(f"{where}: bucket {name!r}: expected a number, found {value!r}")
    return LengthPoint(seq_len=require(obj, "seq_len", int, where), weight=float(require(obj, "weight", _NUM, where)),
                       budget_bytes=require(obj, "budget_bytes", int, where),
                       gc_bytes=require(obj, "gc_bytes", int, where),
                       store_bytes=require(obj, "store_bytes", int, where),
                       memory_bytes={k: int(v) for k, v in memory.items()},
                       time_s={k: float(v) for k, v in times.items()})


def _seq_range_from_json(shape: dict[str, Any], where: str) -> tuple[int, int] | None:
    value = shape.get("seq_range")
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
        raise FormatError(f"{where}.seq_range: expected [lo, hi] (two integers), found {value!r}")
    return value[0], value[1]


def _unit_json(u: PlanUnit) -> dict[str, Any]:
    return {
        "key": u.key, "layer": u.layer, "kind": u.kind, "bytes": u.bytes,
        "options": {o.option: {"bytes": o.bytes, "time_s": o.time_s} for o in u.options},
    }


_NUM = (int, float)


def _as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected an object, found {type(value).__name__}")
    return value


def _unit_from_json(obj: Any, where: str) -> PlanUnit:
    obj = _as_object(obj, where)
    key = require(obj, "key", str, where)
    where = f"{where}[{key}]"
    layer = obj.get("layer")
    if layer is not None and not isinstance(layer, int):
        raise FormatError(f"{where}.layer: expected int or null, found {type(layer).__name__}")
    options = []
    for name, cost in require(obj, "options", dict, where).items():
        if not is_option(name):
            raise FormatError(f"{where}.options: {name!r} is not store, recompute or compress:<codec>")
        at = f"{where}.options.{name}"
        cost = _as_object(cost, at)
        options.append(OptionCost(option=name, bytes=require(cost, "bytes", int, at),
                                  time_s=float(require(cost, "time_s", _NUM, at))))
    return PlanUnit(key=key, layer=layer, kind=require(obj, "kind", str, where),
                    bytes=require(obj, "bytes", int, where), options=tuple(options))


def _solver_from_json(obj: Any, where: str) -> SolverStats | None:
    if obj is None:
        return None
    obj = _as_object(obj, f"{where}.solver")
    gap = obj.get("gap")
    if gap is not None and not isinstance(gap, _NUM):
        raise FormatError(f"{where}.solver.gap: expected a number or null")
    return SolverStats(
        status=require(obj, "status", str, f"{where}.solver"),
        seconds=float(require(obj, "seconds", _NUM, f"{where}.solver")),
        objective=float(require(obj, "objective", _NUM, f"{where}.solver")),
        gap=None if gap is None else float(gap),
    )


def _decisions_from_json(obj: dict, units: dict[str, PlanUnit], skip: bool, where: str):
    decisions = require(obj, "decisions", dict, where)
    if skip:
        if decisions:
            raise FormatError(f"{where}: a skip bucket has no decisions, found {len(decisions)}")
        return ()
    unknown = sorted(set(decisions) - set(units))
    missing = [k for k in units if k not in decisions]
    if unknown or missing:
        raise FormatError(f"{where}.decisions: unknown units {unknown[:3]}, undecided units {missing[:3]}")
    for key, option in decisions.items():
        allowed = [o.option for o in units[key].options]
        if option not in allowed:
            raise FormatError(f"{where}.decisions[{key}]: {option!r} is not one of {allowed}")
    return tuple((key, decisions[key]) for key in units)


def _bucket_from_json(obj: Any, units: dict[str, PlanUnit], where: str) -> BucketPlan:
    obj = _as_object(obj, where)
    name = require(obj, "name", str, where)
    where = f"{where}[{name}]"
    kind = require(obj, "plan", str, where)
    if kind not in (SKIP, "decisions"):
        raise FormatError(f"{where}.plan: expected 'skip' or 'decisions', found {kind!r}")
    hi = obj.get("hi")
    if hi is not None and not isinstance(hi, _NUM):
        raise FormatError(f"{where}.hi: expected a number or null (unbounded)")
    spec = BucketSpec(name, float(require(obj, "lo", _NUM, where)),
                      math.inf if hi is None else float(hi),
                      float(require(obj, "exposure", _NUM, where)))
    predicted = require(obj, "predicted", dict, where)
    at = f"{where}.predicted"
    return BucketPlan(
        bucket=spec, skip=kind == SKIP,
        decisions=_decisions_from_json(obj, units, kind == SKIP, where),
        memory_bytes=require(predicted, "memory_bytes", int, at),
        kept_bytes=require(predicted, "kept_bytes", int, at),
        transient_bytes=require(predicted, "transient_bytes", int, at),
        time_s=float(require(predicted, "time_s", _NUM, at)),
        risk=float(require(predicted, "risk", _NUM, at)),
        proxy_sensitivity=require(obj, "proxy_sensitivity", bool, where),
        solver=_solver_from_json(obj.get("solver"), where),
        notes=tuple(require(obj, "notes", list, where)),
        **_mix_from_json(obj.get("mix"), where),
        **_peak_from_json(predicted, at),
    )


def _peak_from_json(predicted: dict[str, Any], at: str) -> dict[str, Any]:
    """The optional ``peak_at`` / ``peak_parts`` (older plans have neither)."""
    if predicted.get("peak_at") is None:
        return {}
    parts = require(predicted, "peak_parts", dict, at)
    return {"peak_at": require(predicted, "peak_at", str, at),
            # ``freed`` is absent from plans made before backward's frees were modelled.
            "peak_parts": {name: 0 if name == "freed" and name not in parts
                           else require(parts, name, int, f"{at}.peak_parts") for name in PEAK_PARTS}}


def _mix_from_json(obj: Any, where: str) -> dict[str, float | None]:
    """The optional ``mix`` record (older plans have none)."""
    if obj is None:
        return {}
    obj = _as_object(obj, f"{where}.mix")
    out = {}
    for name in ("sample_share", "mass_share", "error_share"):
        value = obj.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, _NUM)):
            raise FormatError(f"{where}.mix.{name}: expected a number or null")
        out[name] = None if value is None else float(value)
    return out


def plan_from_json(payload: dict[str, Any], where: str = "plan") -> Plan:
    """Build and validate a Plan from parsed JSON; a FormatError names the wrong field.

    Past the JSON types, ``validate.plan_problems`` checks what the backend
    relies on: finite non-negative numbers, at least one bucket with decisions.
    """
    payload = _as_object(payload, where)
    if payload.get("schema") != PLAN_SCHEMA:
        raise FormatError(f"{where}: schema is {payload.get('schema')!r}, expected {PLAN_SCHEMA!r}")
    units = [_unit_from_json(u, f"{where}.units[{i}]")
             for i, u in enumerate(require(payload, "units", list, where))]
    by_key = {u.key: u for u in units}
    if len(by_key) != len(units):
        raise FormatError(f"{where}.units: unit keys are not unique")
    buckets = tuple(_bucket_from_json(b, by_key, f"{where}.buckets[{i}]")
                    for i, b in enumerate(require(payload, "buckets", list, where)))
    names = [b.bucket.name for b in buckets]
    if len(set(names)) != len(names):
        raise FormatError(f"{where}.buckets: bucket names {names} are not unique")
    shape = require(payload, "shape", dict, where)
    budget = require(payload, "budget", dict, where)
    refs = require(payload, "references", dict, where)
    plan = Plan(
        model=require(payload, "model", str, where),
        fingerprint=require(payload, "fingerprint", str, where),
        batch=require(shape, "batch", int, f"{where}.shape"),
        seq_len=require(shape, "seq_len", int, f"{where}.shape"),
        budget=require(budget, "given", str, f"{where}.budget"),
        budget_bytes=require(budget, "bytes", int, f"{where}.budget"),
        gc_bytes=require(refs, "gc_bytes", int, f"{where}.references"),
        store_bytes=require(refs, "store_bytes", int, f"{where}.references"),
        risk_budget=float(require(payload, "risk_budget", _NUM, where)),
        codecs=tuple(require(payload, "codecs", list, where)),
        cost_source=require(payload, "cost_source", str, where),
        buckets=buckets,
        units=tuple(units),
        notes=tuple(require(payload, "notes", list, where)),
        seq_range=_seq_range_from_json(shape, f"{where}.shape"),
        lengths=tuple(_length_from_json(p, f"{where}.lengths[{i}]")
                      for i, p in enumerate(payload.get("lengths") or [])),
    )
    raise_problems(plan_problems(plan, where))
    return plan


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a ``hilore.plan/v1`` file."""
    return plan_from_json(read_json(path, PLAN_SCHEMA), where=str(path))
