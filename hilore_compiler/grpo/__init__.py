"""GRPO: the loss, per-token coefficients, exposure buckets and the actor update.

Modules in pipeline order:

- ``config``: ``GRPOLossConfig`` (alias ``GRPOConfig``), the loss options (TRL /
  verl names in comments); ``GRPOLossConfig.from_trl(trl_args)``.
- ``advantages``: group-relative advantages from rewards.
- ``loss``: the clipped policy loss with its normalisations, as one weighted
  token sum.
- ``coefficients``: c_t = d loss / d logprob_t in closed form (before the
  forward on-policy, exactly before backward) and exposure = sum_t |c_t|.
- ``buckets``: exposure buckets (``"zero"``, ``"b0"`` ... ``"b{n-1}"``).
- ``packing``: ``drop_then_pack``, the one rule that cuts an update into
  micro-batches (zero samples out, the rest least exposed first under a
  budget, one bucket per micro-batch where the counts allow).
- ``update``: one actor update, microbatched by bucket under
  ``runtime.exposure(bucket)``, with full-batch normalisation.
- ``step``: ``compiled_step``, the whole actor step (forward, log-probs, loss)
  compiled as one graph, so the planner sees the logits' memory too;
  optionally with chunked log-probs.
- ``chunks``: ``choose_chunk_tokens``, the log-prob chunk size as a planner
  decision: each size's plan priced by the memory model, the fitting ones timed.
"""

from .advantages import group_advantages
from .chunks import ChunkChoice, ChunkTrial, choose_chunk_tokens, default_chunk_candidates
from .buckets import ZERO, ExposureBuckets, bucket_names, exposure_buckets, plan_buckets
from .coefficients import (
    exposure_before_backward,
    exposure_before_forward,
    sample_exposure,
    token_coefficients,
    token_coefficients_before_forward,
)
from .config import LOSS_TYPES, SCALE_REWARDS, GRPOConfig, GRPOLossConfig, trl_unsupported
from .loss import grpo_loss, k3_kl, per_token_loss, token_weights
from .step import compiled_step, step_fn
from .update import (
    RolloutBatch,
    UpdateConfig,
    UpdatePlan,
    UpdateReport,
    actor_update,
    plan_update,
    token_logprobs,
)

__all__ = [
    "ChunkChoice",
    "ChunkTrial",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "ZERO",
    "ExposureBuckets",
    "GRPOConfig",
    "GRPOLossConfig",
    "RolloutBatch",
    "UpdateConfig",
    "UpdatePlan",
    "UpdateReport",
    "actor_update",
    "bucket_names",
    "choose_chunk_tokens",
    "compiled_step",
    "default_chunk_candidates",
    "exposure_before_backward",
    "exposure_before_forward",
    "exposure_buckets",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "per_token_loss",
    "plan_buckets",
    "plan_update",
    "sample_exposure",
    "step_fn",
    "token_coefficients",
    "token_coefficients_before_forward",
    "token_logprobs",
    "token_weights",
    "trl_unsupported",
]
