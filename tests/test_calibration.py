"""Calibration writes measured, finite sensitivities the solver then uses."""

from __future__ import annotations

import torch

from hilore_compiler.passes.calibration import CalibrationConfig, calibrate, measured_error
from hilore_compiler.models import build_model, token_logprobs
from hilore_compiler.solver import solve
from hilore_compiler.passes.tracer import TraceConfig, trace


def test_calibration_measures_sensitivity_per_kind():
    model = build_model("tiny")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    advantages = torch.tensor([[1.0], [-0.5]])

    def loss(logits):
        return -(token_logprobs(logits, ids) * advantages).mean()

    traced = trace(model, [ids], loss, config=TraceConfig(repeats=1, warmup=0, verbose=False,
                                                          codecs=("bf16", "int8")))
    calibrated = calibrate(model, [ids], loss, traced, exposure=0.75,
                           config=CalibrationConfig(verbose=False))
    measured = [u for u in calibrated.units if u.sensitivity]
    assert len(measured) >= len(traced.units) // 2
    by_kind = {}
    for unit in measured:
        assert all(v >= 0 and v == v for v in unit.sensitivity.values())
        by_kind.setdefault(unit.kind, unit.sensitivity)
        assert unit.sensitivity == by_kind[unit.kind]  # shared across layers of a kind
    # int8 perturbs the gradient more than bf16 where both apply.
    both = [u.sensitivity for u in measured if {"bf16", "int8"} <= set(u.sensitivity)]
    assert both and sum(s["int8"] > s["bf16"] for s in both) > len(both) // 2
    assert all(p.grad is None for p in model.parameters())
    plan = solve(calibrated, budget="1.0x-store")
    assert not any(b.proxy_sensitivity for b in plan.buckets if not b.skip)

    # How per-unit errors combine (solver/risk.py): on a measured plan of many
    # compressed units, the squared errors add (quadrature); summing the
    # errors themselves (the triangle inequality) overstates it.
    units = [u for u in traced.units if "int8" in u.codecs and u.codecs["int8"].usable][:5]
    *single, together = measured_error(model, [ids], loss, traced, [
        *({u.key: "compress:int8"} for u in units), {u.key: "compress:int8" for u in units}])
    quadrature = sum(e * e for e in single) ** 0.5
    print(f"\nmulti-unit plan: measured {together:.3g}, quadrature {quadrature:.3g}, sum {sum(single):.3g}")
    assert 0.8 * quadrature < together < 1.25 * quadrature, (together, quadrature, single)
    assert abs(together - quadrature) < 0.5 * abs(sum(single) - together)  # closer than the plain sum
