"""The backend and the bench on a GPU: what a session lent one runs first (bench/gpu_session.sh).

Every check here also holds on the CPU, where the rest of the suite makes
it; what this module adds is the device. It is skipped without CUDA, and
``HILORE_TEST_DEVICE=cpu`` runs it on the CPU, which is how its own logic
is checked on machines without a GPU. Each compile is strict: a fallback
to plain Inductor, which would hide a CUDA failure behind a warning,
fails the test instead.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.bench.methods import MethodOptions
from hilore_compiler.bench.worker import Worker, WorkerConfig
from hilore_compiler.codecs import codec_names
from hilore_compiler.models import build_model, token_logprobs
from hilore_compiler.passes.tracer import TraceConfig, trace
from hilore_compiler.solver import fixed_plan

from test_backend import grad_of, recompute_heavy, seeded_grads, store_all, two_bucket_plan

DEVICE = os.environ.get("HILORE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs CUDA (HILORE_TEST_DEVICE=cpu runs it on the CPU)")

BATCH, SEQ = 2, 32
#: Other kernels than the CPU's (Triton's, cuBLAS's) round differently, so an
#: exact plan matches plain torch.compile to this, not bitwise.
EXACT = {"rtol": 1e-3, "atol": 1e-5}


def _ids(vocab: int = 256) -> torch.Tensor:
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return ids.to(DEVICE)


def _trace(model: torch.nn.Module, ids: torch.Tensor):
    codecs = tuple(c for c in ("bf16", "int8", "int4", "fp8") if c in codec_names(DEVICE))
    config = TraceConfig(repeats=1, warmup=0, verbose=False, codecs=codecs)
    return trace(model, [ids], lambda out: -token_logprobs(out, ids).mean(), config=config)


def _strict(options: dict) -> HiLoReBackend:
    return HiLoReBackend({"strict": True, "verbose": False, **options})


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


@pytest.fixture(scope="module")
def tiny():
    model = build_model("tiny", device=DEVICE)
    ids = _ids()
    traced = _trace(model, ids)
    return model, ids, traced, grad_of(model, torch.compile(model), ids)


def test_trace_runs_on_the_device_and_measures_every_codec(tiny):
    _, _, traced, _ = tiny
    assert traced.units and all(u.bytes_at_trace > 0 for u in traced.units)
    measured = {c for u in traced.units for c in u.codecs}
    assert {"int8", "int4"} <= measured, measured
    # The tracer pins a unit whose replay failed to "store" and goes on: on a
    # new device that would hide a failure behind a store-heavy plan.
    failed = [u.key for u in traced.units if (u.not_recomputable_reason or "").startswith("profiling failed")]
    assert not failed, failed


def test_store_and_recompute_buckets_match_plain_compile_and_save_what_they_predict(tiny):
    model, ids, traced, reference = tiny
    plan = two_bucket_plan(traced, recompute_heavy(traced), store_all(traced))
    backend = _strict({"plan": plan})
    compiled = torch.compile(model, backend=backend)
    for bucket in ("b0", "b1"):
        torch.testing.assert_close(grad_of(model, compiled, ids, bucket), reference, **EXACT)
    (graph,) = backend.graphs
    saved = {b: graph.actual_saved_bytes(b) for b in ("b0", "b1")}
    for bucket, actual in saved.items():
        assert actual == pytest.approx(graph.predicted_saved_bytes(bucket), rel=0.05), bucket
    assert saved["b0"] < 0.8 * saved["b1"]
    (low,) = [r for r in graph.records if r.bucket == "b0"]
    assert low.counts.get("recompute", 0) > 0


def test_every_codec_compiles_into_one_graph_and_keeps_the_gradient_direction(tiny):
    """bf16, int8, int4 and fp8 (where the device has it) spread over the units of
    one plan: one compile lowers every codec's encode and decode for the device."""
    model, ids, traced, reference = tiny
    codecs = [c for c in ("bf16", "int8", "int4", "fp8") if c in codec_names(DEVICE)]
    usable = [u for u in traced.units if any(c.usable for c in u.codecs.values())]
    decisions = {u.key: "store" for u in traced.units}
    for i, unit in enumerate(usable):
        turn = codecs[i % len(codecs):] + codecs[:i % len(codecs)]  # unit i starts at codec i
        codec = next(c for c in turn if c in unit.codecs and unit.codecs[c].usable)
        decisions[unit.key] = f"compress:{codec}"
    used = {d.removeprefix("compress:") for d in decisions.values() if d.startswith("compress:")}
    assert used == set(codecs), used
    plan = fixed_plan(traced, {"b0": decisions}, buckets=1)
    backend = _strict({"plan": plan})
    got = grad_of(model, torch.compile(model, backend=backend), ids)
    assert not torch.equal(got, reference)  # the codecs really ran
    assert _cosine(got, reference) >= 0.99
    (graph,) = backend.graphs
    assert graph.records[0].counts.get("compress", 0) == sum(d.startswith("compress:") for d in decisions.values())
    assert graph.actual_saved_bytes("b0") == pytest.approx(graph.predicted_saved_bytes("b0"), rel=0.05)


def test_recompute_replays_dropout_with_the_forwards_random_numbers():
    model = build_model("llama-tiny-dropout", device=DEVICE).train()
    ids = _ids()
    traced = _trace(model, ids)
    plan = two_bucket_plan(traced, recompute_heavy(traced), store_all(traced))
    compiled = torch.compile(model, backend=_strict({"plan": plan}))
    recomputed, stored = seeded_grads(model, compiled, ids, ("b0", "b1"))
    torch.testing.assert_close(recomputed, stored, **EXACT)


def test_zero_config_plans_a_bf16_model_under_a_tight_budget(tmp_path):
    """The GPU bench's setting: bf16 parameters, planned at the first call."""
    model = build_model("tiny", device=DEVICE, dtype=torch.bfloat16)
    ids = _ids()
    reference = grad_of(model, lambda x: model(x), ids)
    backend = _strict({"memory_budget": "1.0x-gc", "cache_dir": str(tmp_path)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", HiLoReWarning)
        got = grad_of(model, torch.compile(model, backend=backend), ids)
    assert _cosine(got, reference) >= 0.99  # bf16 kernels round differently from eager's
    (graph,) = backend.graphs
    assert graph.plan is not None
    bucket = graph.default_bucket
    record = next(r for r in graph.records if r.bucket == graph.variant_of.get(bucket, bucket))
    assert record.counts.get("recompute", 0) + record.counts.get("compress", 0) > 0
    assert record.saved_bytes < record.default_saved_bytes


def test_hugging_face_llama_zero_config(tmp_path):
    pytest.importorskip("transformers")
    from hilore_compiler.models.hf import build_hf_model

    model = build_hf_model("llama", vocab_size=64, use_cache=False).to(DEVICE)
    ids = _ids(64)

    def loss_of(run) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        run(input_ids=ids).logits.float().log_softmax(-1).pow(2).mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    reference = loss_of(model)
    backend = _strict({"cache_dir": str(tmp_path)})
    got = loss_of(torch.compile(model, backend=backend, dynamic=False))
    assert backend.graphs and backend.graphs[0].plan is not None
    assert _cosine(got, reference) >= 0.999


def test_a_hilore_bench_worker_plans_times_and_measures_a_peak_on_the_device(tmp_path):
    # A bench worker is a process of its own: here the module has compiled
    # ``tiny`` at other shapes, which would make dynamo compile this one dynamic.
    torch._dynamo.reset()
    config = WorkerConfig(method="hilore", model="tiny", batch=2, seq_len=64, seed=0, device=DEVICE, warmup=1,
                          options=MethodOptions(hilore_cache_dir=str(tmp_path), verbose=False))
    worker = Worker(config)
    setup = worker.setup()
    samples = worker.measure(2)
    assert setup["info"]["graph_breaks"] == 0
    assert all(s.seconds > 0 and s.peak_bytes > 0 for s in samples)
    assert setup["info"]["plan"]["graphs"] >= 1 and setup["info"]["bucket"] is not None
