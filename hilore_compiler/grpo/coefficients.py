"""Per-token loss coefficients c_t = d loss / d logprob_t, and exposure.

The GRPO loss touches the model only through the response log-probs, so its
parameter gradient is ``sum_{i,t} c_{i,t} * d logprob_{i,t} / d theta``: c_t
says how strongly token t reaches the update, and a sample's exposure is
``sum_t |c_t|``. For ``loss = sum w * mask * l`` (``loss.py``):

    d l / d logp = -A * r * u  +  beta * (1 - exp(ref - logp))

where ``r = exp(logp - old)`` and ``u`` is 1 where the surrogate is not
clipped: for A > 0, r <= 1 + eps_high; for A < 0, r >= 1 - eps_low and (dual
clip) r <= c; A = 0 gives 0 either way. So:

- before backward (after the forward) r, u and the KL term are known, and
  ``token_coefficients`` is exact (autograd's gradient, up to ties such as
  r == c exactly, where torch.minimum/maximum split the gradient in halves);
- before the forward an on-policy update has logp == old, r = 1, which lies
  inside every clip range, so ``token_coefficients_before_forward`` is exact
  for the policy term. Its KL term is exact too when the reference and old
  log-probs are given (evaluated at logp = old). Without them it is left out:
  the KL part per token, beta * |1 - exp(ref - logp)|, is then unknown; it is
  at most beta where logp >= ref and unbounded where the policy puts much less
  mass on the token than the reference does.
- before the forward off-policy (a second optimizer iteration on the same
  batch) the ratio is unknown; ``exposure_bound_before_forward`` bounds |c_t|
  instead, so that a sample is never sent to a lossier bucket than its exact
  exposure calls for: for A > 0 the unclipped ratio is at most 1 + eps_high;
  for A < 0 it is at most the dual clip c, or a ratio bound the caller
  vouches for; with neither, or with a KL term, there is no bound and the
  sample goes to the top bucket (exposure inf).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .config import GRPOConfig
from .loss import per_token_advantages, ratio_of, token_weights


def unclipped(ratio: Tensor, advantages: Tensor, config: GRPOConfig) -> Tensor:
    """Bool (B, T): where the clipped surrogate still depends on the ratio.

    Clamp's gradient passes at the clip bounds themselves, hence ``<=``/``>=``.
    """
    high = ratio <= 1.0 + config.eps_high  # A > 0: only an upper clip bites
    low = ratio >= 1.0 - config.eps_low  # A < 0: only a lower clip bites
    if config.dual_clip_c is not None:
        low = low & (ratio <= config.dual_clip_c)  # verl's dual clip, A < 0 only
    return torch.where(advantages > 0, high, low)


def token_coefficients(
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
    """Exact c_t = d grpo_loss / d logprobs_t, (B, T), from values known after the forward.

    Takes the same arguments as ``grpo_loss``; ``logprobs`` is read, not
    differentiated, so no backward is needed.
    """
    logp = logprobs.detach()  # (B, T)
    adv = per_token_advantages(advantages, logp)  # (B, T)
    ratio = ratio_of(logp, old_logprobs)
    grad = -adv * ratio * unclipped(ratio, adv, config)
    if config.beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs ref_logprobs")
        grad = grad + config.beta * (1.0 - torch.exp(ref_logprobs - logp))
    w = token_weights(mask, config, num_sequences=num_sequences, num_tokens=num_tokens, dtype=logp.dtype)
    return w * mask.to(logp.dtype) * grad


def token_coefficients_before_forward(
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: float | Tensor | None = None,
) -> Tensor:
    """On-policy estimate of c_t, (B, T), from advantages and normalisation alone.

    Assumes ratio = 1 (logprobs == old_logprobs): exact for the first update
    on a freshly generated batch. With ``beta > 0`` the KL term is included
    only when both ``old_logprobs`` and ``ref_logprobs`` are given; otherwise
    it is left out (see the module docstring for what is then unknown).
    """
    dtype = advantages.dtype if advantages.is_floating_point() else torch.get_default_dtype()
    m = mask.to(dtype)  # (B, T)
    # r = 1 lies inside [1 - eps_low, 1 + eps_high] and below c > 1: nothing is clipped.
    grad = -per_token_advantages(advantages, m)  # (B, T)
    if config.beta != 0.0 and old_logprobs is not None and ref_logprobs is not None:
        grad = grad + config.beta * (1.0 - torch.exp(ref_logprobs - old_logprobs).to(dtype))
    w = token_weights(mask, config, num_sequences=num_sequences, num_tokens=num_tokens, dtype=dtype)
    return w * m * grad


def exposure_bound_before_forward(
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    *,
    on_policy: bool,
    max_ratio: float | None = None,
    **kwargs,
) -> Tensor:
    """(B,) exposure that the backward will not exceed, known before the forward.

    ``on_policy``: the batch was generated by the current weights (ratio 1):
    the estimate is exact. Otherwise each token's |c_t| is bounded by
    |A| w x (1 + eps_high) where A > 0 and |A| w x (dual clip c, else
    ``max_ratio``) where A < 0; a token with no bound, or any token when
    beta > 0, makes its sample's bound inf. Exactly-zero advantages (and
    beta == 0) keep exposure exactly 0 either way. Keyword arguments as
    ``token_coefficients_before_forward``.
    """
    if on_policy:
        return exposure_before_forward(advantages, mask, config, **kwargs)
    kwargs.pop("old_logprobs", None)
    kwargs.pop("ref_logprobs", None)
    policy_only = dataclasses.replace(config, beta=0.0)
    base = token_coefficients_before_forward(advantages, mask, policy_only, **kwargs).abs()  # (B, T) |A| w
    adv = per_token_advantages(advantages, base)  # (B, T)
    low = config.dual_clip_c if config.dual_clip_c is not None else max_ratio
    high = 1.0 + config.eps_high
    bound = torch.where(adv > 0, base * high, base * (low if low is not None else torch.inf))
    bound = torch.where(base == 0, torch.zeros_like(bound), bound)  # 0 * inf is not a bound
    exposure = bound.sum(-1)  # (B,)
    if config.beta != 0.0:  # the KL term's size is unknown before the forward
        exposure = torch.full_like(exposure, torch.inf)
    return exposure


def sample_exposure(coefficients: Tensor) -> Tensor:
    """Exposure of each sample, sum_t |c_t|: (B, T) -> (B,)."""
    return coefficients.abs().sum(-1)


def exposure_before_forward(advantages: Tensor, mask: Tensor, config: GRPOConfig, **kwargs) -> Tensor:
    """(B,) on-policy exposure estimate; keyword arguments as ``token_coefficients_before_forward``."""
    return sample_exposure(token_coefficients_before_forward(advantages, mask, config, **kwargs))


def exposure_before_backward(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOConfig,
    **kwargs,
) -> Tensor:
    """(B,) exact exposure after the forward; keyword arguments as ``token_coefficients``."""
    return sample_exposure(
        token_coefficients(logprobs, old_logprobs, advantages, mask, config, **kwargs)
    )
