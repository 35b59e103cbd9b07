"""Options of ``torch.compile(model, backend="hilore", options={...})``."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..planfile import Plan
from ..tracefile import Trace
from .cache import default_cache_dir
from ..validate import plan_problems, raise_problems
from ..vocabulary import DEFAULT_CODECS, check_codecs


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    """Options of ``torch.compile(..., backend="hilore", options={...})``."""

    #: A plan (path or ``Plan``), or a list of them, one per length bucket
    #: (``hilore plan --seq-len LO:HI --length-buckets N``). None: trace,
    #: profile and solve on first compile.
    plan: str | os.PathLike | Plan | tuple[str | os.PathLike | Plan, ...] | None = None
    #: The plan's trace (a ``Trace`` or a path to its JSON) to re-solve from when
    #: a call's batch or length lies outside what the plan was made for. None:
    #: the trace a ``Plan`` from ``solve`` carries; a plan read from a file
    #: carries none, and such a call is then compiled by plain Inductor.
    trace: str | os.PathLike | Trace | None = None
    #: Activation memory budget: ``"1.10x-gc"``, ``"0.5x-store"`` or ``"6GiB"``.
    memory_budget: str = "1.10x-gc"
    #: Risk budget per bucket; None takes the solver's calibrated default.
    risk_budget: float | None = None
    #: Codecs the plan may use; empty means store/recompute only.
    codecs: tuple[str, ...] = DEFAULT_CODECS
    #: Codecs the trace profiles, a superset of ``codecs``; None: ``codecs``.
    #: Plans that allow fewer codecs then share one trace (and its measured
    #: costs) with plans that allow them all.
    trace_codecs: tuple[str, ...] | None = None
    #: How a graph the backend plans itself is costed: ``"measured"`` times each
    #: unit's recompute and codecs here; ``"roofline:h100"`` (``l40s``, ``a100``
    #: and the rest of ``passes.costmodel.DEVICES``) predicts them from FLOPs,
    #: bytes and the device's peaks and runs nothing: for CI, a fake-CUDA graph,
    #: or where profiling is unwanted. ``"roofline:cpu"`` makes CPU plans that
    #: depend on shapes alone: every process makes the same plan however busy
    #: the machine is, at the price of costs predicted rather than measured.
    cost_model: str = "measured"
    #: Number of non-zero exposure buckets (one compiled variant each at most).
    buckets: int = 3
    #: Where zero-config plans and traces are cached, keyed by graph and
    #: options: ``$HILORE_CACHE_DIR`` or ``~/.cache/hilore`` (also when empty).
    cache_dir: str = field(default_factory=default_cache_dir)
    #: Say on stderr what was planned and where the plan is.
    verbose: bool = True
    #: Raise instead of falling back to Inductor's own choice when a plan does
    #: not fit the graph (units without a decision, plan units not in the graph)
    #: or a graph cannot be planned.
    strict: bool = False
    #: The loss's own peak as a multiple of the compiled graph's outputs'
    #: bytes, when the loss runs after the graph (``bench.measure.loss_side``
    #: measures it; 3.0 for token log-probs + the GRPO loss in fp32). None,
    #: the default: modelled from the outputs' dtype as fp32 token log-probs
    #: (``solver.lossmodel``: 3 for fp32 logits, 8 for bf16); 0: the step's
    #: peak is modelled without a loss (a graph that returns its loss).
    loss_ratio: float | None = None
    #: GC's measured step peak in bytes: ``x-gc`` budgets are then multiples
    #: of it rather than of GC's predicted peak. None: the prediction.
    gc_peak_bytes: int | None = None
    #: The longest sequence length the plans must hold at (the memory ceiling
    #: is checked there). None: the longest seen; a dynamic graph meeting a
    #: longer one re-solves its plans from the trace then (``solver/lengths``).
    max_seq_len: int | None = None
    #: The shortest sequence length plans are made for. None: the shortest seen.
    min_seq_len: int | None = None
    #: Sample sequence lengths of a typical run, over which a range plan's
    #: recovery time is minimised. None: uniform over the range.
    length_mix: tuple[int, ...] | None = None
    #: A dynamic graph's range of lengths may be split into at most this many
    #: length buckets, each with plans of its own, chosen per call like
    #: exposure buckets; the solver splits only where it pays (``solver/lengths``).
    length_buckets: int = 1
    #: Under ``torch.distributed`` with more than one rank: rank 0 traces,
    #: profiles and solves each zero-config graph, and the other ranks run its
    #: plans, read from the process group's store (``distributed/plan_share``),
    #: so timing noise cannot give ranks different plans. False: every rank plans.
    share_plans: bool = True
    #: How long a rank other than 0 waits for rank 0's plan of a graph once rank
    #: 0 started on it (it may be profiling) before it plans the graph itself,
    #: with a warning.
    share_timeout_s: float = 300.0

    @property
    def profiled_codecs(self) -> tuple[str, ...]:
        """The codecs the trace profiles: ``trace_codecs``, or ``codecs`` when None."""
        return self.codecs if self.trace_codecs is None else self.trace_codecs

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> BackendOptions:
        """Build options from a user dict; unknown keys name the known ones."""
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown hilore backend option(s) {unknown}; known options: {known}")
        for name, value in options.items():
            accepts, expected = _EXPECTED.get(name, (lambda v: True, ""))
            if not accepts(value):
                raise ValueError(f"hilore backend option {name!r} must be {expected}, "
                                 f"got {type(value).__name__} {_short_repr(value)}")
        _check_values(options)
        if isinstance(options.get("plan"), (list, tuple)):
            options["plan"] = tuple(options["plan"])
        for i, plan in enumerate(_as_tuple(options.get("plan"))):
            if isinstance(plan, Plan):
                raise_problems(plan_problems(plan, "options['plan']" + (f"[{i}]" if i else "")))
        for name in ("codecs", "trace_codecs"):
            if options.get(name) is not None:
                options[name] = tuple(options[name])
        traced = options.get("trace_codecs")
        codecs = options["codecs"] if "codecs" in options else _default("codecs")
        missing = [c for c in codecs if c not in traced] if traced is not None else []
        if missing:
            raise ValueError(f"hilore backend options: codecs {missing} are not in trace_codecs "
                             f"{list(options['trace_codecs'])}; the trace must profile every codec a plan may use")
        if options.get("length_mix") is not None:
            options["length_mix"] = tuple(options["length_mix"])
        lo, hi = options.get("min_seq_len"), options.get("max_seq_len")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"hilore backend options: min_seq_len {lo} is above max_seq_len {hi}")
        if "cache_dir" in options:
            options["cache_dir"] = os.fspath(options["cache_dir"])
        return cls(**options)


def _check_values(options: Mapping[str, Any]) -> None:
    """Parse the options whose strings have a grammar, with the words ``hilore plan`` uses,
    so that a typo fails here, before anything is profiled or cached."""
    from ..codecs import registered_codecs
    from ..solver import parse_budget, parse_risk_budget

    checks: dict[str, Callable[[Any], Any]] = {
        "memory_budget": parse_budget,
        "risk_budget": parse_risk_budget,
        "codecs": lambda v: check_codecs(v, registered_codecs(), "hilore knows"),
        "trace_codecs": lambda v: v is None or check_codecs(v, registered_codecs(), "hilore knows"),
    }
    for name, check in checks.items():
        if name in options:
            try:
                check(options[name])
            except ValueError as error:
                raise ValueError(f"hilore backend option {name!r}: {error}") from None


def _short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a wrong object (a whole model, a
    trace) should name itself in an error, not fill the screen."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _default(name: str) -> Any:
    """The default of the ``BackendOptions`` field ``name``."""
    return next(f.default for f in dataclasses.fields(BackendOptions) if f.name == name)


def _as_tuple(value: Any) -> tuple:
    """A plan option as a tuple of plans or paths (a list: length buckets)."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike)) and os.fspath(value) != ""


def _codec_names(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(c, str) and c for c in value)


def _known_cost_model(value: str) -> bool:
    from ..passes.costmodel import device_spec

    if value == "measured":
        return True
    try:
        device_spec(value)
    except ValueError:
        return False
    return True


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


#: Per option: a test of the value given, and what it should have been, for the error.
_EXPECTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "plan": (lambda v: v is None or all(isinstance(p, Plan) or _path(p) for p in _as_tuple(v)) and _as_tuple(v) != (),
             "a Plan, a path to a plan JSON, a list of them (one per length bucket), or None"),
    "trace": (lambda v: v is None or isinstance(v, Trace) or _path(v), "a Trace, a path to a trace JSON, or None"),
    "memory_budget": (lambda v: isinstance(v, str) and v.strip() != "",
                      'a string such as "1.10x-gc", "0.5x-store" or "6GiB"'),
    "risk_budget": (lambda v: v is None or _number(v) or (isinstance(v, str) and v.strip() != ""),
                    'a number >= 0, None (the calibrated default), or a string such as "cos>=0.999"'),
    "codecs": (_codec_names, 'a list of codec names such as ["bf16", "int8"] (a list, even for one codec)'),
    "trace_codecs": (lambda v: v is None or _codec_names(v),
                     "a list of codec names (a superset of codecs), or None (the same as codecs)"),
    "cost_model": (lambda v: isinstance(v, str) and _known_cost_model(v),
                   "'measured' or 'roofline:<device>' (hilore_compiler.passes.costmodel.DEVICES: h100, l40s, "
                   "cpu, ...)"),
    "buckets": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                "a positive int (the number of non-zero exposure buckets)"),
    "cache_dir": (_path, "a folder path (str or os.PathLike)"),
    "verbose": (lambda v: isinstance(v, bool), "True or False"),
    "strict": (lambda v: isinstance(v, bool), "True or False"),
    "loss_ratio": (lambda v: v is None or _number(v),
                   "a number >= 0 (the loss's peak over the graph outputs' bytes) or None (modelled)"),
    "gc_peak_bytes": (lambda v: v is None or _positive_int(v), "a positive int (GC's measured peak in bytes) or None"),
    "max_seq_len": (lambda v: v is None or _positive_int(v), "a positive int (tokens per sequence) or None"),
    "min_seq_len": (lambda v: v is None or _positive_int(v), "a positive int (tokens per sequence) or None"),
    "length_mix": (lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and all(map(_positive_int, v))),
                   "a non-empty list of sequence lengths (positive ints), or None (uniform over the range)"),
    "length_buckets": (_positive_int, "a positive int (the most length buckets of a dynamic graph)"),
    "share_plans": (lambda v: isinstance(v, bool), "True or False"),
    "share_timeout_s": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
}

