"""The paper's risk calibration: how much gradient error one layer's L adds per unit of exposure.

HiLoRe's reference calibration (``ChnIRuI/HiLoRe``, ``hilore/calibration.py`` ``fit`` and
``Initializer.calibrate`` in ``hilore/initialize.py``) in our own code. On each of ``count``
calibration microbatches (the reference: 16) the exact gradient (every layer R) is compared
with the gradient where one layer alone is captured and kept L, for every layer that has an L
tensor. Each pair observes

    x = exposure * reconstruction error      (exposure = sum over response tokens of |omega|)
    y = relative L2 error of the whole gradient

and each layer (the reference's group ``mlp/<layer>``) gets ``kappa = max(0, sum xy / sum x^2)``,
the least-squares slope through the origin, and ``mean_error``, its mean reconstruction error.
A step's L risk for the layer is then ``kappa * mean_error * exposure`` (``Calibration.risk``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..measure import gradient_fidelity


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationStep:
    """What one calibration step observed."""

    #: Every parameter's gradient, flattened (``measure.flat_grad``).
    gradient: torch.Tensor
    #: sum over response tokens of |omega| (``grpo.token_coefficients``).
    exposure: float
    #: Per layer: the L tensor's reconstruction error (``LayerBundle.reconstruction_error``).
    errors: Sequence[float]
    #: Per layer: the index of the L tensor among its saved tensors, None without one.
    selected: Sequence[int | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    """One layer's L on one calibration microbatch."""

    unit: int
    microbatch: int
    exposure: float
    reconstruction_error: float
    gradient_error: float
    selected: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """One layer's fitted L susceptibility."""

    kappa: float
    mean_error: float
    #: The L tensor's index among the layer's saved tensors, the same on every microbatch.
    selected: int

    def risk(self, exposure: float) -> float:
        """The layer's predicted gradient error under L in a step of this ``exposure``."""
        return self.kappa * self.mean_error * exposure


#: ``step(k, captures)``: one actor step on calibration microbatch ``k``, every layer kept as captured.
CalibrationRun = Callable[[int, Sequence[str]], CalibrationStep]


def calibrate(run: CalibrationRun, units: Sequence[int], layers: int, count: int) -> dict[int, Calibration]:
    """Observe each layer of ``units`` under L on ``count`` microbatches and ``fit`` them."""
    all_r = ["R"] * layers
    rows = []
    for k in range(count):
        exact = run(k, all_r).gradient
        for unit in units:
            captures = list(all_r)
            captures[unit] = "L"
            seen = run(k, captures)
            rows.append(Observation(unit=unit, microbatch=k, exposure=seen.exposure,
                                    reconstruction_error=seen.errors[unit],
                                    gradient_error=gradient_fidelity(seen.gradient, exact)[1],
                                    selected=seen.selected[unit]))
    return fit(rows, count)


def fit(rows: Sequence[Observation], count: int) -> dict[int, Calibration]:
    """Per layer, kappa (least squares through the origin, floored at 0) and the mean error.

    Raises ValueError, as the reference does, where a layer lacks ``count`` distinct
    microbatches, its L tensor moved between them, a measurement is not finite and
    non-negative, or its error grew with zero exposure (no slope explains it).
    """
    by_unit: dict[int, list[Observation]] = {}
    for row in rows:
        values = (row.exposure, row.reconstruction_error, row.gradient_error)
        if not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"calibration of layer {row.unit}: measurements must be finite and >= 0, got {values}")
        by_unit.setdefault(row.unit, []).append(row)
    result = {}
    for unit, samples in by_unit.items():
        if len(samples) != count or len({r.microbatch for r in samples}) != count:
            raise ValueError(f"calibration of layer {unit}: {count} distinct microbatches needed")
        selected = {r.selected for r in samples}
        if len(selected) != 1 or None in selected:
            raise ValueError(f"calibration of layer {unit}: its L tensor changed across microbatches ({selected})")
        points = [(r.exposure * r.reconstruction_error, r.gradient_error) for r in samples]
        denominator = sum(x * x for x, _ in points)
        if denominator == 0 and any(y > 0 for _, y in points):
            raise ValueError(f"calibration of layer {unit}: gradient error with zero exposure; L cannot be priced")
        kappa = 0.0 if denominator == 0 else max(0.0, sum(x * y for x, y in points) / denominator)
        result[unit] = Calibration(kappa=kappa, mean_error=statistics.fmean(r.reconstruction_error for r in samples),
                                   selected=selected.pop())
    return result
