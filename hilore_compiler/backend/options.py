"""Options of ``torch.compile(model, backend="hilore", options={...})``."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..planfile import Plan


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
    #: Where zero-config plans and traces are cached, keyed by graph and options.
    cache_dir: str = field(default_factory=lambda: os.environ.get(
        "HILORE_CACHE_DIR", str(Path.home() / ".cache" / "hilore")))
    #: Say on stderr what was planned and where the plan is.
    verbose: bool = True
    #: Raise instead of falling back to Inductor's own choice when a plan does
    #: not fit the graph (units without a decision, plan units not in the graph)
    #: or a graph cannot be planned.
    strict: bool = False

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> BackendOptions:
        """Build options from a user dict; unknown keys name the known ones."""
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown hilore backend option(s) {unknown}; known options: {known}")
        if "codecs" in options:
            options["codecs"] = tuple(options["codecs"])
        return cls(**options)
