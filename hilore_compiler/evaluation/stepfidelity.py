"""Gradient fidelity along a training run: each measured step's update against the exact one, per bucket.

``fidelity`` compares gradients at fixed weights on synthetic batches. Here
the comparison follows the run: at a measured step of a compiled arm, the
exact update is computed on the very batch the arm trains on, at the arm's
current weights, by the arm's own eager policy (autograd stores every
activation), with the same exposure buckets, so both cut the batch into the
same microbatches. Every microbatch runs one bucket, so what a bucket adds
to ``.grad`` is read after each backward (``actor_update``'s
``after_backward``), and the cosine of the arm's bucket gradient with the
exact one is the fidelity of that bucket's plan on real samples. The arm then
steps with its own gradient: measuring does not change the run.

A bucket whose exact gradient is zero (samples whose coefficients are all 0,
e.g. in the first step, when the policy is still its KL reference and a
group's rewards are equal) has no direction to compare and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from ..grpo import ExposureBuckets, GRPOConfig, RolloutBatch, UpdateConfig, UpdateReport, actor_update
from .fidelity import compare, grad_vector


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFidelity:
    """A compiled arm's update against the exact one at one training step."""

    step: int
    #: Bucket name -> cosine of the arm's bucket gradient with the exact one.
    cosine: dict[str, float]
    #: Bucket name -> samples the bucket held.
    samples: dict[str, int]
    #: Cosine and relative L2 error of the whole update (every bucket summed).
    update_cosine: float
    update_rel_l2: float


class BucketGradients:
    """An ``after_backward`` callback: what each bucket's microbatches added to ``.grad``."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.seen = grad_vector(params)  # (P,) fp64: what was there before this update
        self.added: dict[str, Tensor] = {}

    def __call__(self, bucket: str) -> None:
        now = grad_vector(self.params)
        self.added[bucket] = self.added.get(bucket, 0.0) + (now - self.seen)
        self.seen = now


def bucket_gradients(model: nn.Module, params: list[nn.Parameter], batch: RolloutBatch, grpo: GRPOConfig,
                     update: UpdateConfig, buckets: ExposureBuckets | None
                     ) -> tuple[dict[str, Tensor], UpdateReport]:
    """Run ``actor_update`` without an optimizer; the gradient each bucket added, and the report.

    The gradient stays accumulated in ``params``' ``.grad``.
    """
    added = BucketGradients(params)
    report = actor_update(model, None, batch, grpo, update=update, buckets=buckets, after_backward=added)
    return added.added, report


def measured_update(model: nn.Module, policy: nn.Module, batch: RolloutBatch, grpo: GRPOConfig,
                    update: UpdateConfig, buckets: ExposureBuckets | None,
                    step: int) -> tuple[UpdateReport, StepFidelity]:
    """The update of ``model`` (a compiled view of ``policy``) and its fidelity to the exact one.

    The exact update runs first, on the eager ``policy``; its gradient is then
    cleared, and ``model``'s is left in ``.grad`` for the optimizer to step on.
    The report is ``model``'s.
    """
    params = list(policy.parameters())
    policy.zero_grad(set_to_none=True)
    exact, _ = bucket_gradients(policy, params, batch, grpo, update, buckets)
    exact_update = grad_vector(params)  # (P,)
    policy.zero_grad(set_to_none=True)
    approx, report = bucket_gradients(model, params, batch, grpo, update, buckets)
    cosine = {name: compare(approx[name], g)[1] for name, g in exact.items() if float(g.norm()) > 0.0}
    rel, cos = compare(grad_vector(params), exact_update)
    counts = {n: c for n, c in report.samples_per_bucket.items() if n in exact}
    return report, StepFidelity(step=step, cosine=cosine, samples=counts, update_cosine=cos, update_rel_l2=rel)
