"""hilore eval on a task with real responses: rewards, KL, paired arms, per-step fidelity."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch

from hilore_compiler.bench.methods import UNBOUNDED_RISK
from hilore_compiler.evaluation.arms import Arm, FixedBatch, arm_backend_options, exact_arm
from hilore_compiler.evaluation.comparison import run_comparison
from hilore_compiler.evaluation.fidelity import grad_vector
from hilore_compiler.evaluation.presets import preset
from hilore_compiler.evaluation.rollout import rollout
from hilore_compiler.evaluation.stepfidelity import bucket_gradients, measured_update
from hilore_compiler.evaluation.task import TaskConfig, make_prompts, reward, right_positions
from hilore_compiler.evaluation.training import RunSetup, TrainConfig, train_arm
from hilore_compiler.grpo import ExposureBuckets, GRPOConfig, UpdateConfig, actor_update, bucket_names
from hilore_compiler.models import build_model


def samples(text: list[str]) -> torch.Tensor:
    return torch.tensor([[ord(c) for c in s] for s in text])


# --- task -------------------------------------------------------------------

def test_multiples_rule_checks_each_step_given_the_previous_one():
    task = TaskConfig(prompt_digits=4, response_len=6, rule="multiples", partial_credit=True)
    # m = 9 (the largest prompt digit): 9, 8, 7, ... are the last digits of 9, 18, 27, ...
    assert right_positions(task, samples(["3917=987654"])).tolist() == [[True] * 6]
    # m = 5: 5, 0, 5, 0, ...
    assert reward(task, samples(["1452=505050"])).tolist() == [1.0]
    # One wrong digit costs its own step and the next one (checked from the wrong digit),
    # then the chain is right again from there: 4 of 6 steps.
    assert right_positions(task, samples(["3917=983654"])).tolist() == [[True, True, False, False, True, True]]
    assert reward(task, samples(["3917=983654"])).tolist() == [pytest.approx(4 / 6)]
    # A non-digit is never right, nor is the step after it (nothing to add m to).
    assert right_positions(task, samples(["3917=98=654"])).tolist() == [[True, True, False, False, True, True]]


def test_exact_match_and_partial_credit_on_hand_made_samples():
    exact = TaskConfig(prompt_digits=4, response_len=4, rule="sorted")
    partial = TaskConfig(prompt_digits=4, response_len=4, rule="sorted", partial_credit=True)
    batch = samples(["3917=1379", "3917=1397", "3917=9731", "3917=13a9"])
    assert reward(exact, batch).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert reward(partial, batch).tolist() == [1.0, 0.5, 0.0, 0.75]


def test_preset_prompts_are_deterministic_per_seed_and_responses_long():
    config = preset("multiples16")
    assert config.task.response_len >= 16 and config.train.group_size == 8 and config.seeds >= 16
    assert config.grpo.beta == 0.001 and config.grpo.eps_low == config.grpo.eps_high == 0.2
    assert config.arms == ("exact", "hilore", "hilore-int4", "int8-recompute", "store-all")
    a = make_prompts(config.task, 32, torch.Generator().manual_seed(5))
    b = make_prompts(config.task, 32, torch.Generator().manual_seed(5))
    c = make_prompts(config.task, 32, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="unknown arm"):
        dataclasses.replace(config, arms=("exact", "nope"))


# --- arms -------------------------------------------------------------------------

def test_arm_options_are_a_users_and_the_benchs():
    from hilore_compiler.backend import BackendOptions

    def options(name):
        return BackendOptions.from_mapping(arm_backend_options(name, "/nonexistent"))

    # "hilore" is torch.compile(model, backend="hilore") with no options: every field that
    # plans is the default; only where it caches, whether it talks and strictness differ.
    harness = {"cache_dir", "verbose", "strict"}
    hilore, zero_config = options("hilore"), BackendOptions()
    for f in dataclasses.fields(BackendOptions):
        if f.name not in harness:
            assert getattr(hilore, f.name) == getattr(zero_config, f.name), f.name
    assert hilore.memory_budget == "1.10x-gc" and hilore.codecs == ("bf16", "int8")
    assert options("hilore-int4").codecs == ("bf16", "int8", "int4")
    recompute = options("int8-recompute")
    assert (recompute.codecs, recompute.buckets, recompute.risk_budget) == (("int8",), 1, UNBOUNDED_RISK)


def _small_task() -> TaskConfig:
    return TaskConfig(prompt_digits=4, response_len=4, rule="multiples", partial_credit=True)


def _small_setup() -> RunSetup:
    train = TrainConfig(steps=2, prompts_per_step=2, eval_every=2, eval_prompts=10, final_evals=1)
    return RunSetup(task=_small_task(), train=train, grpo=GRPOConfig(beta=0.001),
                    update=UpdateConfig(microbatch_size=16, n_buckets=3))


def test_arms_start_identical_and_exact_runs_repeat_bitwise():
    setup = _small_setup()
    one, two = exact_arm(build_model("tiny", seed=5)), exact_arm(build_model("tiny", seed=9))
    a, b = train_arm(one, 1, setup), train_arm(two, 1, setup)  # both start from seed 1's weights
    assert a.digests == b.digests and a.rewards == b.rewards and a.scores == b.scores
    for p, q in zip(one.policy.parameters(), two.policy.parameters()):
        assert torch.equal(p, q)
    # Another arm (padded microbatches: the same gradient up to summation order) samples the
    # same first batch: same start, same draws.
    policy = build_model("tiny", seed=3)
    padded = train_arm(Arm(name="padded", policy=policy, model=FixedBatch(policy, 16)), 1, setup)
    assert padded.digests[0] == a.digests[0]
    assert train_arm(exact_arm(build_model("tiny")), 2, setup).digests[0] != a.digests[0]


# --- KL and per-step fidelity -----------------------------------------------------------

def _gradient(policy, batch, beta: float) -> torch.Tensor:
    # skip_zero off and fixed buckets: both betas cut the batch into the same microbatches.
    update = UpdateConfig(microbatch_size=16, skip_zero=False)
    buckets = ExposureBuckets(edges=(0.0, math.inf), names=bucket_names(1))
    actor_update(policy, None, batch, GRPOConfig(beta=beta), update=update, buckets=buckets)
    grad = grad_vector(list(policy.parameters()))
    policy.zero_grad(set_to_none=True)
    return grad


def test_k3_to_the_initial_weights_changes_the_gradient_once_the_policy_moves():
    task = _small_task()
    policy, reference = build_model("tiny", seed=0), build_model("tiny", seed=0)
    batch = rollout(policy, task, num_prompts=4, group_size=8, generator=torch.Generator().manual_seed(0),
                    reference=reference).batch
    # At the reference itself K3's gradient, beta (1 - exp(ref - logp)), is exactly 0.
    assert torch.equal(_gradient(policy, batch, 0.001), _gradient(policy, batch, 0.0))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    actor_update(policy, optimizer, batch, GRPOConfig(beta=0.001))
    batch = rollout(policy, task, num_prompts=4, group_size=8, generator=torch.Generator().manual_seed(1),
                    reference=reference).batch
    assert not torch.equal(batch.ref_logprobs, batch.old_logprobs)
    with_kl, without = _gradient(policy, batch, 0.001), _gradient(policy, batch, 0.0)
    # The difference is the KL term's own gradient: the loss with every advantage 0.
    kl_only = _gradient(policy, dataclasses.replace(batch, advantages=torch.zeros(32)), 0.001)
    assert float(kl_only.norm()) > 1e-3 * float(without.norm())
    # Up to fp32 rounding of the whole gradient (the KL part is ~1% of it; measured 3e-4).
    assert float((with_kl - without - kl_only).norm()) < 1e-2 * float(kl_only.norm())


def test_measured_update_splits_the_gradient_by_bucket_and_keeps_the_arms():
    task = _small_task()
    policy = build_model("tiny", seed=0)
    batch = rollout(policy, task, num_prompts=4, group_size=8, generator=torch.Generator().manual_seed(0)).batch
    update = UpdateConfig(microbatch_size=8)
    buckets = ExposureBuckets(edges=(0.0, 0.01, 0.03, math.inf), names=bucket_names(3))
    params = list(policy.parameters())
    added, report = bucket_gradients(policy, params, batch, GRPOConfig(), update, buckets)
    assert set(added) == {n for n in report.samples_per_bucket if n != "zero"}
    assert torch.allclose(sum(added.values()), grad_vector(params), rtol=1e-12, atol=1e-15)
    policy.zero_grad(set_to_none=True)
    # A padded eager "arm" computes the exact gradient up to summation order.
    report, fid = measured_update(FixedBatch(policy, 8), policy, batch, GRPOConfig(), update, buckets, step=3)
    assert fid.step == 3 and set(fid.cosine) == set(added) and len(fid.cosine) >= 2
    assert all(c > 1 - 1e-9 for c in fid.cosine.values()) and fid.update_rel_l2 < 1e-5
    # What is left in .grad for the optimizer is the arm's own update.
    assert torch.allclose(grad_vector(params), sum(added.values()), rtol=1e-5, atol=1e-9)


# --- CLI and the whole comparison -------------------------------------------------------

def test_cli_task_names_and_compare_config():
    from hilore_compiler.commands.eval import ONE_TOKEN, TASKS, _compare_config
    from hilore_compiler.evaluation.presets import PRESETS

    assert TASKS == (ONE_TOKEN, *PRESETS)
    args = argparse.Namespace(task="multiples16", quick=True, steps=5, seeds=3, budget=None, risk_budget=None,
                              threads=None, arms="exact, hilore")
    config = _compare_config(args)
    assert (config.train.steps, config.train.eval_every, config.seeds, config.arms) == (5, 5, 3, ("exact", "hilore"))
    with pytest.raises(ValueError, match="max1"):
        _compare_config(argparse.Namespace(**{**vars(args), "budget": "0.8x-gc"}))


@pytest.mark.slow
def test_a_tiny_comparison_reports_every_arm_and_the_bucket_cosines():
    config = preset("multiples16", seeds=2)
    config = dataclasses.replace(
        config, task=dataclasses.replace(config.task, response_len=4),
        train=dataclasses.replace(config.train, steps=3, prompts_per_step=2, eval_every=3, eval_prompts=10,
                                  final_evals=1, fidelity_every=1))
    payload = run_comparison(config, lambda _msg: None)
    compiled = ["hilore", "hilore-int4", "int8-recompute", "store-all"]
    assert list(payload["plans"]) == compiled[:3]  # store-all is plain torch.compile: no plan
    assert "int4" in payload["plans"]["hilore-int4"]["codecs"]
    assert list(payload["plans"]["int8-recompute"]["buckets"]) == ["b0"]  # one bucket
    diffs = payload["training"]["paired_differences"]
    assert list(diffs) == compiled and all(d["n"] == 2 for d in diffs.values())
    # Every arm starts from the exact arm's weights and draws: step 1's samples are shared.
    assert all(min(d["shared_rollout_steps"]) >= 1 for d in diffs.values())
    for arm in compiled:
        cosines = payload["step_fidelity"][arm]
        assert cosines["update"]["steps"] == 2 * 3 and len(cosines) >= 2  # a bucket or more, and the update
        assert all(0.9 < c["mean_cosine"] <= 1 + 1e-9 for c in cosines.values())
