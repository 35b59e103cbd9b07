"""GRPO loss, closed-form coefficients, advantages and exposure buckets."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hilore_compiler.grpo import (
    LOSS_TYPES,
    ExposureBuckets,
    GRPOConfig,
    exposure_before_backward,
    exposure_before_forward,
    exposure_buckets,
    group_advantages,
    grpo_loss,
    token_coefficients,
    token_coefficients_before_forward,
)
from hilore_compiler.grpo.coefficients import unclipped
from hilore_compiler.jsonio import FormatError

B, T = 6, 8
#: Ratios on both sides of each clip bound (0.8, 1.28 below; 1 - eps_high = 0.72 and
#: 1 + eps_low = 1.2 would be wrong bounds) and past the dual clip c = 3.
RATIOS = [0.3, 0.75, 0.9, 1.0, 1.25, 1.5, 2.5, 4.0]
ADVANTAGES = [1.5, -0.7, 0.0, 2.0, -1.2, 0.9]
#: Response lengths, right-padded; rows 0 (A > 0) and 1 (A < 0) see every
#: ratio; the last row has no response token at all.
LENGTHS = [8, 8, 3, 7, 2, 0]
GEN_TOKENS = 61.0  # dapo: the generation batch holds more tokens than this batch


def config(loss_type: str, *, kl: bool = False, dual: bool = False) -> GRPOConfig:
    return GRPOConfig(
        loss_type=loss_type,
        eps_low=0.2,
        eps_high=0.28,
        dual_clip_c=3.0 if dual else None,
        beta=0.05 if kl else 0.0,
        max_len=T,
    )


def make_inputs(seed: int = 0, *, per_token_adv: bool = False):
    """float64 log-probs whose ratios to ``old`` are a permutation of RATIOS per row."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1  # (B, T)
    ratios = torch.tensor(RATIOS, dtype=torch.float64)
    ratio = torch.stack([ratios[torch.randperm(T, generator=g)] for _ in range(B)])  # (B, T)
    old = logp - ratio.log()
    ref = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T) < torch.tensor(LENGTHS).unsqueeze(1)).to(torch.float64)  # (B, T)
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)  # (B,)
    if per_token_adv:
        adv = adv.unsqueeze(1) * (1 + torch.rand(B, T, generator=g, dtype=torch.float64))
    return logp, old, adv, mask, ref


def normaliser(loss_type: str) -> dict:
    return {"num_tokens": GEN_TOKENS} if loss_type == "dapo" else {}


def reference_loss(logp, old, adv, mask, cfg: GRPOConfig, ref):
    """Written after TRL's GRPOTrainer.compute_loss and verl's compute_policy_loss_vanilla."""
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if cfg.dual_clip_c is not None:
        loss = torch.where(adv < 0, torch.min(-adv * cfg.dual_clip_c, loss), loss)
    if cfg.beta:
        loss = loss + cfg.beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if cfg.loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if cfg.loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0)
    if cfg.loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.size(0) * cfg.max_len)
    return (loss * mask).sum() / GEN_TOKENS


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_coefficients_equal_autograd(loss_type, kl, dual, per_token_adv):
    cfg = config(loss_type, kl=kl, dual=dual)
    logp, old, adv, mask, ref = make_inputs(per_token_adv=per_token_adv)
    logp.requires_grad_(True)
    loss = grpo_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, **normaliser(loss_type))
    torch.testing.assert_close(loss, reference_loss(logp, old, adv, mask, cfg, ref), rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(loss, logp)
    coeff = token_coefficients(logp, old, adv, mask, cfg, ref_logprobs=ref, **normaliser(loss_type))
    torch.testing.assert_close(coeff, grad, rtol=1e-12, atol=1e-15)

    # The data must exercise every clip: otherwise equality above proves little.
    ratio = torch.exp(logp.detach() - old)
    a = adv if adv.dim() == 2 else adv[:, None].expand(B, T)
    live = mask.bool()
    assert (live & (a > 0) & (ratio > 1.28)).any()  # clipped above
    assert (live & (a > 0) & (ratio > 1.2) & (ratio <= 1.28)).any()  # eps_high, not eps_low
    assert (live & (a < 0) & (ratio < 0.8)).any()  # clipped below
    assert (live & (a < 0) & (ratio >= 0.72) & (ratio < 0.8)).any()  # eps_low, not eps_high
    assert (live & (a < 0) & (ratio > 3.0)).any()  # dual clip region
    assert (live & ~unclipped(ratio, a, cfg) & (a != 0)).sum() >= 3
    assert (coeff[~live] == 0).all()


def test_microbatch_shares_sum_to_the_full_batch_loss():
    logp, old, adv, mask, ref = make_inputs(seed=1)
    for loss_type in LOSS_TYPES:
        cfg = config(loss_type, kl=True, dual=True)
        full = grpo_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, **normaliser(loss_type))
        totals = {"num_sequences": B, "num_tokens": GEN_TOKENS if loss_type == "dapo" else mask.sum()}
        parts = [
            grpo_loss(logp[s], old[s], adv[s], mask[s], cfg, ref_logprobs=ref[s], **totals)
            for s in (slice(0, 2), slice(2, 3), slice(3, B))
        ]
        torch.testing.assert_close(sum(parts), full, rtol=1e-12, atol=0)


def test_dapo_needs_its_normaliser():
    logp, old, adv, mask, ref = make_inputs()
    with pytest.raises(ValueError, match="num_tokens"):
        grpo_loss(logp, old, adv, mask, config("dapo"))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_pre_forward_estimate_is_exact_on_policy(loss_type):
    cfg = config(loss_type, dual=True)
    logp, _, adv, mask, ref = make_inputs(seed=2)
    on_policy = dict(num_tokens=GEN_TOKENS) if loss_type == "dapo" else {}
    est = exposure_before_forward(adv, mask, cfg, **on_policy)
    exact = exposure_before_backward(logp, logp.clone(), adv, mask, cfg, **on_policy)
    torch.testing.assert_close(est, exact, rtol=0, atol=0)
    reaches = (torch.tensor(ADVANTAGES) != 0) & (torch.tensor(LENGTHS) > 0)
    assert (est[reaches] > 0).all() and (est[~reaches] == 0).all()

    # With the reference and old log-probs the KL term is exact at ratio 1 too.
    kl_cfg = config(loss_type, kl=True)
    est = token_coefficients_before_forward(
        adv, mask, kl_cfg, old_logprobs=logp, ref_logprobs=ref, **on_policy
    )
    exact = token_coefficients(logp, logp.clone(), adv, mask, kl_cfg, ref_logprobs=ref, **on_policy)
    torch.testing.assert_close(est, exact, rtol=1e-14, atol=0)

    # Off policy the estimate is only an estimate: clipping makes them differ.
    _, old, *_ = make_inputs(seed=2)
    off = exposure_before_backward(logp, old, adv, mask, cfg, **on_policy)
    assert not torch.allclose(off, exposure_before_forward(adv, mask, cfg, **on_policy))


def test_pre_forward_estimate_without_reference_leaves_kl_out():
    logp, _, adv, mask, ref = make_inputs()
    est = exposure_before_forward(adv, mask, config("grpo", kl=True))
    torch.testing.assert_close(est, exposure_before_forward(adv, mask, config("grpo")), rtol=0, atol=0)


def test_group_advantages_match_trl():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(12, generator=g, dtype=torch.float64)
    ids = torch.arange(3).repeat_interleave(4)  # contiguous groups of 4, as TRL lays them out
    grouped = rewards.view(-1, 4)
    centred = rewards - grouped.mean(1).repeat_interleave(4)
    expect = {
        "group": centred / (grouped.std(1).repeat_interleave(4) + 1e-4),
        "batch": centred / (rewards.std() + 1e-4),
        "none": centred,
    }
    for scale, want in expect.items():
        got = group_advantages(rewards, ids, scale_rewards=scale, eps=1e-4)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # Group ids need not be contiguous: permuting samples permutes advantages.
    perm = torch.randperm(12, generator=g)
    torch.testing.assert_close(group_advantages(rewards[perm], ids[perm] * 7 + 5), expect["group"][perm])


def test_equal_rewards_give_exactly_zero_advantage():
    # 8 x 0.1 in fp32 does not sum to exactly 0.8: a naive mean leaves a residue
    # that the tiny std would blow up into a visible advantage.
    rewards = torch.tensor([0.1] * 8 + [0.7] + [0.2, 0.9, 0.4], dtype=torch.float32)
    ids = torch.tensor([0] * 8 + [1] + [2] * 3)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, ids, scale_rewards=scale)
        assert (adv[:9] == 0).all(), adv
        assert (adv[9:] != 0).all()


def test_buckets_from_quantiles_and_zero():
    exposures = torch.tensor([0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0.0, 1e-30], dtype=torch.float64)
    buckets = exposure_buckets(exposures, 3)
    assert buckets.names == ("zero", "b0", "b1", "b2")
    assert buckets.edges[0] == 1e-30 and buckets.edges[-1] == 9.0
    names = buckets.assign(exposures)
    assert names[0] == names[10] == "zero"
    assert names[11] == "b0"  # tiny but nonzero is not "zero"
    assert names[1:10] == ["b0"] * 3 + ["b1"] * 3 + ["b2"] * 3
    assert buckets.assign(torch.tensor([100.0, 1e-40])) == ["b2", "b0"]
    assert buckets.upper("zero") == 0.0 and buckets.upper("b2") == 9.0


def test_buckets_json_round_trip_and_errors():
    buckets = exposure_buckets(torch.rand(20, generator=torch.Generator().manual_seed(4)), 4)
    again = ExposureBuckets.from_json(json.loads(json.dumps(buckets.to_json())))
    assert again == buckets
    with pytest.raises(FormatError, match="schema"):
        ExposureBuckets.from_json({"schema": "hilore.plan/v1", "edges": [], "names": []})
    with pytest.raises(FormatError, match="names"):
        ExposureBuckets.from_json({**buckets.to_json(), "names": ["zero", "b1", "b0", "b2", "b3"]})
    with pytest.raises(FormatError, match="edges"):
        ExposureBuckets.from_json({**buckets.to_json(), "edges": [3.0, 2.0, 1.0, 0.5, 0.1]})


def test_all_zero_exposures_make_degenerate_buckets():
    buckets = exposure_buckets(torch.zeros(4), 2)
    assert buckets.assign(torch.tensor([0.0, 0.5])) == ["zero", "b1"]
    with pytest.raises(ValueError):
        exposure_buckets(torch.ones(3), 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "token_mean"}, "loss_type"),
        ({"loss_type": "dr_grpo"}, "max_len"),
        ({"dual_clip_c": 1.0}, "dual_clip_c"),
        ({"eps_low": 1.0}, "eps_low"),
        ({"beta": -0.1}, "beta"),
        ({"scale_rewards": "std"}, "scale_rewards"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def test_config_is_frozen_and_keyword_only():
    cfg = GRPOConfig()
    with pytest.raises(AttributeError):
        cfg.beta = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        GRPOConfig("grpo")  # type: ignore[misc]
    assert not hasattr(cfg, "__dict__") and math.isclose(cfg.adv_eps, 1e-4)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dual", [False, True])
def test_off_policy_bound_never_understates_the_exposure_after_the_forward(loss_type, dual):
    """Second-iteration ratios (0.3..4, clipped and dual-clipped tokens): the
    pre-forward bound is >= the exact exposure for every sample, is finite for
    every sample when a dual clip caps negative advantages, and keeps zero at zero."""
    from hilore_compiler.grpo.coefficients import exposure_bound_before_forward

    cfg = config(loss_type, dual=dual)
    for seed in range(5):
        logp, old, adv, mask, _ = make_inputs(seed)
        exact = exposure_before_backward(logp, old, adv, mask, cfg, **normaliser(loss_type))
        bound = exposure_bound_before_forward(adv, mask, cfg, on_policy=False, **normaliser(loss_type))
        assert (bound >= exact - 1e-12).all(), (bound, exact)
        assert bound[2] == 0.0 and bound[-1] == 0.0  # zero advantage, no tokens: exactly zero
        negative = (adv < 0) & (mask.sum(-1) > 0)
        assert torch.isfinite(bound[negative]).all() == dual  # no dual clip: no bound, top bucket
    # The on-policy estimate understates a negative-advantage sample whose ratios
    # grew to 2.5 (unclipped below the dual clip c = 3); the bound does not.
    logp, adv, mask = torch.zeros(1, T, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64), \
        torch.ones(1, T, dtype=torch.float64)
    old = logp - math.log(2.5)
    exact = exposure_before_backward(logp, old, adv, mask, cfg, **normaliser(loss_type))
    on = exposure_bound_before_forward(adv, mask, cfg, on_policy=True, **normaliser(loss_type))
    off = exposure_bound_before_forward(adv, mask, cfg, on_policy=False, **normaliser(loss_type))
    assert on < exact <= off
    # With a KL term nothing is known off-policy: every sample goes to the top bucket.
    kl = exposure_bound_before_forward(adv, mask, config(loss_type, kl=True), on_policy=False,
                                       **normaliser(loss_type))
    assert torch.isinf(kl).all()


def test_plan_and_batch_buckets_share_one_interval_rule():
    """(lo, hi]: an exposure at an edge is in the lower bucket for the plan and the batch alike."""
    from hilore_compiler.grpo import plan_buckets
    from hilore_compiler.solver.risk import default_buckets
    from hilore_compiler.vocabulary import to_batch_exposure

    class _Plan:  # plan_buckets reads only the bucket records
        def __init__(self, specs):
            self.buckets = [type("B", (), {"bucket": s, "skip": False}) for s in specs]

    specs = default_buckets(3)
    n = 16
    batch = plan_buckets(_Plan(specs), n)
    probes = [0.25, specs[0].hi, specs[0].hi * 1.001, specs[1].hi, 10.0, math.inf]
    names = batch.assign(torch.tensor([to_batch_exposure(x, n) for x in probes], dtype=torch.float64))
    from hilore_compiler.planfile import Plan
    expected = [Plan.bucket_for(_Plan(specs), x) for x in probes]
    assert names == expected == ["b0", "b0", "b1", "b1", "b2", "b2"]
