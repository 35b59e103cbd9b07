"""Search PyTorch's ``activation_memory_budget`` so that its measured peak matches a target.

The budget (0: recompute all it can, 1: Inductor's default) is read once per
process when the graph compiles, so every probe is a worker process of its
own. Bisection over [0, 1] assumes the peak grows with the budget, which is
what the knapsack it parametrises is built to do; the probe kept is the one
with the largest peak that fits the target (within ``tolerance``), or, if
none fits, the one with the smallest peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Relative slack when comparing a probe's peak with the target: the RSS
#: high-water mark moves by a few pages between identical steps, and a probe
#: a hair above HiLoRe's peak is a fairer match than one far below it.
DEFAULT_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """One tried budget and the median warm-up peak it gave (None: it failed)."""

    budget: float
    peak_bytes: float | None
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSearch:
    """What the search tried and what it chose."""

    target_bytes: float
    tolerance: float
    probes: tuple[Probe, ...]
    #: The budget of the worker kept for the rounds; None if every probe failed.
    chosen: float | None

    def to_json(self) -> dict[str, Any]:
        return {"target_bytes": self.target_bytes, "tolerance": self.tolerance, "chosen": self.chosen,
                "probes": [{"budget": p.budget, "peak_bytes": p.peak_bytes, "error": p.error}
                           for p in self.probes]}


def choose(probes: list[Probe], target_bytes: float, tolerance: float) -> Probe | None:
    """The largest-peak probe that fits, else the smallest-peak one; None if all failed."""
    done = [p for p in probes if p.peak_bytes is not None]
    fits = [p for p in done if p.peak_bytes <= target_bytes * (1 + tolerance)]
    if fits:
        return max(fits, key=lambda p: (p.peak_bytes, p.budget))
    return min(done, key=lambda p: (p.peak_bytes, p.budget), default=None)


def search_budget(probe: Callable[[float], Any], peak_of: Callable[[Any], float | None], *,
                  target_bytes: float, probes: int, progress: Callable[[str], None],
                  tolerance: float = DEFAULT_TOLERANCE) -> tuple[Any, BudgetSearch]:
    """Bisect the budget over ``probes`` worker processes; return the kept run and the record.

    ``probe(budget)`` starts a worker (a ``runner.MethodRun``), ``peak_of(run)``
    is its measured peak or None if it failed. Workers not kept are closed.
    """
    lo, hi = 0.0, 1.0
    tried: list[tuple[Probe, Any]] = []
    for _ in range(probes):
        budget = round((lo + hi) / 2, 4)
        run = probe(budget)
        peak = peak_of(run)
        tried.append((Probe(budget=budget, peak_bytes=peak, error=getattr(run, "error", None)), run))
        if peak is None:
            break  # a compile failure is not a memory answer; stop spending processes
        if peak <= target_bytes:
            lo = budget  # fits: the budget may grow
        else:
            hi = budget
        progress(f"pt-budget: budget {budget:g} -> peak {peak / 1e6:.1f} MB "
                 f"(target {target_bytes / 1e6:.1f} MB)")
    best = choose([p for p, _ in tried], target_bytes, tolerance)
    kept = next((run for p, run in tried if p is best), tried[-1][1])
    for _, run in tried:
        if run is not kept and getattr(run, "worker", None) is not None:
            run.worker.close()
            run.worker = None
    record = BudgetSearch(target_bytes=target_bytes, tolerance=tolerance,
                          probes=tuple(p for p, _ in tried), chosen=None if best is None else best.budget)
    if best is not None:
        progress(f"pt-budget: keeping budget {best.budget:g} (peak {best.peak_bytes / 1e6:.1f} MB)")
    return kept, record
