"""The hilore backend applies plans inside Inductor: correct gradients, predicted bytes, real recompute."""

from __future__ import annotations

import pytest
import torch

from hilore_compiler.backend import BackendOptions, HiLoReBackend
from hilore_compiler.models import build_model, token_logprobs
from hilore_compiler.backend.runtime import exposure
from hilore_compiler.solver import fixed_plan
from hilore_compiler.tracefile import Trace
from hilore_compiler.passes.tracer import TraceConfig, trace

BATCH, SEQ = 2, 32
CONFIG = TraceConfig(repeats=1, warmup=0, verbose=False, codecs=("bf16", "int8"))


def _ids(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(model, ids):
    return -token_logprobs(model(ids), ids).mean()


def recompute_heavy(trace: Trace) -> dict[str, str]:
    """Recompute every unit the rules allow; store the rest."""
    decisions: dict[str, str] = {}
    layer = {u.key: u.layer for u in trace.units}
    for unit in trace.units:
        ok = unit.recomputable and all(
            decisions[k] == "store" or (decisions[k] == "recompute" and layer[k] == unit.layer)
            for k in unit.recompute_from
        )
        decisions[unit.key] = "recompute" if ok else "store"
    return decisions


def two_bucket_plan(trace: Trace, low: dict[str, str], high: dict[str, str]):
    """b0 (low exposure) gets ``low``, b1 (high exposure) gets ``high``."""
    return fixed_plan(trace, {"b0": low, "b1": high}, buckets=2)


def store_all(trace: Trace) -> dict[str, str]:
    return {u.key: "store" for u in trace.units}


def mixed_codec_plan(trace: Trace) -> dict[str, str]:
    """int8 everywhere (norm statistics stored), but the embedding and layer
    1's MLP input and gate recomputed and its residual stored: a pattern the
    solver picks on the bench model. Then one full-precision value (layer 0's
    o_proj, layer 1's up_proj) can feed two payloads in backward, and min-cut
    once saved it and re-ran both encodes instead of saving the payloads."""
    decisions = {u.key: "compress:int8" if "int8" in u.codecs and ":rsqrt:" not in u.key else "store"
                 for u in trace.units}
    pattern = {"embed_tokens:embedding:0": "recompute", "layers.1:add:0": "store",
               "layers.1.post_attention_layernorm:mul:1": "recompute",
               "layers.1.mlp.gate_proj:mm:0": "recompute"}
    for key, option in pattern.items():
        assert key in decisions, key
        decisions[key] = option
    return decisions


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def grad_of(model, compiled, ids, bucket: str | None = None) -> torch.Tensor:
    model.zero_grad()
    if bucket is None:
        _loss(compiled, ids).backward()
    else:
        with exposure(bucket):
            _loss(compiled, ids).backward()
    return grads(model)


def seeded_grads(model, compiled, ids, buckets, seed: int = 123) -> list[torch.Tensor]:
    """The gradient under each bucket's variant, each run from the same RNG state
    (dropout draws the same masks: a plan's recompute must replay them)."""
    results = []
    for bucket in buckets:
        torch.manual_seed(seed)
        results.append(grad_of(model, compiled, ids, bucket))
    return results


@pytest.fixture(scope="module")
def tiny():
    model = build_model("tiny")
    ids = _ids()
    return model, ids, trace(model, [ids], lambda out: -token_logprobs(out, ids).mean(), config=CONFIG)


@pytest.fixture(scope="module")
def tiny_reference(tiny):
    model, ids, _ = tiny
    return grad_of(model, torch.compile(model), ids)


@pytest.fixture(scope="module")
def tiny_two_buckets(tiny):
    """One backend, two variants: recompute-heavy (b0) and store-all (b1)."""
    model, ids, traced = tiny
    plan = two_bucket_plan(traced, recompute_heavy(traced), store_all(traced))
    backend = HiLoReBackend({"plan": plan})
    return backend, torch.compile(model, backend=backend), plan


@pytest.mark.slow
def test_recompute_and_store_variants_match_plain_compile(tiny, tiny_reference, tiny_two_buckets):
    model, ids, _ = tiny
    _, compiled, _ = tiny_two_buckets
    for bucket in ("b0", "b1", None):
        got = grad_of(model, compiled, ids, bucket)
        torch.testing.assert_close(got, tiny_reference, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_saved_bytes_match_prediction_and_differ_by_bucket(tiny, tiny_two_buckets):
    model, ids, _ = tiny
    backend, compiled, plan = tiny_two_buckets
    grad_of(model, compiled, ids, "b0")
    (graph,) = backend.graphs
    saved = {b: graph.actual_saved_bytes(b) for b in ("b0", "b1")}
    for bucket, actual in saved.items():
        predicted = graph.predicted_saved_bytes(bucket)
        assert actual == pytest.approx(predicted, rel=0.05), bucket
    assert saved["b0"] < 0.8 * saved["b1"]
    (low,) = [r for r in graph.records if r.bucket == "b0"]
    assert low.counts["recompute"] > 0 and low.matched == low.units


@pytest.mark.slow
def test_a_store_all_variant_is_min_cuts_partition_from_the_capture(tiny, tiny_two_buckets):
    """Storing every unit is the partition the units were read from: it is not made twice."""
    model, ids, _ = tiny
    backend, compiled, _ = tiny_two_buckets
    grad_of(model, compiled, ids, "b1")
    records = {r.bucket: r for r in backend.graphs[0].records}
    assert records["b1"].counts["store"] == records["b1"].units > 0
    assert not records["b1"].ran_min_cut and records["b0"].ran_min_cut
    assert records["b1"].saved_bytes == records["b1"].default_saved_bytes


@pytest.mark.slow
def test_switching_buckets_does_not_recompile(tiny, tiny_two_buckets):
    model, ids, _ = tiny
    backend, compiled, _ = tiny_two_buckets
    grad_of(model, compiled, ids, "b1")
    compiles = len(backend.graphs)
    for bucket in ("b0", "b1", "b0", "zero"):
        grad_of(model, compiled, ids, bucket)
    assert len(backend.graphs) == compiles == 1


@pytest.mark.slow
def test_recompute_really_happens_in_backward(tiny, tiny_two_buckets):
    model, ids, traced = tiny
    backend, compiled, plan = tiny_two_buckets
    grad_of(model, compiled, ids, "b0")
    flops = {r.bucket: r.backward_flops for r in backend.graphs[0].records}
    recomputed = [u for u in traced.units if plan.decisions("b0")[u.key] == "recompute"]
    # Recomputed matmuls run again in backward: about the trace's FLOPs more.
    extra = flops["b0"] - flops["b1"]
    assert flops["b1"] > 0 and extra > 0
    assert extra == pytest.approx(sum(u.recompute_flops for u in recomputed), rel=0.25)


@pytest.mark.slow
def test_compressed_plan_keeps_gradient_direction_and_saves_payloads(tiny, tiny_reference):
    model, ids, traced = tiny
    plan = fixed_plan(traced, {"b0": mixed_codec_plan(traced)}, buckets=1)
    backend = HiLoReBackend({"plan": plan, "strict": True})
    got = grad_of(model, torch.compile(model, backend=backend), ids)
    cosine = torch.nn.functional.cosine_similarity(got, tiny_reference, dim=0)
    assert cosine >= 0.999
    assert not torch.equal(got, tiny_reference)  # int8 really changed something
    (graph,) = backend.graphs
    record = graph.records[0]
    assert record.counts["compress"] > 0 and record.counts["recompute"] > 0
    # Payloads, not the full-precision roots min-cut could re-encode from.
    assert graph.actual_saved_bytes("b0") == pytest.approx(graph.predicted_saved_bytes("b0"), rel=0.02)
    assert graph.actual_saved_bytes("b0") < 0.5 * record.default_saved_bytes


@pytest.mark.slow
def test_second_architecture_gradients_match():
    model = build_model("gpt-tiny")
    ids = _ids()
    traced = trace(model, [ids], lambda out: -token_logprobs(out, ids).mean(), config=CONFIG)
    reference = grad_of(model, torch.compile(model), ids)
    plan = fixed_plan(traced, {"b0": recompute_heavy(traced)}, buckets=1)
    got = grad_of(model, torch.compile(model, backend=HiLoReBackend({"plan": plan})), ids)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_dropout_recompute_plan_equals_store_plan_with_same_seed():
    model = build_model("llama-tiny-dropout").train()
    ids = _ids()
    traced = trace(model, [ids], lambda out: -token_logprobs(out, ids).mean(), config=CONFIG)
    assert any(not u.recomputable for u in traced.units)  # the dropout masks
    plan = two_bucket_plan(traced, recompute_heavy(traced), store_all(traced))
    compiled = torch.compile(model, backend=HiLoReBackend({"plan": plan}))
    recomputed, stored = seeded_grads(model, compiled, ids, ("b0", "b1"))
    torch.testing.assert_close(recomputed, stored, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_plan_for_another_model_is_refused(tiny):
    _, _, traced = tiny
    other = build_model("gpt-tiny")
    plan = fixed_plan(traced, {"b0": store_all(traced)}, buckets=1)
    compiled = torch.compile(other, backend=HiLoReBackend({"plan": plan}))
    with pytest.raises(Exception, match="does not match this graph"):
        compiled(_ids())


@pytest.mark.slow
def test_plan_for_a_wider_model_with_the_same_keys_is_refused(tiny):
    _, _, traced = tiny
    wider = build_model("tiny", hidden=128, intermediate=256)  # same unit keys, other sizes
    plan = fixed_plan(traced, {"b0": store_all(traced)}, buckets=1)
    compiled = torch.compile(wider, backend=HiLoReBackend({"plan": plan}))
    with pytest.raises(Exception, match="made for another model"):
        compiled(_ids())


def test_trace_codecs_must_hold_every_codec_a_plan_may_use():
    options = BackendOptions.from_mapping({"codecs": ["int8"], "trace_codecs": ["bf16", "int8"]})
    assert options.profiled_codecs == ("bf16", "int8") and options.codecs == ("int8",)
    assert BackendOptions.from_mapping({"codecs": ["int8"]}).profiled_codecs == ("int8",)
    with pytest.raises(ValueError, match=r"codecs \['int4'\] are not in trace_codecs \['bf16', 'int8'\]"):
        BackendOptions.from_mapping({"codecs": ["int4"], "trace_codecs": ["bf16", "int8"]})
    with pytest.raises(ValueError, match=r"codecs \['bf16'\] are not in trace_codecs \['int8'\]"):
        BackendOptions.from_mapping({"trace_codecs": ["int8"]})  # the default codecs are bf16 and int8


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(ValueError, match="known options.*memory_budget"):
        BackendOptions.from_mapping({"memroy_budget": "1x-gc"})


def test_cost_model_option_takes_measured_or_a_known_gpu_roofline():
    assert BackendOptions.from_mapping({}).cost_model == "measured"
    assert BackendOptions.from_mapping({"cost_model": "roofline:h200"}).cost_model == "roofline:h200"
    assert BackendOptions.from_mapping({"cost_model": "roofline:l40s"}).cost_model == "roofline:l40s"
    with pytest.raises(ValueError, match=r"'cost_model' must be 'measured' or 'roofline:<device>' .*l40s"):
        BackendOptions.from_mapping({"cost_model": "roofline:h1000"})


@pytest.mark.slow
def test_a_roofline_zero_config_plan_runs_nothing_while_planning(tmp_path, monkeypatch):
    """cost_model='roofline:...' plans from shapes alone: no unit's region is re-run
    and the forward is not recorded, yet every unit gets a decision."""
    import hilore_compiler.passes.values as values

    def no_recording(*args, **kwargs):
        raise AssertionError("a roofline plan recorded forward values")

    monkeypatch.setattr(values._ForwardRecorder, "run", no_recording)
    model = build_model("tiny")
    backend = HiLoReBackend({"cost_model": "roofline:h100", "cache_dir": str(tmp_path), "strict": True,
                             "verbose": False, "buckets": 1})
    compiled = torch.compile(model, backend=backend)
    (-token_logprobs(compiled(_ids()), _ids()).mean()).backward()
    graph = backend.graphs[0]
    record = graph.records[0]
    assert record.units > 0 and record.matched == record.units
    assert {u.recompute_source for u in graph.planner.trace.units if u.recomputable} == {"roofline:h100"}
