"""One validation pass over a trace or plan, before anything plans with it.

The loaders (``tracefile``, ``planload``) check that every field is there with
the right JSON type; this pass checks what the values mean: numbers finite and
non-negative, sizes parseable and non-negative at the traced shape, keys
unique, layers an index or null (outside the layer stack), every referenced
unit present, at least one bucket with decisions. Each violation is one line
naming the file, unit and field; :func:`raise_problems` turns the list into
one ``FormatError`` whose message is the first line and a count of the rest.

It reads records only by attribute, so it imports neither loader (they call it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .blockclasses import block_class_problems
from .jsonio import FormatError
from .sizeexpr import eval_size, parse_size
from .vocabulary import READ_PAST_UNITS


def raise_problems(problems: list[str]) -> None:
    """Raise one ``FormatError`` (one line) if ``problems`` is not empty."""
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        error = FormatError(problems[0] + more)
        error.problems = tuple(problems)
        raise error


#: Largest seconds one unit's recompute or codec may cost: past this (11 days)
#: it is not a measurement, and such coefficients only upset CBC.
MAX_SECONDS = 1e6
#: Largest relative error (rel_l2) or sensitivity: a codec whose error is 1000x
#: the signal is noise; squared sensitivities enter the ILP, so bound them.
MAX_RELATIVE = 1e3


def _number(value: Any, at: str, *, integer: bool = False, positive: bool = False,
            most: float | None = None) -> list[str]:
    """A finite number >= 0 (> 0 if ``positive``, <= ``most`` if given); an int if ``integer``."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return [f"{at}: expected {kind}, found {type(value).__name__} {value!r}"]
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        return [f"{at}: expected {kind} {'> 0' if positive else '>= 0'}, found {value!r}"]
    if most is not None and value > most:
        return [f"{at}: {value!r} is past {most:g}, the largest plausible value"]
    return []


def _layer(value: Any, at: str) -> list[str]:
    if value is None or (type(value) is int and value >= 0):
        return []
    return [f"{at}: expected a layer index >= 0 or null (outside the layer stack), found {value!r}"]


def _strings(values: Iterable[Any], at: str) -> list[str]:
    return [f"{at}[{i}]: expected a string, found {type(v).__name__}"
            for i, v in enumerate(values) if not isinstance(v, str)]


def _size(text: Any, at: str, batch: int, seq_len: int) -> tuple[list[str], int | None]:
    """Problems with a size expression, and its value at the traced shape."""
    try:
        return [], eval_size(parse_size(text, at), batch, seq_len, at)
    except FormatError as e:
        return [str(e)], None


def _duplicates(keys: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    return [k for k in keys if k in seen or seen.add(k)]


# ------------------------------------------------------------------- traces
def _trace_unit(u: Any, at: str, batch: int, seq_len: int, keys: set[str]) -> list[str]:
    problems = [] if u.key else [f"{at}.key: empty"]
    problems += _layer(u.layer, f"{at}.layer")
    found, value = _size(u.bytes, f"{at}.bytes", batch, seq_len)
    problems += found + _number(u.bytes_at_trace, f"{at}.bytes_at_trace", integer=True)
    if value is not None and not problems and value != u.bytes_at_trace:
        problems.append(f"{at}.bytes_at_trace: {u.bytes_at_trace} but bytes {u.bytes!r} is {value} "
                        f"at the traced shape")
    problems += _size(u.recompute_transient, f"{at}.recompute_transient", batch, seq_len)[0]
    problems += _number(u.recompute_time_s, f"{at}.recompute_time_s", most=MAX_SECONDS)
    problems += _number(u.recompute_flops, f"{at}.recompute_flops", integer=True)
    problems += _strings(u.recompute_from, f"{at}.recompute_from")
    unknown = sorted(k for k in u.recompute_from if isinstance(k, str) and k not in keys)
    if unknown:
        problems.append(f"{at}.recompute_from: unknown unit(s) {unknown[:3]}")
    if u.key in u.recompute_from:
        problems.append(f"{at}.recompute_from: a unit cannot be recomputed from itself")
    if u.read_until is not None and u.read_until != READ_PAST_UNITS and u.read_until not in keys:
        problems.append(f"{at}.read_until: unknown unit {u.read_until!r} (a unit key, "
                        f"{READ_PAST_UNITS!r} or null)")
    for name, c in u.codecs.items():
        problems += [] if name else [f"{at}.codecs: empty codec name"]
        problems += _size(c.bytes, f"{at}.codecs.{name}.bytes", batch, seq_len)[0]
        problems += _number(c.time_s, f"{at}.codecs.{name}.time_s", most=MAX_SECONDS)
        problems += _number(c.rel_l2, f"{at}.codecs.{name}.rel_l2", most=MAX_RELATIVE)
        problems += _number(c.max_abs, f"{at}.codecs.{name}.max_abs")
    for name, value in u.sensitivity.items():
        problems += _number(value, f"{at}.sensitivity.{name}", most=MAX_RELATIVE)
    return problems


def trace_problems(trace: Any, where: str) -> list[str]:
    """Every violation in a ``Trace``, one line each (empty if it can be planned)."""
    problems = _number(trace.batch, f"{where}.batch", integer=True, positive=True)
    problems += _number(trace.seq_len, f"{where}.seq_len", integer=True, positive=True)
    problems += _number(trace.num_layers, f"{where}.num_layers", integer=True)
    problems += _strings(trace.notes, f"{where}.notes") + _strings(trace.graph_breaks, f"{where}.graph_breaks")
    if problems:  # sizes cannot be evaluated without a valid shape
        return problems
    if not trace.units:
        problems.append(f"{where}.units: empty; a trace needs at least one recovery unit to plan")
    problems += [f"{where}.units: key {k!r} appears more than once"
                 for k in _duplicates(u.key for u in trace.units)]
    keys = {u.key for u in trace.units}
    for i, u in enumerate(trace.units):
        problems += _trace_unit(u, f"{where}.units[{i}][{u.key}]", trace.batch, trace.seq_len, keys)
    for field in ("gc_bytes", "store_bytes", "output_bytes"):
        problems += _size(getattr(trace, field), f"{where}.{field}", trace.batch, trace.seq_len)[0]
    if getattr(trace, "frozen_param_bytes", None) is not None:  # None: not recorded
        problems += _number(trace.frozen_param_bytes, f"{where}.frozen_param_bytes", integer=True)
    for name in ("param_bytes", "partial_grad_bytes"):
        for segment, value in getattr(trace, name).items():
            if not _SEGMENT.match(str(segment)):
                problems.append(f"{where}.{name}: segment {segment!r} is not 'outside', 'inputs', 'tied' or "
                                "'layer <i>'")
            problems += _number(value, f"{where}.{name}.{segment}", integer=True)
    # Classes compare units' structure, which needs well-formed units.
    return problems or block_class_problems(trace, where)


#: A backward segment's name (``vocabulary.group_of``, or ``inputs``).
_SEGMENT = re.compile(r"^(outside|inputs|tied|layer \d+)$")


# -------------------------------------------------------------------- plans
def _plan_unit(u: Any, at: str) -> list[str]:
    problems = _layer(u.layer, f"{at}.layer") + _number(u.bytes, f"{at}.bytes", integer=True)
    if not u.options:
        problems.append(f"{at}.options: empty; every unit needs at least one option")
    for o in u.options:
        problems += _number(o.bytes, f"{at}.options.{o.option}.bytes", integer=True)
        problems += _number(o.time_s, f"{at}.options.{o.option}.time_s")
    return problems


def peak_total(parts: Mapping[str, int]) -> int:
    """What a plan bucket's ``peak_parts`` add up to, ``transient_bytes``: the
    parts alive besides kept bytes, less ``freed`` (``planfile.PEAK_PARTS``)."""
    return sum(v for k, v in parts.items() if k != "freed") - parts.get("freed", 0)


def _plan_bucket(b: Any, at: str) -> list[str]:
    spec = b.bucket
    problems = _number(spec.lo, f"{at}.lo") + _number(spec.exposure, f"{at}.exposure")
    if not (isinstance(spec.hi, (int, float)) and not math.isnan(spec.hi) and spec.hi >= spec.lo):
        problems.append(f"{at}.hi: expected a number >= lo ({spec.lo!r}) or null, found {spec.hi!r}")
    for field in ("memory_bytes", "kept_bytes", "transient_bytes"):
        problems += _number(getattr(b, field), f"{at}.predicted.{field}", integer=True)
    for name, value in getattr(b, "peak_parts", {}).items():
        problems += _number(value, f"{at}.predicted.peak_parts.{name}", integer=True)
    if getattr(b, "peak_parts", None) and peak_total(b.peak_parts) != b.transient_bytes:
        problems.append(f"{at}.predicted.peak_parts: add up to {peak_total(b.peak_parts)} (less freed), not "
                        f"transient_bytes {b.transient_bytes}")
    problems += _number(b.time_s, f"{at}.predicted.time_s") + _number(b.risk, f"{at}.predicted.risk")
    problems += _strings(b.notes, f"{at}.notes")
    for field in ("sample_share", "mass_share", "error_share"):  # the exposure mix; None when not recorded
        if getattr(b, field, None) is not None:
            problems += _number(getattr(b, field), f"{at}.mix.{field}")
    if b.solver is not None:
        problems += _number(b.solver.seconds, f"{at}.solver.seconds")
        if not math.isfinite(b.solver.objective):
            problems.append(f"{at}.solver.objective: expected a finite number, found {b.solver.objective!r}")
        if b.solver.gap is not None:
            problems += _number(b.solver.gap, f"{at}.solver.gap")
    return problems


def _decisions(b: Any, options: dict[str, set[str]], at: str) -> list[str]:
    """Every unit decided once, with one of its own options (a skip bucket decides nothing)."""
    decided = dict(b.decisions)
    if b.skip:
        return [f"{at}.decisions: a skip bucket has no decisions, found {len(decided)}"] if decided else []
    problems = [f"{at}.decisions[{k}]: no such unit" for k in decided if k not in options]
    problems += [f"{at}.decisions[{k}]: {o!r} is not one of {sorted(options[k])}"
                 for k, o in decided.items() if k in options and o not in options[k]]
    missing = [k for k in options if k not in decided]
    if missing:
        problems.append(f"{at}.decisions: {len(missing)} unit(s) undecided, e.g. {missing[:3]}")
    return problems


def plan_problems(plan: Any, where: str) -> list[str]:
    """Every violation in a ``Plan``, one line each (empty if the backend can use it)."""
    problems = _number(plan.batch, f"{where}.shape.batch", integer=True, positive=True)
    problems += _number(plan.seq_len, f"{where}.shape.seq_len", integer=True, positive=True)
    problems += _number(plan.budget_bytes, f"{where}.budget.bytes", integer=True)
    if plan.seq_range is not None:
        lo, hi = plan.seq_range
        if not (isinstance(lo, int) and 1 <= lo <= hi == plan.seq_len):
            problems.append(f"{where}.shape.seq_range: {[lo, hi]} must be [lo, hi] with 1 <= lo <= hi and hi "
                            f"the planned seq_len {plan.seq_len}")
    problems += _number(plan.gc_bytes, f"{where}.references.gc_bytes", integer=True)
    problems += _number(plan.store_bytes, f"{where}.references.store_bytes", integer=True)
    problems += _number(plan.risk_budget, f"{where}.risk_budget")
    problems += _strings(plan.codecs, f"{where}.codecs") + _strings(plan.notes, f"{where}.notes")
    problems += [f"{where}.units: key {k!r} appears more than once"
                 for k in _duplicates(u.key for u in plan.units)]
    for i, u in enumerate(plan.units):
        problems += _plan_unit(u, f"{where}.units[{i}][{u.key}]")
    if not any(not b.skip for b in plan.buckets):
        problems.append(f"{where}.buckets: no bucket with decisions; a plan needs at least one "
                        "besides the zero (skip) bucket")
    problems += [f"{where}.buckets: name {n!r} appears more than once"
                 for n in _duplicates(b.bucket.name for b in plan.buckets)]
    options = {u.key: {o.option for o in u.options} for u in plan.units}
    for i, b in enumerate(plan.buckets):
        at = f"{where}.buckets[{i}][{b.bucket.name}]"
        problems += _plan_bucket(b, at) + _decisions(b, options, at)
    for name in ("trained_param_bytes", "frozen_param_bytes"):  # None: not recorded
        if getattr(plan, name, None) is not None:
            problems += _number(getattr(plan, name), f"{where}.parameters.{name.replace('_param', '')}",
                                integer=True)
    return problems + _timeline(plan, f"{where}.timeline")


def _timeline(plan: Any, at: str) -> list[str]:
    """A plan's ``timeline``, if it has one: a value per phase in every series, and
    each series' maximum the peak the plan predicts for it (``solver.timeline``)."""
    from .planfile import TIMELINE_GC, TIMELINE_STORE_ALL

    timeline = getattr(plan, "timeline", None)
    if timeline is None:
        return []
    problems = _strings(timeline.phases, f"{at}.phases")
    peaks = {TIMELINE_GC: plan.gc_bytes, TIMELINE_STORE_ALL: plan.store_bytes,
             **{b.bucket.name: b.memory_bytes for b in plan.buckets if not b.skip}}
    for name, values in timeline.bytes.items():
        if name not in peaks:
            problems.append(f"{at}.bytes: {name!r} is not gc, store-all or a bucket with decisions")
        elif len(values) != len(timeline.phases):
            problems.append(f"{at}.bytes.{name}: {len(values)} values for {len(timeline.phases)} phases")
        elif values and max(values) != peaks[name]:
            problems.append(f"{at}.bytes.{name}: peaks at {max(values)} bytes, not the predicted {peaks[name]}")
    return problems
