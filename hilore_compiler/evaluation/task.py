"""A verifiable toy task generated in code: digit prompts, a checkable rule, a reward.

Tokens are bytes (the built-in policies have a 256-token vocabulary), so a
sample reads as text: prompt ``"3917="``, response ``"9"``. A prompt is
``prompt_digits`` random digits and the separator ``=``; the response is
``response_len`` digits. A rule checks every response position; each admits
exactly one right response per prompt. The reward is 1 when every position
is right, else 0, or with ``partial_credit`` the fraction of right positions:
a dense signal, since a 16-digit response is almost never exactly right early
in training. Prompts come from a ``torch.Generator``, so a seed fixes them.

Rules (``RULES``):

- ``max``: the response repeats the largest digit of the prompt;
- ``first``: the response repeats the first digit of the prompt;
- ``sorted``: the response is the prompt's first ``response_len`` digits in
  increasing order;
- ``multiples``: the last digits of m, 2m, 3m, ... for m the prompt's largest
  digit (``"3917=9876543210987654"``). Position i is right when it is the
  previous response digit plus m (mod 10), the first when it is m: each step
  is checked given the steps before it, as a grader checks a worked sum.

Why ``multiples`` and a step-wise check for long responses: a rule whose
position i must equal a fixed target (``sorted``, or copying the prompt)
rewards the tiny policy only for knowing its absolute position, which its
rotary attention does not give it. Trained from scratch on the CPU (64
samples a step, lr 1e-3), such rules stayed near chance: greedy partial
credit 0.16 -> 0.20 in 500 steps sorting 16 digits, 0.10 -> 0.11 in 300
copying them; ``multiples`` rose from 0.06 to 0.41 in 400.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: Token id of the digit 0 (ASCII '0'); digit d is token DIGIT_ZERO + d.
DIGIT_ZERO = ord("0")
#: Token id of the separator between prompt and response (ASCII '=').
SEPARATOR = ord("=")
#: The response alphabet: the ten digit tokens, in digit order.
DIGIT_TOKENS = tuple(range(DIGIT_ZERO, DIGIT_ZERO + 10))

#: ``rule(prompt digits (n, P), response digits (n, R)) -> bool (n, R)``: which
#: positions are right. A non-digit response token reads as -1 and is never right.
Rule = Callable[[Tensor, Tensor], Tensor]


def _max_rule(prompt: Tensor, response: Tensor) -> Tensor:
    return response == prompt.max(dim=1, keepdim=True).values  # (n, R) against (n, 1)


def _first_rule(prompt: Tensor, response: Tensor) -> Tensor:
    return response == prompt[:, :1]


def _sorted_rule(prompt: Tensor, response: Tensor) -> Tensor:
    return response == prompt[:, : response.shape[1]].sort(dim=1).values  # (n, R)


def _multiples_rule(prompt: Tensor, response: Tensor) -> Tensor:
    m = prompt.max(dim=1, keepdim=True).values  # (n, 1)
    previous = torch.cat([torch.zeros_like(m), response[:, :-1]], dim=1)  # (n, R): 0 before the first
    return (response == (previous + m) % 10) & (previous >= 0)


RULES: dict[str, Rule] = {"max": _max_rule, "first": _first_rule, "sorted": _sorted_rule,
                          "multiples": _multiples_rule}


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskConfig:
    """Which toy task: prompt length, response length and rule."""

    #: Random digits per prompt, before the separator.
    prompt_digits: int = 4
    #: Digits the policy emits after the separator.
    response_len: int = 1
    #: A key of ``RULES``.
    rule: str = "max"
    #: Reward the fraction of right response positions, not only an all-right response.
    partial_credit: bool = False

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown rule {self.rule!r}; rules: {sorted(RULES)}")
        if self.prompt_digits < 1 or self.response_len < 1:
            raise ValueError("prompt_digits and response_len must be >= 1")
        if self.rule == "sorted" and self.response_len > self.prompt_digits:
            raise ValueError("rule 'sorted' needs response_len <= prompt_digits")

    @property
    def prompt_len(self) -> int:
        """Prompt tokens: the digits and the separator."""
        return self.prompt_digits + 1

    @property
    def seq_len(self) -> int:
        """Tokens of one sample: prompt plus response."""
        return self.prompt_len + self.response_len


def make_prompts(config: TaskConfig, n: int, generator: torch.Generator) -> Tensor:
    """``n`` prompts as token ids (n, prompt_len): random digits, then the separator."""
    digits = torch.randint(0, 10, (n, config.prompt_digits), generator=generator)  # (n, P)
    sep = torch.full((n, 1), SEPARATOR, dtype=torch.long)
    return torch.cat([digits + DIGIT_ZERO, sep], dim=1)  # (n, P + 1)


def to_digits(tokens: Tensor) -> Tensor:
    """Digit value of each token; -1 where a token is not a digit."""
    value = tokens - DIGIT_ZERO
    return torch.where((value >= 0) & (value <= 9), value, torch.full_like(value, -1))


def right_positions(config: TaskConfig, input_ids: Tensor) -> Tensor:
    """Bool (n, R): the rule's verdict on each response position of full samples (n, seq_len)."""
    if input_ids.shape[1] != config.seq_len:
        raise ValueError(f"samples must be (n, {config.seq_len}), got {tuple(input_ids.shape)}")
    prompt = to_digits(input_ids[:, : config.prompt_digits])  # (n, P)
    response = to_digits(input_ids[:, config.prompt_len :])  # (n, R)
    # A non-digit reads as -1, which no rule accepts (prompt digits are 0..9).
    return RULES[config.rule](prompt, response) & (response >= 0)


def reward(config: TaskConfig, input_ids: Tensor) -> Tensor:
    """Reward (n,) float32 of full samples (n, seq_len): 1 if every position is right,
    else 0; with ``config.partial_credit`` the fraction of right positions."""
    right = right_positions(config, input_ids)  # (n, R)
    if config.partial_credit:
        return right.to(torch.float32).mean(dim=1)
    return right.all(dim=1).to(torch.float32)


def decode(tokens: Tensor) -> str:
    """One sample (T,) as text, e.g. ``"3917=9"``; non-printable bytes as ``?``."""
    return "".join(chr(t) if 32 <= t < 127 else "?" for t in tokens.tolist())
