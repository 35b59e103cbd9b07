"""The GRPO loss options, in one frozen record shared by every grpo module.

``GRPOLossConfig`` is named so that it does not clash with ``trl.GRPOConfig``
in a user's namespace; ``GRPOConfig`` stays as an alias. ``from_trl`` maps a
``trl.GRPOConfig`` onto it and refuses what has no closed-form coefficients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The normalisations users know from TRL's ``GRPOTrainer`` (``loss_type``).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: How group-relative advantages are scaled (TRL's ``scale_rewards``).
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOLossConfig:
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

    @classmethod
    def from_trl(cls, args: Any) -> GRPOLossConfig:
        """The loss a ``trl.GRPOConfig`` (or any object with its field names) trains with.

        Raises ``ValueError`` naming every setting whose token coefficients
        have no closed form here (see ``trl_unsupported``), rather than guess.
        """
        problems = trl_unsupported(args)
        if problems:
            raise ValueError(
                "hilore has no closed-form token coefficients for this TRL loss: "
                + "; ".join(problems)
            )
        eps_low = float(args.epsilon)
        eps_high = eps_low if getattr(args, "epsilon_high", None) is None else float(args.epsilon_high)
        delta = getattr(args, "delta", None)
        scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
        return cls(
            loss_type=args.loss_type,
            eps_low=eps_low,
            eps_high=eps_high,
            # TRL's two-sided clip caps the ratio at delta for every token; with
            # delta > 1 + eps_high it only bites for A < 0: verl's dual clip.
            dual_clip_c=None if delta is None else float(delta),
            beta=float(args.beta),
            max_len=getattr(args, "max_completion_length", None),
            scale_rewards=scale,
            adv_eps=1e-4,  # TRL adds 1e-4 to the std, a literal in its trainer
        )


#: TRL settings that add a per-token term or weight this record cannot express,
#: as (field, value that is fine, why). Checked by ``trl_unsupported``.
_TRL_NEUTRAL: tuple[tuple[str, Any, str], ...] = (
    ("importance_sampling_level", "token", "sequence-level ratios couple a sample's tokens"),
    ("top_entropy_quantile", 1.0, "the entropy mask is known only after the forward"),
    ("entropy_coef", 0.0, "an entropy bonus has a gradient that is not c_t * d logprob"),
    ("use_adaptive_entropy", False, "an entropy bonus has a gradient that is not c_t * d logprob"),
    ("off_policy_mask_threshold", None, "the off-policy mask is known only after the forward"),
)


def trl_unsupported(args: Any) -> list[str]:
    """Why ``args`` (a ``trl.GRPOConfig``) cannot be mapped; empty when it can."""
    problems = []
    if args.loss_type not in LOSS_TYPES:
        problems.append(
            f"loss_type={args.loss_type!r} (closed forms exist for {', '.join(LOSS_TYPES)})"
        )
    for name, neutral, why in _TRL_NEUTRAL:
        value = getattr(args, name, neutral)
        if value != neutral:
            problems.append(f"{name}={value!r}: {why}")
    if float(args.beta) != 0.0 and getattr(args, "use_bias_correction_kl", False):
        problems.append("use_bias_correction_kl=True: the KL term is then weighted by the ratio")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        problems.append("vLLM importance-sampling correction: its weights come from the sampler")
    delta, eps = getattr(args, "delta", None), getattr(args, "epsilon_high", None)
    eps_high = float(args.epsilon if eps is None else eps)
    if delta is not None and float(delta) <= 1.0 + eps_high:
        problems.append(f"delta={delta} <= 1 + epsilon_high also clips positive advantages")
    return problems


#: The former name, kept so existing code and saved notebooks keep working.
GRPOConfig = GRPOLossConfig
