"""Group-relative advantages from per-sample rewards (one scalar per sample).

Follows TRL's ``GRPOTrainer._generate_and_score_completions``: the group mean
is always subtracted; ``scale_rewards="group"`` divides by the group's std,
``"batch"`` by the std of all rewards in the batch, ``"none"`` not at all, and
``eps`` is added to the std. Like TRL (``torch.std``) the std is the unbiased
one. Groups are given by ids, so they need not be contiguous or equal-sized.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import SCALE_REWARDS


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """Advantage of each sample relative to its group: ``(r - mean_g) / (std + eps)``.

    ``rewards``: (B,) float; ``group_ids``: (B,) integer, equal ids share a
    group. Returns (B,) in ``rewards``' dtype. A group whose rewards are all
    equal gets advantages that are exactly 0 (its mean is taken to be its
    reward, not a rounded sum / count), which makes its exposure exactly zero.
    A one-sample group has no std; it is taken as 0 (its advantage is 0 anyway).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be (B,), got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,) dense group index
    mean, std = _group_mean_std(rewards, inverse)  # (B,) each, per sample's group
    centred = rewards - mean
    if scale_rewards == "group":
        return centred / (std + eps)
    if scale_rewards == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        return centred / (batch_std + eps)
    return centred


def _group_mean_std(rewards: Tensor, inverse: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample group mean and unbiased group std, both (B,)."""
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, inverse, torch.ones_like(rewards))
    total = torch.zeros_like(count).index_add_(0, inverse, rewards)
    mean = (total / count)[inverse]  # (B,)
    # Summing k equal floats and dividing by k is not exact (8 x 0.1 in fp32
    # leaves 7e-9), and that residue divided by a tiny std would give a group
    # with equal rewards a sizeable advantage. Such a group's mean is its reward.
    high = torch.full_like(count, -torch.inf).scatter_reduce_(0, inverse, rewards, "amax")
    low = torch.full_like(count, torch.inf).scatter_reduce_(0, inverse, rewards, "amin")
    mean = torch.where((high == low)[inverse], rewards, mean)
    # Two-pass variance (deviations from the mean) so that equal rewards give
    # exactly 0, not a rounding residue of E[r^2] - E[r]^2.
    sq = torch.zeros_like(count).index_add_(0, inverse, (rewards - mean) ** 2)
    var = sq / (count - 1).clamp(min=1)
    return mean, var.sqrt()[inverse]
