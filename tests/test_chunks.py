"""The log-prob chunk size as a planner decision (grpo.chunks.choose_chunk_tokens):
the memory model prices every candidate, only those whose plan fits are
compiled and timed, and the chosen step trains with exact gradients."""

from __future__ import annotations

import pytest
import torch

from hilore_compiler.grpo import GRPOConfig, choose_chunk_tokens, default_chunk_candidates, step_fn
from hilore_compiler.grpo.chunks import NoChunkFitsError
from hilore_compiler.models import build_model, token_logprobs

LOSS = GRPOConfig()
#: A vocabulary large next to the tiny model's width, so that the chunk size
#: moves the step's least peak (logits and their gradient against the lm_head's
#: partial gradients) as it does at a 128k vocabulary.
VOCAB, BATCH, SEQ = 4096, 2, 16
CANDIDATES = (4, 15)  # 8 chunks and 2 of the 30 predicting tokens


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    model = build_model("tiny", n_layers=1, vocab_size=VOCAB)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=g)  # (B, T)
    with torch.no_grad():
        old = token_logprobs(model(ids), ids) - 0.05  # off-policy: ratio != 1
    batch = (ids, old, torch.randn(BATCH, generator=g), torch.ones(BATCH, SEQ - 1))
    options = {"codecs": [], "buckets": 1, "verbose": False, "cache_dir": str(tmp_path_factory.mktemp("chunks"))}
    return model, batch, options


def grads(model, step, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    step(*batch).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_default_candidates_make_two_to_eight_chunks():
    assert default_chunk_candidates(510) == (64, 128, 256)
    assert default_chunk_candidates(30) == (4, 8, 16)
    with pytest.raises(ValueError, match="cannot be chunked"):
        default_chunk_candidates(1)


def test_a_budget_that_moves_with_the_chunk_size_is_refused(setting):
    model, batch, options = setting
    with pytest.raises(ValueError, match="gc_peak_bytes"):
        choose_chunk_tokens(model, LOSS, batch, options={**options, "memory_budget": "1.10x-gc"})
    with pytest.raises(ValueError, match="positive token counts"):
        choose_chunk_tokens(model, LOSS, batch, options={**options, "memory_budget": "1GB"}, candidates=(0,))


@pytest.mark.slow
def test_chunk_size_is_priced_then_timed_and_the_choice_is_exact(setting):
    model, batch, options = setting
    with pytest.raises(NoChunkFitsError, match="smallest feasible budget") as info:
        choose_chunk_tokens(model, LOSS, batch, options={**options, "memory_budget": "1kB"},
                            candidates=CANDIDATES, progress=lambda _: None)
    needs = {t.chunk_tokens: t.min_budget_bytes for t in info.value.trials}
    assert set(needs) == set(CANDIDATES) and not any(t.fits or t.seconds for t in info.value.trials)
    assert info.value.min_budget_bytes == min(needs.values())
    assert len(set(needs.values())) == 2, f"the chunk size must move the least peak here: {needs}"

    # At the smaller of the two least peaks, the memory model rules the other size out.
    budget = min(needs.values())
    choice = choose_chunk_tokens(model, LOSS, batch, options={**options, "memory_budget": str(budget)},
                                 candidates=CANDIDATES, progress=lambda _: None)
    fitting = min(needs, key=needs.get)
    assert choice.chunk_tokens == fitting and choice.budget_bytes == budget
    by_size = {t.chunk_tokens: t for t in choice.trials}
    assert by_size[fitting].fits and by_size[fitting].predicted_peak_bytes <= budget
    assert by_size[fitting].seconds > 0
    other = next(c for c in CANDIDATES if c != fitting)
    assert not by_size[other].fits and by_size[other].seconds is None and by_size[other].min_budget_bytes > budget
    assert "<- chosen" in choice.table()
    assert choice.backend.options.strict is False  # strict only while choosing: training falls back

    # Store and recompute only: the chosen step's gradients are the eager step's.
    got, want = grads(model, choice.step, batch), grads(model, step_fn(model, LOSS), batch)
    assert float((got - want).norm() / want.norm()) < 1e-4
