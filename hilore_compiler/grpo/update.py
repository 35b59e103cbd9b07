"""One GRPO actor update, microbatched by exposure bucket.

Pipeline of ``actor_update``:

1. advantages (given, or group-relative from rewards);
2. on-policy exposure estimate per sample, before any forward;
3. buckets (given, e.g. from a plan, or from this batch's quantiles), one
   name per sample;
4. samples ordered into microbatches that never mix buckets; each forward runs
   under ``runtime.exposure(bucket)`` so a model compiled with the hilore
   backend uses that bucket's plan;
5. each microbatch's loss uses the whole batch's normaliser, so the
   accumulated gradient equals one full-batch backward of ``grpo_loss``;
6. optimizer step and zero_grad.

Samples in bucket ``"zero"`` skip forward and backward when that is exact:
with beta == 0 (and no other per-token term: this loss has no entropy bonus)
their c_t are all 0 whatever the ratio, so their gradient and their loss are
exactly 0. Their tokens still count in the normaliser (``num_tokens`` and
``num_sequences`` are the whole batch's).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..backend import runtime
from .advantages import group_advantages
from .buckets import ZERO, ExposureBuckets, exposure_buckets
from .coefficients import exposure_before_backward, exposure_before_forward
from .config import GRPOConfig
from .loss import grpo_loss


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutBatch:
    """What generation, scoring and the old/reference forwards produced."""

    #: (B, T) prompt + response token ids.
    input_ids: Tensor
    #: (B, T - 1) 1 where token t + 1 is a response token (aligned with
    #: ``token_logprobs``' shift), 0 for prompt and padding.
    response_mask: Tensor
    #: (B, T - 1) log-probs of the policy that generated the batch.
    old_logprobs: Tensor
    #: (B, T - 1) reference-policy log-probs; needed when beta > 0.
    ref_logprobs: Tensor | None = None
    #: (B,) or (B, T - 1); if None they are computed from ``rewards``/``group_ids``.
    advantages: Tensor | None = None
    #: (B,) one scalar reward per sample.
    rewards: Tensor | None = None
    #: (B,) integer group (prompt) id per sample.
    group_ids: Tensor | None = None
    #: Response tokens of the whole generation batch (``dapo``'s normaliser)
    #: when this batch is only part of it; None: this batch's response tokens.
    #: Under data parallelism with gradient averaging pass the per-process
    #: share, as TRL divides ``num_items_in_batch`` by ``num_processes``.
    generation_tokens: int | None = None

    def __post_init__(self) -> None:
        b, t = self.input_ids.shape
        for name in ("response_mask", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t - 1):
                raise ValueError(f"{name} must be (B, T-1) = {(b, t - 1)}, got {tuple(value.shape)}")
        if self.advantages is None and (self.rewards is None or self.group_ids is None):
            raise ValueError("RolloutBatch needs advantages, or rewards and group_ids")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateConfig:
    """How ``actor_update`` splits the batch; the loss itself is ``GRPOConfig``."""

    #: Most samples per forward/backward.
    microbatch_size: int = 8
    #: Nonzero buckets made from the batch's exposure quantiles (when no
    #: buckets are passed in).
    n_buckets: int = 4
    #: Skip forward and backward of zero-exposure samples where that is exact.
    skip_zero: bool = True

    def __post_init__(self) -> None:
        if self.microbatch_size < 1 or self.n_buckets < 1:
            raise ValueError("microbatch_size and n_buckets must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateReport:
    """What one ``actor_update`` did and how fast."""

    #: The full-batch loss (sum of the microbatch shares).
    loss: float
    #: Batch tokens (B * T, skipped samples included) per wall second of the update.
    tokens_per_s: float
    seconds: float
    #: Samples per bucket name, skipped ones under ``"zero"``.
    samples_per_bucket: Mapping[str, int]
    samples_skipped: int
    microbatches: int
    #: CUDA: max_memory_allocated during the update minus what was allocated
    #: before it. None on other devices.
    peak_memory_bytes: int | None
    buckets: ExposureBuckets
    #: Bucket name of each sample.
    sample_buckets: tuple[str, ...]
    #: Per sample: on-policy estimate, and exact value after the forward
    #: (exactly 0 for skipped samples, whose c_t are all 0).
    exposure_before_forward: tuple[float, ...]
    exposure_before_backward: tuple[float, ...]


def microbatches(
    names: Sequence[str], size: int, order: Sequence[str], skip: frozenset[str] = frozenset()
) -> list[tuple[str, list[int]]]:
    """Sample indices grouped by bucket name, cut into runs of at most ``size``.

    Buckets come in ``order`` (``ExposureBuckets.names``), samples in batch
    order; buckets in ``skip`` are left out. No run mixes two buckets.
    """
    out: list[tuple[str, list[int]]] = []
    for name in order:
        if name in skip:
            continue
        members = [i for i, n in enumerate(names) if n == name]
        out += [(name, members[k : k + size]) for k in range(0, len(members), size)]
    return out


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """(B, T, V) logits, (B, T) ids -> (B, T - 1) log-prob of token t + 1 (fp32).

    ``hilore_compiler.models.logprobs.token_logprobs``, imported here so that
    the grpo package does not import the model zoo.
    """
    from ..models.logprobs import token_logprobs as shifted_logprobs

    return shifted_logprobs(logits, input_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdatePlan:
    """The decisions ``actor_update`` makes before the first forward."""

    #: (B,) or (B, T - 1).
    advantages: Tensor
    #: The whole batch's totals that every microbatch loss is normalised by.
    num_sequences: int
    num_tokens: float
    #: (B,) on-policy exposure estimate.
    estimate: Tensor
    buckets: ExposureBuckets
    #: Bucket name of each sample.
    names: list[str]
    #: Buckets whose samples skip forward and backward.
    skip: frozenset[str]
    #: (bucket, sample indices) per microbatch, in run order.
    runs: list[tuple[str, list[int]]]


def plan_update(
    batch: RolloutBatch,
    config: GRPOConfig,
    update: UpdateConfig,
    buckets: ExposureBuckets | None = None,
) -> UpdatePlan:
    """Advantages, normaliser, exposure estimate, buckets and microbatches of ``batch``."""
    if batch.advantages is not None:
        adv = batch.advantages.to(batch.old_logprobs.dtype)
    else:
        adv = group_advantages(
            batch.rewards.to(batch.old_logprobs.dtype),
            batch.group_ids,
            scale_rewards=config.scale_rewards,
            eps=config.adv_eps,
        )
    if config.beta != 0.0 and batch.ref_logprobs is None:
        raise ValueError("beta > 0 needs batch.ref_logprobs")
    mask = batch.response_mask
    n_seq = mask.shape[0]
    n_tok = float(mask.sum().clamp(min=1))
    if config.loss_type == "dapo" and batch.generation_tokens is not None:
        n_tok = float(batch.generation_tokens)
    estimate = exposure_before_forward(
        adv, mask, config, old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
        num_sequences=n_seq, num_tokens=n_tok,
    )  # (B,)
    if buckets is None:
        buckets = exposure_buckets(estimate, update.n_buckets)
    names = buckets.assign(estimate)
    # Exact only without a KL term: with beta > 0 a zero-advantage sample still
    # has c_t = beta * (1 - exp(ref - logp)), unknown before its forward.
    skip = frozenset({ZERO}) if update.skip_zero and config.beta == 0.0 else frozenset()
    return UpdatePlan(
        advantages=adv, num_sequences=n_seq, num_tokens=n_tok, estimate=estimate,
        buckets=buckets, names=names, skip=skip,
        runs=microbatches(names, update.microbatch_size, buckets.names, skip),
    )


def _run_microbatches(
    model: nn.Module, batch: RolloutBatch, config: GRPOConfig, plan: UpdatePlan
) -> tuple[float, Tensor]:
    """Forward + backward of every run; returns the loss and the exact exposures (B,)."""
    exact = torch.zeros(batch.input_ids.shape[0], dtype=torch.float64)  # skipped stay exactly 0
    total = torch.zeros((), dtype=torch.float64, device=batch.input_ids.device)
    for name, idx in plan.runs:
        rows = torch.tensor(idx, device=batch.input_ids.device)
        loss, exposure = _microbatch(model, batch, config, plan, name, rows)
        exact[rows.cpu()] = exposure.to("cpu", torch.float64)
        total += loss.to(torch.float64)
    return float(total), exact


def _microbatch(
    model: nn.Module,
    batch: RolloutBatch,
    config: GRPOConfig,
    plan: UpdatePlan,
    bucket: str,
    rows: Tensor,
) -> tuple[Tensor, Tensor]:
    """One microbatch's forward and backward under ``bucket``; returns its loss share and exposures.

    A function of its own so that the logits and graph die when it returns,
    not when the next microbatch overwrites them.
    """
    ids = batch.input_ids[rows]  # (b, T)
    mb = dict(
        old_logprobs=batch.old_logprobs[rows],
        advantages=plan.advantages[rows],
        mask=batch.response_mask[rows],
        config=config,
        ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs[rows],
        # The whole batch's totals: each microbatch loss is its exact share.
        num_sequences=plan.num_sequences,
        num_tokens=plan.num_tokens,
    )
    with runtime.exposure(bucket):
        out = model(ids)
        logits = getattr(out, "logits", out)  # (b, T, V); HF models return an object
        logp = token_logprobs(logits, ids)  # (b, T-1)
        loss = grpo_loss(logp, **mb)
        exposure = exposure_before_backward(logp, **mb)  # (b,) exact, known before backward
        loss.backward()
    return loss.detach(), exposure


def actor_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: RolloutBatch,
    config: GRPOConfig,
    *,
    update: UpdateConfig = UpdateConfig(),
    buckets: ExposureBuckets | None = None,
) -> UpdateReport:
    """Run one GRPO actor update of ``model`` on ``batch``; see the module docstring.

    ``model(input_ids (b, T)) -> logits (b, T, V)``, typically compiled with
    ``backend="hilore"``. ``buckets``: fixed buckets (e.g. the plan's); None
    makes them from this batch. ``optimizer=None`` only accumulates the
    gradient into ``.grad`` (to inspect or compare it); otherwise the update
    ends with ``optimizer.step()`` and ``optimizer.zero_grad()``.
    """
    device = batch.input_ids.device
    before = _memory_start(device)
    start = time.perf_counter()
    plan = plan_update(batch, config, update, buckets)
    loss, exact = _run_microbatches(model, batch, config, plan)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are async; time and peak need them done
    seconds = time.perf_counter() - start
    peak = None if before is None else torch.cuda.max_memory_allocated(device) - before
    counts = {n: plan.names.count(n) for n in plan.buckets.names if n in plan.names}
    return UpdateReport(
        loss=loss,
        tokens_per_s=batch.input_ids.numel() / seconds,
        seconds=seconds,
        samples_per_bucket=counts,
        samples_skipped=sum(counts.get(n, 0) for n in plan.skip),
        microbatches=len(plan.runs),
        peak_memory_bytes=peak,
        buckets=plan.buckets,
        sample_buckets=tuple(plan.names),
        exposure_before_forward=tuple(plan.estimate.detach().cpu().double().tolist()),
        exposure_before_backward=tuple(exact.tolist()),
    )


def _memory_start(device: torch.device) -> int | None:
    """Reset the CUDA peak counter and return bytes allocated now; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)
