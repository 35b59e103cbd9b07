"""A verifiable toy task generated in code: digit prompts, a checkable rule, binary reward.

Tokens are bytes (the built-in policies have a 256-token vocabulary), so a
sample reads as text: prompt ``"3917="``, response ``"9"``. A prompt is
``prompt_digits`` random digits and the separator ``=``; the response is
``response_len`` digits, and the reward is 1 when the response satisfies the
rule, else 0. Prompts come from a ``torch.Generator``, so a seed fixes them.

Rules (``RULES``):

- ``max``: the response repeats the largest digit of the prompt;
- ``first``: the response repeats the first digit of the prompt;
- ``sorted``: the response is the prompt's first ``response_len`` digits in
  increasing order.
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

Rule = Callable[[Tensor, Tensor], Tensor]


def _max_rule(prompt: Tensor, response: Tensor) -> Tensor:
    target = prompt.max(dim=1, keepdim=True).values  # (n, 1)
    return (response == target).all(dim=1)


def _first_rule(prompt: Tensor, response: Tensor) -> Tensor:
    return (response == prompt[:, :1]).all(dim=1)


def _sorted_rule(prompt: Tensor, response: Tensor) -> Tensor:
    target = prompt[:, : response.shape[1]].sort(dim=1).values  # (n, R)
    return (response == target).all(dim=1)


#: Rule name -> ``rule(prompt digits (n, P), response digits (n, R)) -> bool (n,)``.
RULES: dict[str, Rule] = {"max": _max_rule, "first": _first_rule, "sorted": _sorted_rule}


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskConfig:
    """Which toy task: prompt length, response length and rule."""

    #: Random digits per prompt, before the separator.
    prompt_digits: int = 4
    #: Digits the policy emits after the separator.
    response_len: int = 1
    #: A key of ``RULES``.
    rule: str = "max"

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


def reward(config: TaskConfig, input_ids: Tensor) -> Tensor:
    """Binary reward (n,) float of full samples (n, seq_len): 1 if the rule holds.

    A response token that is not a digit never satisfies a rule (it reads as
    -1, and prompt digits are 0..9).
    """
    if input_ids.shape[1] != config.seq_len:
        raise ValueError(f"samples must be (n, {config.seq_len}), got {tuple(input_ids.shape)}")
    prompt = to_digits(input_ids[:, : config.prompt_digits])  # (n, P)
    response = to_digits(input_ids[:, config.prompt_len :])  # (n, R)
    ok = RULES[config.rule](prompt, response) & (response >= 0).all(dim=1)
    return ok.to(torch.float32)


def decode(tokens: Tensor) -> str:
    """One sample (T,) as text, e.g. ``"3917=9"``; non-printable bytes as ``?``."""
    return "".join(chr(t) if 32 <= t < 127 else "?" for t in tokens.tolist())
