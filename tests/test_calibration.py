"""Calibration writes measured, finite sensitivities the solver then uses."""

from __future__ import annotations

import math

import pytest
import torch

from hilore_compiler.passes.calibration import CalibrationConfig, calibrate, measured_error, plan_gradients
from hilore_compiler.models import build_model, token_logprobs
from hilore_compiler.planfile import BucketSpec
from hilore_compiler.solver import solve
from hilore_compiler.solver.mix import bucket_shares
from hilore_compiler.passes.tracer import TraceConfig, trace


def _batch(seed: int):
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))


def _loss(ids, advantages):
    def loss(logits):
        return -(token_logprobs(logits, ids) * advantages).mean()
    return loss


@pytest.fixture(scope="module")
def traced_tiny():
    model = build_model("tiny")
    ids = _batch(0)
    traced = trace(model, [ids], _loss(ids, torch.tensor([[1.0], [-0.5]])),
                   config=TraceConfig(repeats=1, warmup=0, verbose=False, codecs=("bf16", "int8")))
    return model, traced


@pytest.mark.slow
def test_calibration_measures_sensitivity_per_kind(traced_tiny):
    model, traced = traced_tiny
    ids = _batch(0)
    loss = _loss(ids, torch.tensor([[1.0], [-0.5]]))
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


@pytest.mark.slow
def test_a_buckets_error_scales_with_its_share_of_squared_exposure(traced_tiny):
    """solver/risk.py: samples' gradients and their errors are nearly orthogonal,
    so a plan run for one bucket's samples only leaves sqrt(q) of the error it
    leaves on the whole update, q the bucket's share of the squared exposures,
    not its mass share m (an error linear in the mass)."""
    model, traced = traced_tiny
    units = [u for u in traced.units if "int8" in u.codecs and u.codecs["int8"].usable][:5]
    plan = {u.key: "compress:int8" for u in units}
    # Two microbatches: low exposure 1 (samples of advantage +-1), high exposure 2.
    low, high = torch.tensor([[1.0], [-1.0]]), torch.tensor([[2.0], [-2.0]])
    exact_low, lossy_low = plan_gradients(model, [_batch(1)], _loss(_batch(1), low), traced, [{}, plan])
    exact_high, lossy_high = plan_gradients(model, [_batch(2)], _loss(_batch(2), high), traced, [{}, plan])
    # Several microbatches in one call: the update's summed gradient.
    both_exact, both_lossy = plan_gradients(model, [_batch(1)], _loss(_batch(1), low), traced, [{}, plan],
                                            more=[([_batch(2)], _loss(_batch(2), high))])
    assert torch.allclose(both_exact, exact_low + exact_high, rtol=1e-4, atol=1e-7)
    assert torch.allclose(both_lossy, lossy_low + lossy_high, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="shape"):
        plan_gradients(model, [_batch(1)], _loss(_batch(1), low), traced, [{}],
                       more=[([_batch(2)[:1]], _loss(_batch(2)[:1], high[:1]))])
    update = (exact_low + exact_high).norm()
    everywhere = float((lossy_low - exact_low + lossy_high - exact_high).norm() / update)
    low_only = float((lossy_low - exact_low).norm() / update)
    shares = {s.spec.name: s for s in bucket_shares(
        [BucketSpec("low", 0.0, 1.5, 1.0), BucketSpec("high", 1.5, math.inf, 2.0)], [1.0, 1.0, 2.0, 2.0])}
    assert shares["low"].error == pytest.approx(0.2) and shares["low"].mass == pytest.approx(1 / 3)
    predicted, linear = everywhere * math.sqrt(shares["low"].error), everywhere * shares["low"].mass
    print(f"\nlow bucket only: measured {low_only:.3g}, error-share rule {predicted:.3g}, mass rule {linear:.3g}")
    assert 0.75 * predicted < low_only < 1.33 * predicted, (low_only, predicted, linear)
    assert abs(low_only - predicted) < abs(low_only - linear)


def test_cli_calibrates_every_unit_on_several_microbatches(traced_tiny, tmp_path, capsys):
    from hilore_compiler.cli import main
    from hilore_compiler.tracefile import load_trace

    source, out = traced_tiny[1].save(tmp_path / "source.json"), tmp_path / "trace.json"
    common = ["calibrate", "--model", "tiny", "--trace", str(source), "--codecs", "int8"]
    assert main([*common, "--microbatches", "0", "-o", str(out)]) == 2
    assert "--microbatches" in capsys.readouterr().err and not out.exists()
    assert main([*common, "--per-unit", "--microbatches", "2", "-o", str(out)]) == 0
    calibrated = load_trace(out)
    usable = [u for u in calibrated.units if "int8" in u.codecs and u.codecs["int8"].usable]
    assert usable and all("int8" in u.sensitivity for u in usable)
    assert "(unit, codec) pairs" in calibrated.notes[-1]
    # Units of one kind get their own values, not one shared per kind.
    by_kind: dict[str, set[float]] = {}
    for u in usable:
        by_kind.setdefault(u.kind, set()).add(u.sensitivity["int8"])
    assert any(len(values) > 1 for values in by_kind.values())


@pytest.mark.slow
def test_joint_runner_gives_the_compiled_plans_gradients(traced_tiny, monkeypatch):
    """Calibration runs one joint graph under every plan (``JointRunner``)
    instead of compiling each plan; its gradients must be those the plans'
    partitioned graphs compute, over several microbatches too."""
    from hilore_compiler.passes import calibration

    model, traced = traced_tiny
    units = [u for u in traced.units if "int8" in u.codecs and u.codecs["int8"].usable]
    plans = [{}, {units[0].key: "compress:int8"}, {u.key: "compress:bf16" for u in units[:4]}]
    args = (model, [_batch(3)], _loss(_batch(3), torch.tensor([[1.0], [-0.5]])), traced, plans)
    more = [([_batch(4)], _loss(_batch(4), torch.tensor([[2.0], [-2.0]])))]
    runners = []
    capture = calibration.JointRunner.from_graph
    monkeypatch.setattr(calibration.JointRunner, "from_graph",
                        classmethod(lambda cls, *a: runners.append(capture(*a)) or runners[-1]))
    fast = plan_gradients(*args, more=more)
    assert runners and runners[0] is not None  # the fast path ran
    monkeypatch.setattr(calibration.JointRunner, "from_graph", classmethod(lambda cls, *a: None))
    compiled = plan_gradients(*args, more=more)
    for f, c in zip(fast, compiled):
        assert float((f - c).norm() / c.norm()) < 1e-5
    assert float((fast[1] - fast[0]).norm()) > 0  # the codec changed the gradient


def _joint_ops(partition_fn_of, model, ids) -> list[str]:
    """The ops of the joint graph the calibration's partitioner is handed."""
    from hilore_compiler.passes.capture import default_partition

    seen: list[str] = []

    def record(joint, joint_inputs, **kwargs):
        seen.extend(str(n.target) for n in joint.graph.nodes if n.op == "call_function")
        fw, bw, _ = default_partition(joint, joint_inputs, **kwargs)
        return fw, bw

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g),
                           partition_fn=partition_fn_of(record), decompositions=select_decomp_table())
    torch.compile(model, backend=backend, dynamic=False)(ids).sum().backward()
    return seen


@pytest.mark.slow
def test_calibration_sees_inductors_joint_passes_on_a_torch_without_the_override_hook(traced_tiny, monkeypatch):
    """torch 2.11's ``partition_fn`` has no ``partitioner_fn_override``; calibration
    then goes through the configured custom partitioner, after the same joint passes,
    so its units are the trace's. Without the passes the graph differs. On a torch
    with the hook, the 2.11 signature is simulated and must give the hook's graph."""
    import inspect

    from torch._inductor import compile_fx

    from hilore_compiler.passes.capture import inductor_partition

    model, _ = traced_tiny
    ids = _batch(3)
    real = compile_fx.partition_fn
    hooked = "partitioner_fn_override" in inspect.signature(real).parameters
    if hooked:
        with_hook = _joint_ops(inductor_partition, model, ids)

        def partition_fn(gm, joint_inputs, **kwargs):  # the 2.11 signature
            return real(gm, joint_inputs, **kwargs)

        monkeypatch.setattr(compile_fx, "partition_fn", partition_fn)
    without_hook = _joint_ops(inductor_partition, model, ids)
    if hooked:
        assert without_hook == with_hook
    assert _joint_ops(lambda recorder: recorder, model, ids) != without_hook  # the passes change the graph
