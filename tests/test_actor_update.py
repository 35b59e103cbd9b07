"""The bucketed, microbatched actor update against one full-batch backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hilore_compiler.backend import runtime
from hilore_compiler.grpo import (
    LOSS_TYPES,
    GRPOConfig,
    RolloutBatch,
    UpdateConfig,
    actor_update,
    group_advantages,
    grpo_loss,
    token_logprobs,
)
from hilore_compiler.grpo.packing import bucket_histograms, drop_then_pack
from hilore_compiler.grpo.update import microbatches

VOCAB, HIDDEN = 13, 16
GROUPS, GROUP_SIZE, T, PROMPT = 4, 4, 12, 4
B = GROUPS * GROUP_SIZE
#: Group 0's rewards are all equal: its advantages, and with beta = 0 its
#: exposure, are exactly 0.
ZERO_GROUP = 0


class TinyPolicy(nn.Module):
    """Embedding -> causal running mean -> linear head; records each forward's bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.seen: list[tuple[str | None, torch.Tensor]] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append((runtime.current_bucket(), ids.detach().clone()))
        h = self.embed(ids)  # (B, T, H)
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        h = h + torch.cumsum(h, dim=1) / steps  # so that position t sees the prefix
        return self.head(torch.tanh(self.mix(h)))  # (B, T, V)


def make_model(seed: int = 0) -> TinyPolicy:
    torch.manual_seed(seed)
    return TinyPolicy().double()


def make_batch(model: TinyPolicy, cfg: GRPOConfig, *, seed: int = 0, noise: float = 0.4) -> RolloutBatch:
    """Off-policy (ratios well outside the clip range) unless ``noise`` is 0; groups interleaved."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    assert len({tuple(r) for r in ids.tolist()}) == B  # rows identify samples in model.seen
    lengths = torch.randint(1, T - PROMPT + 1, (B,), generator=g)
    cols = torch.arange(T - 1)
    mask = ((cols >= PROMPT - 1) & (cols < PROMPT - 1 + lengths.unsqueeze(1))).double()  # (B, T-1)
    with torch.no_grad():
        current = token_logprobs(model(ids), ids).double()
    model.seen.clear()
    group_ids = torch.arange(B) % GROUPS  # interleaved, not contiguous
    rewards = torch.randn(B, generator=g, dtype=torch.float64)
    rewards[group_ids == ZERO_GROUP] = 0.3
    return RolloutBatch(
        input_ids=ids,
        response_mask=mask,
        old_logprobs=current + noise * torch.randn(B, T - 1, generator=g, dtype=torch.float64),
        ref_logprobs=current + 0.3 * torch.randn(B, T - 1, generator=g, dtype=torch.float64),
        rewards=rewards,
        group_ids=group_ids,
        generation_tokens=3 * int(mask.sum()) if cfg.loss_type == "dapo" else None,
    )


def full_batch_grads(
    model: nn.Module, batch: RolloutBatch, cfg: GRPOConfig
) -> tuple[list[torch.Tensor], float]:
    """One forward and one backward of the whole batch: the gradient to match."""
    model.zero_grad(set_to_none=True)
    adv = group_advantages(
        batch.rewards, batch.group_ids, scale_rewards=cfg.scale_rewards, eps=cfg.adv_eps
    )
    logp = token_logprobs(model(batch.input_ids), batch.input_ids)
    n_tok = batch.generation_tokens if cfg.loss_type == "dapo" else None
    loss = grpo_loss(logp, batch.old_logprobs, adv, batch.response_mask, cfg,
                     ref_logprobs=batch.ref_logprobs, num_tokens=n_tok)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, loss.item()


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        # logprobs are fp32 (models.logprobs), so this is an fp32 comparison.
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def sample_of(batch: RolloutBatch, ids: torch.Tensor) -> list[int]:
    rows = {tuple(r): i for i, r in enumerate(batch.input_ids.tolist())}
    return [rows[tuple(r)] for r in ids.tolist()]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_bucketed_update_matches_full_batch_backward(loss_type, beta):
    cfg = GRPOConfig(loss_type=loss_type, eps_high=0.28, dual_clip_c=3.0, beta=beta, max_len=T - PROMPT)
    model = make_model()
    batch = make_batch(model, cfg)
    want, want_loss = full_batch_grads(model, batch, cfg)
    report = actor_update(model, None, batch, cfg, update=UpdateConfig(microbatch_size=3, n_buckets=3))
    assert_same_grads(grads_of(model), want)
    assert report.loss == pytest.approx(want_loss, rel=1e-6)
    assert sum(report.samples_per_bucket.values()) == B
    assert report.microbatches >= 4 and report.peak_memory_bytes is None and report.tokens_per_s > 0


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_each_forward_runs_one_bucket_under_its_exposure(beta):
    cfg = GRPOConfig(beta=beta)
    model = make_model()
    batch = make_batch(model, cfg)
    report = actor_update(model, None, batch, cfg, update=UpdateConfig(microbatch_size=3, n_buckets=3))
    names = report.sample_buckets
    estimate = torch.tensor(report.exposure_before_forward, dtype=torch.float64)
    assert list(names) == report.buckets.assign(estimate)
    forwarded: list[int] = []
    for bucket, ids in model.seen:
        samples = sample_of(batch, ids)
        assert 1 <= len(samples) <= 3
        assert {names[i] for i in samples} == {bucket}  # one bucket, and the one selected
        forwarded += samples
    assert len(model.seen) == report.microbatches
    skipped = [i for i in range(B) if i % GROUPS == ZERO_GROUP] if beta == 0 else []
    assert sorted(forwarded) == sorted(set(range(B)) - set(skipped))


def test_zero_exposure_samples_are_skipped_exactly_when_beta_is_zero():
    cfg = GRPOConfig(loss_type="bnpo", dual_clip_c=3.0)
    model = make_model()
    batch = make_batch(model, cfg)
    want, _ = full_batch_grads(model, batch, cfg)
    report = actor_update(model, None, batch, cfg, update=UpdateConfig(microbatch_size=4, n_buckets=2))
    assert report.samples_skipped == GROUP_SIZE == report.samples_per_bucket["zero"]
    assert_same_grads(grads_of(model), want)
    # Skipped samples' exact exposure is 0, and running them confirms it.
    model.zero_grad(set_to_none=True)
    no_skip = UpdateConfig(microbatch_size=4, n_buckets=2, skip_zero=False)
    ran = actor_update(model, None, batch, cfg, update=no_skip)
    assert ran.samples_skipped == 0 and ran.microbatches == report.microbatches + 1
    assert ran.exposure_before_backward == report.exposure_before_backward
    assert_same_grads(grads_of(model), want)


def test_zero_bucket_is_not_skipped_with_kl():
    cfg = GRPOConfig(loss_type="grpo", beta=0.04)
    model = make_model()
    batch = make_batch(model, cfg)
    zero_group = [i for i in range(B) if i % GROUPS == ZERO_GROUP]
    # Reference == old on the zero-advantage group: at ratio 1 its c_t are all 0,
    # so it lands in "zero"; off policy its KL term still reaches the update.
    ref = batch.ref_logprobs.clone()
    ref[zero_group] = batch.old_logprobs[zero_group]
    batch = dataclasses.replace(batch, ref_logprobs=ref)
    want, _ = full_batch_grads(model, batch, cfg)
    report = actor_update(model, None, batch, cfg, update=UpdateConfig(microbatch_size=4, n_buckets=2))
    assert report.samples_per_bucket["zero"] == GROUP_SIZE and report.samples_skipped == 0
    assert sum(1 for bucket, _ in model.seen if bucket == "zero") == 1
    assert all(report.exposure_before_forward[i] == 0 for i in zero_group)
    assert all(report.exposure_before_backward[i] > 0 for i in zero_group)
    assert_same_grads(grads_of(model), want)


def test_pre_forward_exposure_matches_exact_on_policy():
    cfg = GRPOConfig(loss_type="grpo")
    model = make_model()
    batch = make_batch(model, cfg, noise=0.0)  # old == current: ratio 1
    report = actor_update(model, None, batch, cfg, update=UpdateConfig(microbatch_size=5))
    torch.testing.assert_close(
        torch.tensor(report.exposure_before_backward), torch.tensor(report.exposure_before_forward),
        rtol=1e-6, atol=0,
    )


def test_optimizer_step_matches_full_batch_sgd():
    cfg = GRPOConfig(loss_type="dr_grpo", max_len=T, eps_high=0.28)
    model, reference = make_model(), make_model()
    batch = make_batch(model, cfg)
    want, _ = full_batch_grads(reference, batch, cfg)
    with torch.no_grad():
        for p, g in zip(reference.parameters(), want):
            p -= 0.5 * g
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    actor_update(model, opt, batch, cfg, update=UpdateConfig(microbatch_size=2))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
        assert p.grad is None or (p.grad == 0).all()  # zero_grad ran


def test_microbatches_never_mix_buckets():
    names = ["b1", "zero", "b0", "b1", "b1", "b0", "zero", "b1"]
    runs = microbatches(names, 2, ("zero", "b0", "b1"), frozenset({"zero"}))
    assert runs == [("b0", [2, 5]), ("b1", [0, 3]), ("b1", [4, 7])]
    assert len(microbatches(names, 2, ("zero", "b0", "b1"))) == 4


def test_drop_then_pack_fewest_microbatches_then_one_bucket_each():
    order = ("zero", "b0", "b1")
    names = ["b0", "zero", "b1", "b0", "b1", "zero", "b1", "b0"]
    x = [0.2, 0.0, 3.0, 0.1, 2.0, 0.0, 1.0, 0.3]
    costs = [10, 50, 20, 10, 20, 50, 20, 10]  # tokens
    # 90 tokens survive the drop; a budget of 60 needs 2 micro-batches, and 2 can be pure: 30 | 60.
    p = drop_then_pack(names, x, order, budget=60, costs=costs)
    assert p.dropped == (1, 5) and p.microbatches == ((3, 0, 7), (6, 4, 2)) and p.buckets == ("b0", "b1")
    assert bucket_histograms(names, p.microbatches) == [{"b0": 3}, {"b1": 3}]
    # A budget of 50 still needs 2, and no cut into 2 is pure: one micro-batch mixes, least exposed first.
    tight = drop_then_pack(names, x, order, budget=50, costs=costs)
    assert tight.microbatches == ((3, 0, 7, 6), (4, 2))
    assert bucket_histograms(names, tight.microbatches) == [{"b0": 3, "b1": 1}, {"b1": 2}]
    # Never mixed: one more micro-batch instead.
    assert len(drop_then_pack(names, x, order, budget=50, costs=costs, mix=False).microbatches) == 3
    # Ranks that run more: split where the buckets meet first, then the longest.
    split = drop_then_pack(names, x, order, budget=50, costs=costs, at_least=4)
    assert split.microbatches == ((3,), (0, 7), (6,), (4, 2))
    kept = drop_then_pack(names, x, order, budget=4, drop=False)
    assert kept.dropped == () and kept.microbatches[0] == (1, 5, 3, 0)  # zero first, then least exposed


def test_rollout_batch_checks_shapes():
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="response_mask"):
        RolloutBatch(input_ids=ids, response_mask=torch.ones(2, 5), old_logprobs=torch.zeros(2, 4),
                     advantages=torch.zeros(2))
    with pytest.raises(ValueError, match="advantages"):
        RolloutBatch(input_ids=ids, response_mask=torch.ones(2, 4), old_logprobs=torch.zeros(2, 4))
