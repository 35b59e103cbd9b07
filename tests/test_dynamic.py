"""One plan for every length: a plain ``torch.compile(model, backend="hilore")``
stays planned when GRPO batches change length.

Dynamo compiles the first length statically and, at the second, makes the
graph dynamic; the backend plans that symbolic graph over the lengths it
meets, re-solving from its trace when a call falls outside. Checked on the
built-in policy and a Hugging Face Llama: no fallback, at most two dynamo
graphs, exact gradients with store/recompute plans, and every length's
measured peak under that length's ceiling.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.bench.measure import allocator_peak, loss_side, plan_loss_ratio

pytestmark = pytest.mark.slow

#: Six lengths in an order a GRPO run could meet them: the first compiles
#: static, the second dynamic; shorter and longer ones re-solve.
LENGTHS = (48, 64, 40, 96, 24, 80)
OPTIONS = {"codecs": [], "buckets": 1, "memory_budget": "1.0x-gc", "verbose": False}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().pow(2).mean()


def run_lengths(model: torch.nn.Module, call, vocab: int, tmp_path, **options) -> dict:
    """Each length's gradient (compiled and eager), measured peak and ceiling, and the backend;
    ``options`` go to the backend."""
    # The loss runs after the graph: its own peak, measured, is part of the step's.
    ratio = plan_loss_ratio(loss_side(loss, (2, max(LENGTHS), vocab), torch.float32, "cpu"))
    backend = HiLoReBackend({**OPTIONS, "cache_dir": str(tmp_path), "loss_ratio": ratio, **options})
    compiled = torch.compile(model, backend=backend)
    results = {}
    for i, length in enumerate(LENGTHS):
        ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(length))

        def step(fn=compiled) -> None:
            loss(call(fn, ids)).backward()

        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()  # compiles, traces or re-solves where this length needs it
        got = flat_grad(model)
        model.zero_grad(set_to_none=True)
        peak = allocator_peak(step)  # the step alone, as a trainer's later steps run it
        model.zero_grad(set_to_none=True)
        step(model)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, HiLoReWarning)]
        results[length] = dict(grad=got, exact=flat_grad(model), peak=peak, fallbacks=fallbacks,
                               ceiling=backend.graphs[-1].ceiling_at(2, length))
    return {"backend": backend, "results": results}


def check(run: dict) -> None:
    backend, results = run["backend"], run["results"]
    assert len(backend.graphs) <= 2, f"dynamo compiled {len(backend.graphs)} graphs for {len(LENGTHS)} lengths"
    dynamic = backend.graphs[-1]
    assert dynamic.planner.dynamic, "the second length did not make the graph dynamic"
    assert dynamic.plan is not None, "the dynamic graph was not planned"
    lo, hi = dynamic.planner.seq_range
    assert lo <= min(LENGTHS[1:]) and hi >= max(LENGTHS[1:])
    assert dynamic.resolves >= 1, "a length outside the planned range did not re-solve the plans"
    recomputed = [r.counts.get("recompute", 0) for r in dynamic.records]
    assert max(recomputed) > 0, "the plan recomputes nothing at 1.0x GC: nothing was planned"
    for length, r in results.items():
        assert not r["fallbacks"], f"length {length} fell back: {r['fallbacks']}"
        assert rel_l2(r["grad"], r["exact"]) < 1e-4, f"length {length}: gradient differs from eager"
        print(f"length {length}: measured peak {r['peak']}, ceiling {r['ceiling']}")
        assert r["peak"] <= r["ceiling"], (
            f"length {length}: measured peak {r['peak']} over its ceiling {r['ceiling']}")


def test_built_in_policy_stays_planned_across_lengths(tmp_path):
    from hilore_compiler.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny")
    check(run_lengths(model, lambda fn, ids: fn(ids), model.config.vocab_size, tmp_path))


def packed_batch(lengths: tuple[int, ...], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's remove-padding layout: sequences packed into one (1, N) row, positions restarting per sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.randint(0, vocab, (n,), generator=g) for n in lengths])[None]  # (1, N)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, N)
    return ids, positions


def test_packed_sequences_of_changing_total_length_are_planned(tmp_path):
    """A (1, N) packed micro-batch with position ids, N changing every call, is planned with N symbolic:
    each packed sequence's logits are its own (no attention across sequences) and gradients are exact.
    Compiled with ``dynamic=True``: the first call's graph is already symbolic, and stays the only one."""
    pytest.importorskip("transformers")
    from hilore_compiler.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("llama", vocab_size=64, use_cache=False)
    backend = HiLoReBackend({**OPTIONS, "cache_dir": str(tmp_path)})
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for seed, lengths in enumerate([(20, 12), (9, 30, 5), (40, 16), (7, 7, 7, 11)]):
        ids, positions = packed_batch(lengths, 64, seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = compiled(input_ids=ids, position_ids=positions).logits  # (1, N, V)
            loss(logits).backward()
        assert not [w for w in caught if issubclass(w.category, HiLoReWarning)], f"{lengths} fell back"
        got = flat_grad(model)
        model.zero_grad(set_to_none=True)
        loss(model(input_ids=ids, position_ids=positions).logits).backward()
        assert rel_l2(got, flat_grad(model)) < 1e-4, f"packed {lengths}: gradient differs from eager"
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            start = 0
            for n in lengths:  # each sequence alone, as if unpacked
                alone = model(input_ids=ids[:, start:start + n]).logits
                assert torch.allclose(logits[:, start:start + n].detach(), alone, atol=1e-5), \
                    f"packed {lengths}: sequence at {start} attends across its neighbours"
                start += n
    assert len(backend.graphs) == 1
    assert backend.graphs[0].planner.dynamic and backend.graphs[0].plan is not None
    assert backend.graphs[-1].planner.batch == 1, "a packed row is batch 1, its tokens the sequence"
