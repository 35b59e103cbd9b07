"""Sampling from the policy with a fixed generator, and scoring what it wrote.

Generation is plain autoregressive sampling at temperature 1, one full
forward per new token (no KV cache: the built-in policies have none, and at
the toy tasks' 6-21 tokens a forward of the tiny policy costs milliseconds),
in eager mode under ``no_grad``. Every
random draw comes from the ``torch.Generator`` passed in, so two policies with
bitwise-equal weights given generators in the same state write the same
samples: that is what pairs the arms of the training run.

Sampling is constrained to the task's alphabet (the ten digit tokens): the
logits outside it are dropped before the softmax. The log-probs GRPO trains
(``old_logprobs`` and the update's own) are the policy's full-vocabulary ones;
their gradient differs from the constrained policy's by d log P(alphabet | context),
which at the first response position is the same for every sample of a group
and cancels against the group's zero-sum advantages. At later positions of a
long response the contexts differ and it does not cancel; on 8-digit
responses the two gradients measured a cosine of 0.96 at initialisation. Every arm trains
the same objective, and the comparison is between arms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..grpo import RolloutBatch
from ..models import token_logprobs
from .task import DIGIT_TOKENS, TaskConfig, make_prompts, reward


@dataclass(frozen=True, slots=True, kw_only=True)
class Rollouts:
    """One generation batch: the samples, their rewards, and the batch for ``actor_update``."""

    batch: RolloutBatch
    #: (B,) binary rewards, float32.
    rewards: Tensor


@torch.no_grad()
def sample_responses(
    policy: nn.Module,
    prompts: Tensor,
    response_len: int,
    generator: torch.Generator,
    *,
    alphabet: tuple[int, ...] | None = DIGIT_TOKENS,
    temperature: float = 1.0,
) -> Tensor:
    """Append ``response_len`` sampled tokens to ``prompts`` (n, P) -> (n, P + response_len).

    ``temperature`` 0 takes the most likely token (greedy), with no random draw.
    """
    ids = prompts
    allowed = None if alphabet is None else torch.tensor(alphabet, dtype=torch.long)  # (A,)
    for _ in range(response_len):
        logits = policy(ids)[:, -1, :].float()  # (n, V): the next token's logits
        if allowed is not None:
            logits = logits[:, allowed]  # (n, A)
        if temperature == 0.0:
            pick = logits.argmax(dim=-1)  # (n,)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)  # (n, A or V)
            pick = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (n,)
        token = pick if allowed is None else allowed[pick]
        ids = torch.cat([ids, token.unsqueeze(1)], dim=1)
    return ids


@torch.no_grad()
def rollout(
    policy: nn.Module,
    config: TaskConfig,
    *,
    num_prompts: int,
    group_size: int,
    generator: torch.Generator,
    reference: nn.Module | None = None,
) -> Rollouts:
    """Draw ``num_prompts`` prompts, sample ``group_size`` responses each, score them.

    Groups are contiguous: samples ``g * group_size ... (g + 1) * group_size - 1``
    answer prompt ``g``. Prompts and samples both come from ``generator``.
    ``reference``: the KL term's reference policy; its log-probs of the
    samples go into the batch (``ref_logprobs``), as a GRPO trainer with
    beta > 0 computes them.
    """
    prompts = make_prompts(config, num_prompts, generator)  # (G, P + 1)
    prompts = prompts.repeat_interleave(group_size, dim=0)  # (B, P + 1)
    ids = sample_responses(policy, prompts, config.response_len, generator)  # (B, T)
    rewards = reward(config, ids)  # (B,)
    # Column t of the shifted log-probs is token t + 1: responses start at column P.
    cols = torch.arange(ids.shape[1] - 1)
    mask = (cols >= config.prompt_len - 1).to(torch.float32).expand(ids.shape[0], -1)  # (B, T-1)
    old = token_logprobs(policy(ids), ids)  # (B, T-1), fp32
    ref = None if reference is None else token_logprobs(reference(ids), ids)  # (B, T-1)
    groups = torch.arange(num_prompts).repeat_interleave(group_size)  # (B,)
    batch = RolloutBatch(input_ids=ids, response_mask=mask.contiguous(), old_logprobs=old,
                         ref_logprobs=ref, rewards=rewards, group_ids=groups)
    return Rollouts(batch=batch, rewards=rewards)


@torch.no_grad()
def task_score(policy: nn.Module, config: TaskConfig, prompts: Tensor) -> float:
    """Fraction of ``prompts`` (n, P + 1) the policy answers right with greedy decoding.

    Greedy, not sampled: the score is then a function of the weights alone,
    so a paired difference between two arms carries no sampling noise.
    """
    ids = sample_responses(policy, prompts, config.response_len, torch.Generator(), temperature=0.0)
    return float(reward(config, ids).mean())
