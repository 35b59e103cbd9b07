"""Options of ``torch.compile(model, backend="hilore", options={...})``."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..planfile import Plan
from .cache import default_cache_dir
from ..validate import plan_problems, raise_problems


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    """Options of ``torch.compile(..., backend="hilore", options={...})``."""

    #: A plan (path or ``Plan``). None: trace, profile and solve on first compile.
    plan: str | os.PathLike | Plan | None = None
    #: A trace (path) to re-solve from when the plan was made for another shape.
    trace: str | os.PathLike | None = None
    #: Activation memory budget: ``"1.10x-gc"``, ``"0.5x-store"`` or ``"6GiB"``.
    memory_budget: str = "1.10x-gc"
    #: Risk budget per bucket; None takes the solver's calibrated default.
    risk_budget: float | None = None
    #: Codecs the plan may use; empty means store/recompute only.
    codecs: tuple[str, ...] = ("bf16", "int8")
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
    #: measures it; 3.0 for token log-probs + the GRPO loss in fp32). 0: the
    #: step's peak is modelled without the loss.
    loss_ratio: float = 0.0
    #: GC's measured step peak in bytes: ``x-gc`` budgets are then multiples
    #: of it rather than of GC's predicted peak. None: the prediction.
    gc_peak_bytes: int | None = None

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
                                 f"got {type(value).__name__} {value!r}")
        if isinstance(options.get("plan"), Plan):
            raise_problems(plan_problems(options["plan"], "options['plan']"))
        if "codecs" in options:
            options["codecs"] = tuple(options["codecs"])
        if "cache_dir" in options:
            options["cache_dir"] = os.fspath(options["cache_dir"])
        return cls(**options)


def _path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike)) and os.fspath(value) != ""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


#: Per option: a test of the value given, and what it should have been, for the error.
_EXPECTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "plan": (lambda v: v is None or isinstance(v, Plan) or _path(v), "a Plan, a path to a plan JSON, or None"),
    "trace": (lambda v: v is None or _path(v), "a path to a trace JSON, or None"),
    "memory_budget": (lambda v: isinstance(v, str) and v.strip() != "",
                      'a string such as "1.10x-gc", "0.5x-store" or "6GiB"'),
    "risk_budget": (lambda v: v is None or _number(v) or (isinstance(v, str) and v.strip() != ""),
                    'a number >= 0, None (the calibrated default), or a string such as "cos>=0.999"'),
    "codecs": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(c, str) and c for c in v),
               'a list of codec names such as ["bf16", "int8"] (a list, even for one codec)'),
    "buckets": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                "a positive int (the number of non-zero exposure buckets)"),
    "cache_dir": (_path, "a folder path (str or os.PathLike)"),
    "verbose": (lambda v: isinstance(v, bool), "True or False"),
    "strict": (lambda v: isinstance(v, bool), "True or False"),
    "loss_ratio": (_number, "a number >= 0 (the loss's peak over the graph outputs' bytes)"),
    "gc_peak_bytes": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
                      "a positive int (GC's measured peak in bytes) or None"),
}
