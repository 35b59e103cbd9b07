"""Block classes from the graph: alike layers are profiled once per class, both
classes of a stack alternating two attention kinds are planned, and the
planned compile's gradients are eager's with ``codecs: []`` (store and
recompute only)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.passes import tracer
from hilore_compiler.passes.tracer import TraceConfig, trace
from hilore_compiler.solver import cost_model, solve

transformers = pytest.importorskip("transformers")

LAYERS, VOCAB, BATCH, SEQ = 8, 64, 2, 16
CONFIG = TraceConfig(repeats=1, warmup=0, verbose=False, codecs=(), dynamic=False)


def two_kinds() -> nn.Module:
    """A tiny Qwen2 whose layers alternate sliding-window and full attention."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa", use_sliding_window=True,
        sliding_window=4, max_window_layers=0, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))
    return transformers.Qwen2ForCausalLM(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(out) -> torch.Tensor:
    return out.logits.float().log_softmax(-1).pow(2).mean()


def _grads(model: nn.Module, run) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    _loss(run(input_ids=_ids())).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def traced_and_profiled():
    calls = []
    profile = tracer._profile

    def counting(unit, *args, **kwargs):
        calls.append(unit.key)
        return profile(unit, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracer, "_profile", counting)
        traced = trace(two_kinds(), [], _loss, config=CONFIG, example_kwargs={"input_ids": _ids()})
    return traced, calls


@pytest.mark.slow
def test_alternating_layers_form_two_classes_profiled_once_each(traced_and_profiled):
    traced, calls = traced_and_profiled
    classes = sorted(traced.block_classes.values())
    # The first layer (next to the embedding, where transformers builds the
    # masks) and the last (next to the head) are like no other; between them
    # sliding and full attention alternate. Whether layer 1 is like 3 and 5
    # depends on transformers: 5.10 still builds something there, 5.25 not.
    assert (0,) in classes and (7,) in classes and (2, 4, 6) in classes
    assert any({3, 5} <= set(c) for c in classes)
    assert all(len({i % 2 for i in c}) == 1 for c in classes), classes  # one attention kind a class
    profiled_layers = {u.layer for u in traced.units if u.key in calls}
    assert profiled_layers == {None, *(c[0] for c in classes)}
    assert len(calls) < 0.8 * len(traced.units)
    by_key = {u.key: u for u in traced.units}
    for u in traced.units:
        if u.layer in (4, 6):
            first = by_key[u.key.replace(f"layers.{u.layer}.", "layers.2.")]
            assert (u.recompute_time_s, u.bytes, u.kind) == (first.recompute_time_s, first.bytes, first.kind)


@pytest.mark.slow
def test_both_classes_are_planned_and_gradients_match_eager(traced_and_profiled):
    traced, _ = traced_and_profiled
    costs = cost_model(traced, batch=BATCH, seq_len=SEQ, codecs=[])
    plan = solve(traced, budget=min(costs.gc_bytes, costs.store_bytes - 1), buckets=1, codecs=[])
    (bucket,) = [b for b in plan.buckets if not b.skip]
    layers = {u.key: u.layer for u in traced.units}
    recomputed = {layers[k] for k, o in bucket.decisions if o == "recompute"}
    assert recomputed & {2, 4, 6} and recomputed & {3, 5}
    model = two_kinds()
    reference = _grads(model, model)
    backend = HiLoReBackend({"verbose": False, "plan": plan})
    with warnings.catch_warnings():
        warnings.simplefilter("error", HiLoReWarning)
        got = _grads(model, torch.compile(model, backend=backend, dynamic=False))
    assert float((got - reference).norm() / reference.norm()) < 1e-5
    (record,) = backend.graphs[0].records
    assert record.matched == record.units == len(traced.units) and record.counts["recompute"] > 0
