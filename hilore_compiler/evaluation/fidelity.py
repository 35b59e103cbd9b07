"""Gradient fidelity per exposure bucket: a compiled arm's gradient against the exact one.

For every nonzero bucket of an arm's plan, a rollout-like batch is built: real
samples of the policy (prompts and responses from a fixed generator), with
advantages whose size puts every sample's exposure inside that bucket, so the
whole backward runs that bucket's variant. Both the arm and the exact eager
policy, holding the same weights, run ``actor_update`` without an optimizer on
it, and the accumulated gradients are compared: relative L2 error
``|g - g_exact| / |g_exact|`` and cosine, over all parameters at once. A
``mixed`` row does the same on a batch with group-relative advantages from the
task's rewards, where samples spread over the buckets as in training.

The sign of each synthetic advantage is random: on-policy the loss is linear
in the advantages, so their size only selects the bucket and the relative
error does not depend on it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..grpo import GRPOConfig, UpdateConfig, actor_update, plan_buckets
from ..planfile import BucketSpec
from .arms import Arm, load_weights, option_counts
from .rollout import rollout
from .task import TaskConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class FidelityRow:
    """One arm's gradient against the exact one on one bucket's batch."""

    arm: str
    #: The arm's budget as solved (or ``"-"`` for exposure-blind plans).
    budget: str
    bucket: str
    #: |advantage| given to every sample (plan exposure units); None for ``mixed``.
    advantage: float | None
    rel_l2: float
    cosine: float
    #: Samples per bucket ``actor_update`` actually ran (checks the bucket was hit).
    samples_per_bucket: dict[str, int]
    #: The bucket's option counts, e.g. ``{"store": 6, "compress:int8": 13}``.
    options: dict[str, int]
    predicted_memory_bytes: int | None


def bucket_advantage(spec: BucketSpec) -> float:
    """An |advantage| safely inside ``spec``'s exposure range (plan units).

    The middle of the range in log scale, or its planned exposure when the
    range is unbounded; an edge itself is avoided so that rounding in the
    plan -> batch unit conversion cannot move a sample across it.
    """
    if math.isinf(spec.hi):
        return max(spec.exposure, 2.0 * spec.lo)
    if spec.lo <= 0.0:
        return spec.hi / 2.0
    return math.sqrt(spec.lo * spec.hi)


def grad_vector(params: list[torch.nn.Parameter]) -> Tensor:
    """The parameters' accumulated ``.grad`` as one fp64 vector (zeros where there is none)."""
    return torch.cat([p.grad.reshape(-1).double() if p.grad is not None
                      else torch.zeros(p.numel(), dtype=torch.float64) for p in params])


def flat_grad(arm: Arm) -> Tensor:
    """All parameter gradients of the arm's policy as one fp64 vector; clears them."""
    grads = grad_vector(list(arm.policy.parameters()))
    arm.policy.zero_grad(set_to_none=True)
    return grads


def compare(grad: Tensor, exact: Tensor) -> tuple[float, float]:
    """(relative L2 error, cosine) of ``grad`` against ``exact``."""
    rel = float((grad - exact).norm() / exact.norm().clamp_min(1e-30))
    cos = float(torch.nn.functional.cosine_similarity(grad, exact, dim=0))
    return rel, cos


@dataclass(frozen=True, slots=True, kw_only=True)
class FidelitySetup:
    """What every fidelity batch shares."""

    task: TaskConfig
    grpo: GRPOConfig
    update: UpdateConfig
    #: Prompts per batch; each gets ``group_size`` samples.
    prompts: int
    group_size: int
    seed: int


def _batches(policy: torch.nn.Module, setup: FidelitySetup, specs: list[BucketSpec]):
    """(bucket name, |advantage| or None, RolloutBatch) for each bucket, then ``mixed``."""
    generator = torch.Generator().manual_seed(setup.seed)
    base = rollout(policy, setup.task, num_prompts=setup.prompts, group_size=setup.group_size,
                   generator=generator).batch
    signs = torch.randint(0, 2, (base.input_ids.shape[0],), generator=generator) * 2.0 - 1.0  # (B,)
    for spec in specs:
        size = bucket_advantage(spec)
        yield spec.name, size, dataclasses.replace(base, advantages=signs * size)
    yield "mixed", None, base


def arm_fidelity(arm: Arm, exact: Arm, state: dict[str, Tensor], setup: FidelitySetup,
                 budget: str) -> list[FidelityRow]:
    """Fidelity rows of ``arm`` (one per nonzero bucket of its plan, then ``mixed``)."""
    load_weights(arm, state)
    load_weights(exact, state)
    specs = [b.bucket for b in arm.plan.buckets if not b.skip]
    rows = []
    for name, size, batch in _batches(exact.policy, setup, specs):
        buckets = plan_buckets(arm.plan, batch.input_ids.shape[0])
        grads = []
        for side in (exact, arm):
            report = actor_update(side.model, None, batch, setup.grpo, update=setup.update, buckets=buckets)
            grads.append(flat_grad(side))
        rel, cos = compare(grads[1], grads[0])
        bucket_plan = arm.plan.bucket(name) if name != "mixed" else None
        rows.append(FidelityRow(
            arm=arm.name, budget=budget, bucket=name, advantage=size, rel_l2=rel, cosine=cos,
            samples_per_bucket=dict(report.samples_per_bucket),
            options=option_counts(bucket_plan) if bucket_plan else {},
            predicted_memory_bytes=bucket_plan.memory_bytes if bucket_plan else None,
        ))
    return rows
