"""Search PyTorch's ``activation_memory_budget`` so that its measured peak matches a target.

The budget (0: recompute all it can, 1: Inductor's default) is read once per
process when the graph compiles, so every probe is a worker process of its
own. The measured peak does not grow monotonically with the budget (small
policy, T=2048, CPU: 0.0625 -> 243.8 MB, 0.125 -> 252.8, 0.25 -> 224.9,
0.5 -> 275.9), so bisection can walk away from the budgets that fit. The
search instead tries a small grid spread over [0, 1] and keeps the fastest
probe (median warm-up step seconds) whose peak fits the target (within
``tolerance``), or, if none fits, the one with the smallest peak.
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
    """One tried budget and the median warm-up peak and step seconds it gave (None: it failed)."""

    budget: float
    peak_bytes: float | None
    seconds: float | None = None
    error: str | None = None
    #: The searched method (``peers.SEARCHED``); ``budget`` is its knob.
    method: str = "pt-budget"


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
                "probes": [{"budget": p.budget, "peak_bytes": p.peak_bytes, "seconds": p.seconds,
                            "error": p.error} for p in self.probes]}


def grid(probes: int) -> list[float]:
    """``probes`` budgets at the midpoints of equal slices of [0, 1]: 4 -> 0.125, 0.375, 0.625, 0.875.

    Midpoints rather than the ends: budget 1 is Inductor's default (store-all,
    measured anyway) and 0 recomputes all it can (GC-like); one probe is 0.5.
    """
    return [round((i + 0.5) / probes, 4) for i in range(probes)]


def choose(probes: list[Probe], target_bytes: float, tolerance: float) -> Probe | None:
    """The fastest probe that fits, else the smallest-peak one; None if all failed.

    A probe without seconds (not measured) ranks after every timed one.
    """
    done = [p for p in probes if p.peak_bytes is not None]
    fits = [p for p in done if p.peak_bytes <= target_bytes * (1 + tolerance)]
    if fits:
        return min(fits, key=lambda p: (p.seconds is None, p.seconds or 0.0, p.peak_bytes, p.budget))
    return min(done, key=lambda p: (p.peak_bytes, p.budget), default=None)


def search_budget(probe: Callable[[float], Any], peak_of: Callable[[Any], float | None],
                  seconds_of: Callable[[Any], float | None], *, target_bytes: float, probes: int,
                  progress: Callable[[str], None], tolerance: float = DEFAULT_TOLERANCE,
                  budgets: list[float] | None = None, method: str = "pt-budget") -> tuple[Any, BudgetSearch]:
    """Try the ``grid(probes)`` budgets (or ``budgets``, another searched ``method``'s knob values),
    one worker process each; return the kept run and the record.

    ``probe(budget)`` starts a worker (a ``rounds.MethodRun``), ``peak_of(run)``
    and ``seconds_of(run)`` are its measured peak and step seconds, None if it
    failed. Only the best worker so far stays open: the others are closed as
    soon as they are beaten, so idle probes hold no memory during later ones.
    """
    tried: list[tuple[Probe, Any]] = []
    best: Probe | None = None
    for budget in grid(probes) if budgets is None else budgets:
        run = probe(budget)
        peak = peak_of(run)
        tried.append((Probe(budget=budget, peak_bytes=peak, seconds=seconds_of(run),
                            error=getattr(run, "error", None), method=method), run))
        best = choose([p for p, _ in tried], target_bytes, tolerance)
        _close_all_but(tried, best)
        if peak is None:
            break  # a compile failure is not a memory answer; stop spending processes
        progress(f"{method}: {budget:g} -> peak {peak / 1e6:.1f} MB, "
                 f"{tried[-1][0].seconds or 0.0:.3f} s/step (target {target_bytes / 1e6:.1f} MB)")
    kept = next((run for p, run in tried if p is best), tried[-1][1])
    record = BudgetSearch(target_bytes=target_bytes, tolerance=tolerance,
                          probes=tuple(p for p, _ in tried), chosen=None if best is None else best.budget)
    if best is not None:
        progress(f"{method}: keeping {best.budget:g} (peak {best.peak_bytes / 1e6:.1f} MB, "
                 f"{best.seconds or 0.0:.3f} s/step)")
    return kept, record


def _close_all_but(tried: list[tuple[Probe, Any]], best: Probe | None) -> None:
    """Close the worker of every probe but ``best`` (all of them if there is none yet)."""
    for p, run in tried:
        if p is not best and getattr(run, "worker", None) is not None:
            run.worker.close()
            run.worker = None
