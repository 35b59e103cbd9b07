"""``hilore demo``: the rollout it makes, the verdict it closes with, and one run on ``tiny``."""

from __future__ import annotations

import types

import pytest
import torch

from hilore_compiler import cli
from hilore_compiler.commands.demo import PASS_COSINE, DemoResult, demo_rollout, verdict
from hilore_compiler.grpo import group_advantages


def test_rollout_has_one_zero_exposure_group_and_equal_exposure_elsewhere():
    batch = demo_rollout(vocab=50, batch=12, seq_len=16, group_size=4, seed=0)
    advantages = group_advantages(batch.rewards, batch.group_ids)
    assert (advantages[:4] == 0).all()  # equal rewards: skipped by the update
    assert torch.allclose(advantages[4:].abs(), advantages[4].abs())  # one bucket: one compiled shape
    assert advantages[4:].abs().min() > 0


def _report(**buckets: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(samples_per_bucket=buckets, samples_skipped=buckets.get("zero", 0),
                                 microbatches=2)


def test_verdict_says_held_and_pass_in_words_and_fails_either_way():
    exact = torch.tensor([1.0, 2.0, 3.0])
    close = exact + 1e-4
    held = DemoResult(peak_bytes=90 * 2**20, ceiling_bytes=100 * 2**20, predicted_bytes=95 * 2**20)
    lines, passed = verdict(_report(zero=4, b1=4), held, close, exact)
    text = "\n".join(lines)
    assert passed and "plan held the ceiling: peak 90.00 MiB of 100.00 MiB" in text
    assert "update matches the exact one: cosine 1.000000" in text and "(pass" in text
    assert "{" not in text and "b1 4 run" in text  # words, not a raw dict
    over = DemoResult(peak_bytes=101 * 2**20, ceiling_bytes=100 * 2**20, predicted_bytes=95 * 2**20)
    lines, passed = verdict(_report(zero=4, b1=4), over, close, exact)
    assert not passed and "did NOT hold" in "\n".join(lines)
    far = torch.tensor([3.0, 2.0, 1.0])  # cosine 10/14 < PASS_COSINE
    lines, passed = verdict(_report(b1=4), held, far, exact)
    assert not passed and "does NOT match" in "\n".join(lines) and f"cosine >= {PASS_COSINE}" in lines[-1]


@pytest.mark.slow
def test_demo_on_tiny_ends_with_a_verdict(tmp_path, capsys):
    rc = cli.main(["demo", "--model", "tiny", "--seq-len", "64", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert "plan held the ceiling: peak" in out and "update matches the exact one" in out
    assert "[demo" in err and "4/4" in err  # progress while it works
    assert (tmp_path / "plan.json").exists() and (tmp_path / "trace.json").exists()
