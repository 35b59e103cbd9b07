"""The paper's profiling: measured time saved and marginal peak bytes per layer and action.

HiLoRe's reference initialisation (``ChnIRuI/HiLoRe``, ``hilore/initialize.py`` and
``hilore/profiling.py``) in our own code. A *trial* runs whole actor steps with a fixed capture
and fixed actions (``Trial``) and reports the mean seconds and the peak bytes (``measure_plan``).

- ``rank_units``: each layer's H and L alone, captured and kept, against the same capture with
  every layer R: the time it saves and what its capture costs over GC's peak, ranked by seconds
  saved per byte.
- ``choose_captures``: the captures that fit the budget's headroom over GC's peak, greedily in
  that rank, the headroom shared between H and L by ``h_fraction`` (the reference tries 0, 0.5, 1).
- ``plan_tables``: for one capture plan, each admitted action's time saved (utility, seconds)
  and marginal peak bytes against the same capture with every layer R; an action that saves no
  time is not admitted.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..measure import allocator_peak, measure_step
from .recovery import ACTIONS, AFTER_CAPTURE

#: The reference's capture headroom splits between H and L (share of the headroom for H).
H_FRACTIONS = (0.0, 0.5, 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """One plan's steps: mean seconds over the repeats, and the peak bytes."""

    seconds: float
    peak_bytes: int


#: ``trial(captures, actions) -> Measured``: whole steps run with these captures and actions.
Trial = Callable[[Sequence[str], Sequence[str]], Measured]


def measure_plan(step: Callable[[], None], reset: Callable[[], None], device: torch.device,
                 repeats: int) -> Measured:
    """``step`` once to warm up, then ``repeats`` timed steps (``reset`` before each, outside the clock).

    The peak: on CUDA the largest of the timed steps' (``measure.measure_step``); on CPU the
    allocator's count of one more step (``measure.allocator_peak``): the same in every process,
    whatever its malloc settings, where VmHWM measures a peak only in the bench's peak worker.
    """
    reset()
    step()
    samples = []
    for _ in range(repeats):
        reset()
        samples.append(measure_step(step, device))
    peak = max(s.peak_bytes for s in samples)
    if device.type == "cpu":
        reset()
        peak = allocator_peak(step)
    return Measured(seconds=statistics.mean(s.seconds for s in samples), peak_bytes=int(peak))


@dataclass(frozen=True, slots=True, kw_only=True)
class Ranked:
    """One layer's isolated H and L: (capture cost over GC's peak, seconds saved), or None."""

    unit: int
    costs: dict[str, tuple[float, float]]
    #: Seconds saved per byte of capture cost, the better of H and L (bytes floored at 1).
    score: float


def rank_units(trial: Trial, offered: Sequence[Sequence[str]], gc_peak: int) -> list[Ranked]:
    """Every layer's isolated H and L (where ``offered``), best score first, then by layer."""
    all_r = ["R"] * len(offered)
    ranked = []
    for unit, actions in enumerate(offered):
        costs, score = {}, 0.0
        for action in ("H", "L"):
            if action not in actions:
                continue
            captures = _one(all_r, unit, action)
            baseline, candidate = trial(captures, all_r), trial(captures, captures)
            benefit = baseline.seconds - candidate.seconds
            cost = max(0.0, max(baseline.peak_bytes, candidate.peak_bytes) - gc_peak)
            if benefit > 0:
                costs[action] = (cost, benefit)
                score = max(score, benefit / max(cost, 1.0))
        ranked.append(Ranked(unit=unit, costs=costs, score=score))
    return sorted(ranked, key=lambda row: (-row.score, row.unit))


def choose_captures(ranked: Sequence[Ranked], h_fraction: float, headroom: float, count: int) -> list[str]:
    """Captures in rank order while their cost fits: H from ``h_fraction`` of ``headroom``, else L from the rest."""
    captures = ["R"] * count
    h_left, l_left = headroom * h_fraction, headroom * (1 - h_fraction)
    for row in ranked:
        if "H" in row.costs and row.costs["H"][0] <= h_left:
            captures[row.unit] = "H"
            h_left -= row.costs["H"][0]
        elif "L" in row.costs and row.costs["L"][0] <= l_left:
            captures[row.unit] = "L"
            l_left -= row.costs["L"][0]
    return captures


@dataclass(slots=True, kw_only=True)
class CapturePlan:
    """One capture plan and its measured action tables (the reference's profile ``plan``)."""

    captures: tuple[str, ...]
    #: Per layer, the actions the allocator may take: R, and H/L where they saved time.
    admitted: tuple[tuple[str, ...], ...]
    #: (layers, 3) in ``ACTIONS``' columns: seconds saved over the all-R selection; R's is 0.
    utility: tuple[tuple[float, ...], ...]
    #: (layers, 3): peak bytes over the all-R selection's (``all_r``); R's is 0.
    memory: tuple[tuple[float, ...], ...]
    #: These captures with every layer R.
    all_r: Measured
    #: The dynamic scheduler's steps with this plan (``paper.PaperMethod``), once validated.
    validated: Measured | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"captures": list(self.captures), "admitted": [list(a) for a in self.admitted],
               "utility_seconds": [list(r) for r in self.utility],
               "marginal_peak_bytes": [list(r) for r in self.memory],
               "all_r_seconds": self.all_r.seconds, "all_r_peak_bytes": self.all_r.peak_bytes}
        if self.validated is not None:
            out.update(validated_seconds=self.validated.seconds, validated_peak_bytes=self.validated.peak_bytes)
        return out


def plan_tables(trial: Trial, captures: Sequence[str], offered: Sequence[Sequence[str]],
                all_r: Measured) -> CapturePlan:
    """``captures``' tables: each offered action the capture keeps, alone, against ``all_r``."""
    base = ["R"] * len(captures)
    admitted, utility, memory = [], [], []
    for unit, actions in enumerate(offered):
        saved, cost, kept = [0.0] * len(ACTIONS), [0.0] * len(ACTIONS), ["R"]
        for action in ("H", "L"):
            if action not in actions or action not in AFTER_CAPTURE[captures[unit]]:
                continue
            measured = trial(captures, _one(base, unit, action))
            benefit = all_r.seconds - measured.seconds
            if benefit > 0:
                column = ACTIONS.index(action)
                saved[column], cost[column] = benefit, max(0.0, measured.peak_bytes - all_r.peak_bytes)
                kept.append(action)
        admitted.append(tuple(kept))
        utility.append(tuple(saved))
        memory.append(tuple(cost))
    return CapturePlan(captures=tuple(captures), admitted=tuple(admitted), utility=tuple(utility),
                       memory=tuple(memory), all_r=all_r)


def _one(base: Sequence[str], unit: int, action: str) -> list[str]:
    out = list(base)
    out[unit] = action
    return out
