"""hilore eval on a task with real responses: rewards, KL, paired arms, per-step fidelity."""

from __future__ import annotations

import pytest
import torch

from hilore_compiler.evaluation.task import TaskConfig, make_prompts, reward, right_positions


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
