"""Reading a plan: ``hilore.plan/v1`` JSON to a checked :class:`~hilore_compiler.planfile.Plan`.

Every field is checked for presence and JSON type here, and a wrong one is a
``FormatError`` naming it (``plan.buckets[1][b0].predicted.time_s``); what the
values mean (finite, non-negative, every referenced unit present) is
``validate.plan_problems``'s. Fields added after v1 shipped (``mix``,
``peak_at``, ``lengths``, ``seq_range``, ``timeline``, ``parameters``) are optional, so older plans still load.
"""

from __future__ import annotations

import math
import os
from typing import Any

from .jsonio import FormatError, as_object, read_json, require
from .planfile import (PEAK_PARTS, PLAN_SCHEMA, BucketPlan, BucketSpec, LengthPoint, MemoryTimeline, OptionCost, Plan,
                       PlanUnit, SolverStats)
from .validate import plan_problems, raise_problems
from .vocabulary import SKIP, is_option


#: What JSON numbers parse to (bool, an int subclass, is rejected where it matters).
_NUM = (int, float)


def _length_from_json(obj: Any, where: str) -> LengthPoint:
    obj = as_object(obj, where)
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


def _unit_from_json(obj: Any, where: str) -> PlanUnit:
    obj = as_object(obj, where)
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
        cost = as_object(cost, at)
        options.append(OptionCost(option=name, bytes=require(cost, "bytes", int, at),
                                  time_s=float(require(cost, "time_s", _NUM, at))))
    return PlanUnit(key=key, layer=layer, kind=require(obj, "kind", str, where),
                    bytes=require(obj, "bytes", int, where), options=tuple(options))


def _solver_from_json(obj: Any, where: str) -> SolverStats | None:
    if obj is None:
        return None
    obj = as_object(obj, f"{where}.solver")
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
    obj = as_object(obj, where)
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
    obj = as_object(obj, f"{where}.mix")
    out = {}
    for name in ("sample_share", "mass_share", "error_share"):
        value = obj.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, _NUM)):
            raise FormatError(f"{where}.mix.{name}: expected a number or null")
        out[name] = None if value is None else float(value)
    return out


def _timeline_from_json(obj: Any, where: str) -> MemoryTimeline | None:
    """The optional ``timeline`` (older plans have none)."""
    if obj is None:
        return None
    obj = as_object(obj, where)
    phases = require(obj, "phases", list, where)
    series = {}
    for name, values in require(obj, "bytes", dict, where).items():
        if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
            raise FormatError(f"{where}.bytes.{name}: expected a list of integers (bytes per phase)")
        series[name] = tuple(values)
    return MemoryTimeline(phases=tuple(phases), bytes=series)


def _parameters_from_json(obj: Any, where: str) -> dict[str, int | None]:
    """The optional ``parameters`` record: trained and frozen parameter bytes."""
    if obj is None:
        return {}
    obj = as_object(obj, where)
    out = {}
    for name in ("trained_bytes", "frozen_bytes"):
        out[name.replace("_bytes", "_param_bytes")] = _optional_int(obj, name, where)
    return out


def _optional_int(obj: dict[str, Any], name: str, where: str) -> int | None:
    """``obj[name]``: an integer, or None where it is absent (a field older files lack)."""
    value = obj.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise FormatError(f"{where}.{name}: expected an integer or null")
    return value


def plan_from_json(payload: dict[str, Any], where: str = "plan") -> Plan:
    """Build and validate a Plan from parsed JSON; a FormatError names the wrong field.

    Past the JSON types, ``validate.plan_problems`` checks what the backend
    relies on: finite non-negative numbers, at least one bucket with decisions.
    """
    payload = as_object(payload, where)
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
        gc_eager_bytes=_optional_int(refs, "gc_eager_bytes", f"{where}.references"),
        risk_budget=float(require(payload, "risk_budget", _NUM, where)),
        codecs=tuple(require(payload, "codecs", list, where)),
        cost_source=require(payload, "cost_source", str, where),
        buckets=buckets,
        units=tuple(units),
        notes=tuple(require(payload, "notes", list, where)),
        seq_range=_seq_range_from_json(shape, f"{where}.shape"),
        lengths=tuple(_length_from_json(p, f"{where}.lengths[{i}]")
                      for i, p in enumerate(payload.get("lengths") or [])),
        timeline=_timeline_from_json(payload.get("timeline"), f"{where}.timeline"),
        **_parameters_from_json(payload.get("parameters"), f"{where}.parameters"),
    )
    raise_problems(plan_problems(plan, where))
    return plan


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a ``hilore.plan/v1`` file."""
    return plan_from_json(read_json(path, PLAN_SCHEMA), where=str(path))
