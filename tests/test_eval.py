"""hilore eval's fast pieces: task rewards, paired intervals, fidelity math, deterministic rollouts."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from hilore_compiler.evaluation.arms import Arm, FixedBatch, exact_arm
from hilore_compiler.evaluation.fidelity import FidelitySetup, arm_fidelity, bucket_advantage, compare
from hilore_compiler.evaluation.report import paired_difference, t_quantile_975, training_summary
from hilore_compiler.evaluation.rollout import rollout, sample_responses, task_score
from hilore_compiler.evaluation.task import DIGIT_TOKENS, SEPARATOR, TaskConfig, make_prompts, reward
from hilore_compiler.evaluation.training import ArmRun, shared_steps, step_generator
from hilore_compiler.grpo import GRPOConfig, UpdateConfig
from hilore_compiler.models import build_model
from hilore_compiler.planfile import BucketPlan, BucketSpec, Plan


def samples(text: list[str]) -> torch.Tensor:
    return torch.tensor([[ord(c) for c in s] for s in text])


# --- task -------------------------------------------------------------------

@pytest.mark.parametrize("rule, right, wrong", [
    ("max", ["3917=9", "0000=0", "1282=8"], ["3917=7", "3917=3", "1282=2"]),
    ("first", ["3917=3", "0000=0"], ["3917=9", "3917=1"]),
])
def test_reward_follows_the_rule(rule, right, wrong):
    config = TaskConfig(rule=rule)
    assert reward(config, samples(right)).tolist() == [1.0] * len(right)
    assert reward(config, samples(wrong)).tolist() == [0.0] * len(wrong)


def test_sorted_rule_and_non_digits():
    config = TaskConfig(rule="sorted", response_len=2)
    assert reward(config, samples(["3917=39", "9170=19", "5512=55"])).tolist() == [1.0, 1.0, 1.0]
    assert reward(config, samples(["3917=93", "9170=17"])).tolist() == [0.0, 0.0]
    # A non-digit token reads as -1, which no rule accepts, not even "repeat the max".
    assert reward(TaskConfig(rule="max"), samples(["3917=a", "3917=="])).tolist() == [0.0, 0.0]


def test_prompts_are_digits_and_separator_and_seeded():
    config = TaskConfig(prompt_digits=5)
    a = make_prompts(config, 64, torch.Generator().manual_seed(3))
    b = make_prompts(config, 64, torch.Generator().manual_seed(3))
    assert a.shape == (64, 6) and torch.equal(a, b)
    assert set(a[:, :5].unique().tolist()) <= set(DIGIT_TOKENS)
    assert (a[:, 5] == SEPARATOR).all()
    with pytest.raises(ValueError, match="unknown rule"):
        TaskConfig(rule="nope")


# --- paired interval ----------------------------------------------------------

def test_paired_difference_t_interval():
    d = paired_difference([3.0, 5.0, 7.0], [2.0, 3.0, 4.0])  # differences 1, 2, 3
    assert d.mean == pytest.approx(2.0) and d.sd == pytest.approx(1.0) and d.n == 3
    half = 4.303 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert (d.low, d.high) == (pytest.approx(2.0 - half), pytest.approx(2.0 + half))
    one = paired_difference([1.0], [0.5])
    assert one.mean == 0.5 and one.low == -math.inf and one.high == math.inf
    with pytest.raises(ValueError):
        paired_difference([1.0, 2.0], [1.0])


def test_t_quantile_table_and_expansion_agree():
    assert t_quantile_975(1) == pytest.approx(12.706)
    assert t_quantile_975(4) == pytest.approx(2.776)
    # Beyond the table the expansion continues it smoothly towards 1.96.
    assert t_quantile_975(31) == pytest.approx(2.040, abs=1e-3)
    assert t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)
    assert t_quantile_975(10**6) == pytest.approx(1.95996, abs=1e-4)


def test_training_summary_pairs_by_seed():
    def run(arm, seed, final, digests):
        return ArmRun(arm=arm, seed=seed, rewards=(0.0, 1.0), scores=((0, 0.1), (2, final)),
                      digests=digests, seconds=1.0, update_seconds=0.5, final_score=final)
    runs = [run("exact", 0, 0.90, ("a", "b")), run("hilore", 0, 0.91, ("a", "c")),
            run("exact", 1, 0.80, ("d", "e")), run("hilore", 1, 0.83, ("d", "e"))]
    summary = training_summary(runs)
    diff = summary["paired_differences"]["hilore"]
    assert diff["mean"] == pytest.approx(2.0) and diff["n"] == 2  # (1 + 3) / 2 pp
    assert diff["shared_rollout_steps"] == [1, 2]
    assert summary["arms"]["exact"]["final_score_pp"] == pytest.approx(85.0)
    assert shared_steps(runs[1], runs[0]) == 1


# --- fidelity -------------------------------------------------------------------

def test_compare_relative_error_and_cosine():
    exact = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert compare(exact.clone(), exact) == (0.0, pytest.approx(1.0))
    rel, cos = compare(torch.tensor([3.0, 4.5], dtype=torch.float64), exact)
    assert rel == pytest.approx(0.1) and cos == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)))


def _plan(batch: int, seq_len: int) -> Plan:
    """A plan with the default bucket ranges and no units: enough for bucketing."""
    specs = [BucketSpec("zero", 0.0, 0.0, 0.0), BucketSpec("b0", 0.0, 0.25, 0.25),
             BucketSpec("b1", 0.25, 1.0, 1.0), BucketSpec("b2", 1.0, math.inf, 4.0)]
    buckets = tuple(BucketPlan(bucket=s, skip=s.name == "zero", decisions=(), memory_bytes=0,
                               kept_bytes=0, transient_bytes=0, time_s=0.0, risk=0.0,
                               proxy_sensitivity=False, solver=None) for s in specs)
    return Plan(model="tiny", fingerprint="0", batch=batch, seq_len=seq_len, budget="1", budget_bytes=1,
                gc_bytes=1, store_bytes=1, risk_budget=0.2, codecs=(), cost_source="measured",
                buckets=buckets, units=())


def test_fidelity_of_a_padded_eager_arm_is_exact_in_every_bucket():
    task = TaskConfig()
    policy = build_model("tiny", seed=1)
    arm = Arm(name="padded", policy=policy, model=FixedBatch(policy, 16), plan=_plan(16, task.seq_len))
    exact = exact_arm(build_model("tiny", seed=2))
    setup = FidelitySetup(task=task, grpo=GRPOConfig(), update=UpdateConfig(microbatch_size=16, n_buckets=3),
                          prompts=2, group_size=8, seed=0)
    rows = arm_fidelity(arm, exact, build_model("tiny", seed=3).state_dict(), setup, "1")
    assert [r.bucket for r in rows] == ["b0", "b1", "b2", "mixed"]
    for r in rows[:3]:
        assert r.samples_per_bucket == {r.bucket: 16}  # the advantages hit the bucket
    for r in rows:
        # Padding only adds rows: the gradient is the eager one up to summation order.
        assert r.rel_l2 < 1e-5 and r.cosine > 1 - 1e-9


def test_bucket_advantage_lies_inside_the_range():
    for spec in (BucketSpec("b0", 0.0, 0.25, 0.25), BucketSpec("b1", 0.25, 1.0, 1.0),
                 BucketSpec("b2", 1.0, math.inf, 4.0)):
        assert spec.lo < bucket_advantage(spec) < spec.hi


# --- rollouts ---------------------------------------------------------------------

def test_rollouts_are_deterministic_for_a_seed():
    task = TaskConfig()
    a, b = build_model("tiny", seed=0), build_model("tiny", seed=0)
    one = rollout(a, task, num_prompts=4, group_size=8, generator=step_generator(0, 1))
    two = rollout(b, task, num_prompts=4, group_size=8, generator=step_generator(0, 1))
    other = rollout(a, task, num_prompts=4, group_size=8, generator=step_generator(1, 1))
    assert torch.equal(one.batch.input_ids, two.batch.input_ids)
    assert torch.equal(one.batch.old_logprobs, two.batch.old_logprobs)
    assert not torch.equal(one.batch.input_ids, other.batch.input_ids)
    ids = one.batch.input_ids  # (32, 6): groups of 8 share their prompt
    assert ids.shape == (32, task.seq_len)
    assert torch.equal(ids[:8, :5], ids[0, :5].expand(8, -1))
    assert set(ids[:, 5].tolist()) <= set(DIGIT_TOKENS)
    # Only the response token's log-prob (column prompt_len - 1) is trained.
    assert one.batch.response_mask.sum(0).tolist() == [0, 0, 0, 0, 32]
    assert torch.equal(one.rewards, reward(task, ids))


def test_greedy_score_needs_no_generator_state():
    task = TaskConfig()
    policy = build_model("tiny", seed=0)
    prompts = make_prompts(task, 50, torch.Generator().manual_seed(0))
    assert task_score(policy, task, prompts) == task_score(policy, task, prompts)
    greedy = sample_responses(policy, prompts, 1, torch.Generator(), temperature=0.0)
    assert torch.equal(greedy[:, :5], prompts)


def test_cli_steps_and_quick_config():
    from hilore_compiler.commands.eval import _config

    args = argparse.Namespace(quick=True, steps=10, seeds=3, budget=None, risk_budget=None, threads=None)
    config = _config(args)
    assert (config.train.steps, config.train.eval_every, config.seeds) == (10, 10, 3)
    full = _config(argparse.Namespace(quick=False, steps=None, seeds=None, budget=None,
                                      risk_budget=None, threads=None))
    assert (full.seeds, full.train.steps, full.tight_budget) == (8, 300, "0.75x-gc")


def test_train_arm_final_score_averages_the_last_evaluations():
    from hilore_compiler.evaluation.training import RunSetup, TrainConfig, train_arm
    from hilore_compiler.grpo.buckets import ExposureBuckets, bucket_names

    train = TrainConfig(steps=2, eval_every=1, eval_prompts=20, final_evals=2, prompts_per_step=2)
    buckets = ExposureBuckets(edges=(0.0, 0.01, 0.05, math.inf), names=bucket_names(3))
    setup = RunSetup(task=TaskConfig(), train=train, grpo=GRPOConfig(),
                     update=UpdateConfig(microbatch_size=16, n_buckets=3), buckets=buckets)
    run = train_arm(exact_arm(build_model("tiny", seed=0)), 0, setup)
    assert [step for step, _ in run.scores] == [0, 1, 2] and len(run.digests) == 2
    assert run.final_score == pytest.approx((run.scores[1][1] + run.scores[2][1]) / 2)
