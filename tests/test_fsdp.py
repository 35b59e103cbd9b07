"""FSDP2 + per-block compile across two processes (gloo, CPU).

One spawn of two ranks runs every check and returns what it measured, since
each process compiles its blocks once (tens of seconds on a 2-core machine):

- gradients after the reduce-scatter against a single-process store-all
  (eager) run of ``grpo_loss`` on the same global batch;
- ``grpo.actor_update`` across ranks: each rank's microbatch buckets (seen
  inside the model), padding and skipped slots, the summed loss and tokens/s.

The global batch is built so the ranks must disagree: rank 0 has one
high-exposure microbatch and two zero ones, rank 1 a low, a high and a zero
one. So slot 0 runs bucket b1 on rank 0 and b0 on rank 1, slot 1 is real work
on rank 1 only (rank 0 runs its first zero microbatch as padding), and slot 2
is zero on both ranks and skipped by both.
"""

from __future__ import annotations

import os

import pytest
import torch

from hilore_compiler.distributed import block_budget, spawn

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

B_RANK, T, PROMPT = 6, 16, 4
#: Advantages per rank: 0 = zero bucket, |A| <= 0.2 low (b0), |A| >= 1.2 high (b1).
ADVANTAGES = ([0.0, 0.0, 0.0, 0.0, 1.3, -1.5], [0.1, -0.2, 1.2, -1.4, 0.0, 0.0])
#: Exposure edge between b0 and b1. Exposure (bnpo) is |A| * response tokens /
#: the rank's share of the global response tokens (about 60 here): low <= 0.05,
#: high >= 0.15.
EDGE = 0.1
#: Which compiler the blocks get; "hilore" once the backend accepts block graphs.
BACKEND = os.environ.get("HILORE_FSDP_TEST_BACKEND", "inductor")


def global_batch():
    """(ids (2B, T), response mask, old log-probs, advantages) of both ranks, fixed by seed."""
    from hilore_compiler.models import build_model, token_logprobs

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2 * B_RANK, T), generator=g)
    lengths = torch.randint(8, T - PROMPT + 1, (2 * B_RANK,), generator=g)
    pos = torch.arange(1, T)  # column t of the (B, T-1) mask is token t + 1
    mask = ((pos >= PROMPT) & (pos < PROMPT + lengths[:, None])).float()  # (2B, T-1)
    with torch.no_grad():
        old = token_logprobs(build_model("tiny")(ids), ids)  # (2B, T-1), on-policy
    old = old + 0.01 * torch.randn(old.shape, generator=g)
    return ids, mask, old, torch.tensor(ADVANTAGES[0] + ADVANTAGES[1])


def reference(config):
    """Single-process store-all (eager) gradient and loss of the whole global batch."""
    from hilore_compiler.grpo import grpo_loss
    from hilore_compiler.models import build_model, token_logprobs

    ids, mask, old, adv = global_batch()
    model = build_model("tiny")
    loss = grpo_loss(token_logprobs(model(ids), ids), old, adv, mask, config)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, float(loss)


def rank_main(rank: int, world: int, backend: str) -> dict:
    """One rank: FSDP2 + per-block compile, one actor update, gradients gathered."""
    from hilore_compiler.backend import runtime
    from hilore_compiler.distributed import compile_blocks, shard_blocks
    from hilore_compiler.grpo import (ExposureBuckets, GRPOConfig, RolloutBatch, UpdateConfig,
                                      actor_update, bucket_names)
    from hilore_compiler.models import build_model

    config = GRPOConfig(loss_type="bnpo")
    ids, mask, old, adv = global_batch()
    mine = slice(rank * B_RANK, (rank + 1) * B_RANK)
    model = build_model("tiny")
    compile_blocks(model, backend=backend)
    shard_blocks(model)
    seen: list[str | None] = []  # the bucket each forward ran under, read inside the model
    model.layers[0].register_forward_pre_hook(lambda *_: seen.append(runtime.current_bucket()))
    batch = RolloutBatch(input_ids=ids[mine], response_mask=mask[mine], old_logprobs=old[mine],
                         advantages=adv[mine])
    buckets = ExposureBuckets(edges=(0.0, EDGE, float("inf")), names=bucket_names(2))
    report = actor_update(model, None, batch, config, buckets=buckets,
                          update=UpdateConfig(microbatch_size=2, n_buckets=2))
    grads = {n.replace("_orig_mod.", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
    ref, ref_loss = reference(config)
    diff = torch.cat([(grads[n] - ref[n]).flatten() for n in ref])
    whole = torch.cat([ref[n].flatten() for n in ref])
    return dict(rel_l2=float(diff.norm() / whole.norm()), loss=report.loss, ref_loss=ref_loss,
                run_buckets=report.run_buckets, seen=seen, skipped=report.samples_skipped,
                tokens_per_s=report.tokens_per_s, ranks=report.ranks,
                exposure=report.exposure_before_forward)


@pytest.fixture(scope="module")
def ranks():
    return spawn(rank_main, 2, BACKEND, backend="gloo", timeout_s=300)


def test_gradients_after_reduce_scatter_equal_single_process_store_all(ranks):
    for r in ranks:
        assert r["rel_l2"] < 1e-5, r["rel_l2"]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)


def test_each_rank_picks_its_own_bucket_in_the_same_slot(ranks):
    r0, r1 = ranks
    assert r0["run_buckets"] == ("b1", "pad") and r1["run_buckets"] == ("b0", "b1")
    # Measured inside the model: padding runs the cheapest bucket's variant.
    assert r0["seen"] == ["b1", "b0"] and r1["seen"] == ["b0", "b1"]


def test_zero_skip_only_where_every_rank_skips_the_slot(ranks):
    r0, r1 = ranks
    # Rank 0 has two zero microbatches: the first fills slot 1 (rank 1 works
    # there), the second shares slot 2 with rank 1's zero one and both skip it.
    assert (r0["skipped"], r1["skipped"]) == (2, 2)
    assert len(r0["seen"]) == len(r1["seen"]) == 2
    assert all(r["ranks"] == 2 for r in ranks)
    # Summed over ranks, so every rank reports the same aggregate.
    assert r0["tokens_per_s"] == r1["tokens_per_s"] > 0


def test_block_budget_is_stated_per_block():
    assert block_budget("1.10x-gc", 4) == "1.10x-gc"  # relative budgets add up over blocks
    assert block_budget("4096", 4) == "1024"  # bytes are shared out evenly
