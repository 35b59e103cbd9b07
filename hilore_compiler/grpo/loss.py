"""The clipped GRPO policy loss, with TRL's and verl's normalisations.

Every loss type is written as one weighted token sum,
``loss = sum_{i,t} w_{i,t} * mask_{i,t} * l_{i,t}``, where ``l`` is the
per-token loss and ``w`` the normalisation weight (``token_weights``). Keeping
``w`` separate is what lets ``coefficients.py`` give d loss / d logprob in
closed form, and lets a microbatch use the weights of the whole batch (pass the
batch totals as ``num_sequences`` / ``num_tokens``), so that the sum of
microbatch losses is the full-batch loss term by term.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import GRPOConfig


def per_token_advantages(advantages: Tensor, like: Tensor) -> Tensor:
    """Broadcast (B,) sequence advantages, or pass (B, T) token advantages, to ``like``'s shape."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    return advantages.to(like.dtype).expand_as(like)  # (B, T)


def token_weights(
    mask: Tensor,
    config: GRPOConfig,
    *,
    num_sequences: int | None = None,
    num_tokens: float | Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Normalisation weight ``w`` of each token, (B, T); masked tokens get their weight too.

    ``num_sequences`` / ``num_tokens`` are the totals of the batch the loss is
    normalised over; they default to this ``mask``'s own (so a full-batch call
    needs neither). For ``dapo`` ``num_tokens`` is the response-token count of
    the whole generation batch and must be given.
    """
    dtype = dtype or (mask.dtype if mask.is_floating_point() else torch.get_default_dtype())
    m = mask.to(dtype)  # (B, T)
    n_seq = m.shape[0] if num_sequences is None else num_sequences
    if config.loss_type == "grpo":
        # TRL: ((l * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
        per_seq = m.sum(-1, keepdim=True).clamp(min=1.0)  # (B, 1)
        return (1.0 / (per_seq * n_seq)).expand_as(m)
    if config.loss_type == "dr_grpo":
        # TRL: (l * m).sum() / (l.size(0) * max_completion_length)
        return torch.full_like(m, 1.0 / (n_seq * config.max_len))
    if config.loss_type == "dapo" and num_tokens is None:
        raise ValueError("loss_type='dapo' needs num_tokens: the generation batch's response tokens")
    # bnpo (TRL: (l * m).sum() / m.sum().clamp(min=1)) and dapo (TRL: (l * m).sum()
    # / num_items_in_batch, verl's "token-mean" over the global batch).
    if num_tokens is None:
        total = m.sum().clamp(min=1.0)
    else:
        total = torch.as_tensor(num_tokens, dtype=dtype, device=m.device)
    return (1.0 / total).expand_as(m)


def ratio_of(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """Importance ratio pi / pi_old per token, (B, T)."""
    return torch.exp(logprobs - old_logprobs)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimate of KL(pi || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1, (B, T).

    As TRL writes it; verl's ``low_var_kl`` is the same value clamped to
    [-10, 10], which we do not do so that the closed-form gradient stays exact.
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def per_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    config: GRPOConfig,
    *,
    ref_logprobs: Tensor | None = None,
) -> Tensor:
    """The unnormalised per-token loss ``l``, (B, T), differentiable in ``logprobs``.

    Clipped surrogate as TRL and verl's ``compute_policy_loss_vanilla``:
    ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; for A < 0 verl's dual
    clip then caps it at ``-A c``; TRL's ``+ beta * k3`` KL term follows.
    """
    adv = per_token_advantages(advantages, logprobs)  # (B, T)
    ratio = ratio_of(logprobs, old_logprobs)  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    loss = torch.maximum(-adv * ratio, -adv * clipped)
    if config.dual_clip_c is not None:
        capped = torch.minimum(loss, -adv * config.dual_clip_c)
        loss = torch.where(adv < 0, capped, loss)
    if config.beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        loss = loss + config.beta * k3_kl(logprobs, ref_logprobs)
    return loss


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    ref_logprobs: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """The scalar GRPO loss ``sum w * mask * l`` (see the module docstring).

    Shapes: ``logprobs``, ``old_logprobs``, ``ref_logprobs``, ``mask``: (B, T);
    ``advantages``: (B,) or (B, T). For a microbatch of a larger batch pass the
    larger batch's ``num_sequences`` and ``num_tokens``; the returned value is
    then that microbatch's exact share of the full-batch loss.
    """
    loss = per_token_loss(logprobs, old_logprobs, advantages, config, ref_logprobs=ref_logprobs)
    w = token_weights(
        mask, config, num_sequences=num_sequences, num_tokens=num_tokens, dtype=logprobs.dtype
    )
    return (loss * (w * mask.to(logprobs.dtype))).sum()
