"""The GRPO loss options, in one frozen record shared by every grpo module."""

from __future__ import annotations

from dataclasses import dataclass

#: The normalisations users know from TRL's ``GRPOTrainer`` (``loss_type``).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: How group-relative advantages are scaled (TRL's ``scale_rewards``).
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOConfig:
    """What the clipped GRPO policy loss computes and how it is normalised."""

    #: ``"grpo"``: token mean per sequence, then mean over sequences.
    #: ``"bnpo"``: token mean over the batch given to the loss.
    #: ``"dr_grpo"``: token sum / (``max_len`` * number of sequences).
    #: ``"dapo"``: token sum / response tokens of the whole generation batch
    #: (passed in, so that every microbatch shares one normaliser).
    loss_type: str = "grpo"
    #: Lower clip range: the ratio is clipped below at ``1 - eps_low``.
    eps_low: float = 0.2
    #: Upper clip range: the ratio is clipped above at ``1 + eps_high``
    #: (DAPO's "clip-higher" uses 0.28).
    eps_high: float = 0.2
    #: Dual clip (verl's ``clip_ratio_c``): for negative advantages the loss is
    #: capped at ``-A * dual_clip_c``, so a huge ratio cannot blow it up. Must be
    #: > 1. None turns it off.
    dual_clip_c: float | None = None
    #: Coefficient of the k3 KL estimate to the reference policy, added per token
    #: before normalisation (as TRL does). 0 needs no reference log-probs.
    beta: float = 0.0
    #: The constant length ``dr_grpo`` divides by (TRL's
    #: ``max_completion_length``); required for that loss type only.
    max_len: int | None = None
    #: ``"group"``: divide advantages by the group's reward std; ``"batch"``:
    #: by the batch's reward std; ``"none"``: only subtract the group mean.
    scale_rewards: str = "group"
    #: Added to the std before dividing, so equal-reward groups stay finite
    #: (TRL uses 1e-4).
    adv_eps: float = 1e-4

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(
                f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}"
            )
        if not (0.0 <= self.eps_low < 1.0) or self.eps_high < 0.0:
            raise ValueError(
                f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}"
            )
        # verl asserts the same: a cap at or below 1 would clip on-policy tokens.
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")
        if self.beta < 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.loss_type == "dr_grpo" and (self.max_len is None or self.max_len < 1):
            raise ValueError("loss_type='dr_grpo' needs max_len >= 1 (the constant length divisor)")
        if self.adv_eps < 0.0:
            raise ValueError(f"adv_eps must be >= 0, got {self.adv_eps}")
