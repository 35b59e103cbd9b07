"""The actor bench's plans: trace the policy, calibrate it on the update's own loss, solve.

``hilore bench --actor-update`` (``actor.py``) runs the bucketed plan, the
exposure-blind plan and uniform int8, all solved here once, in the driver,
from one trace at the microbatch shape, with the update's loss side and its
gradient accumulation in the memory model, so each worker only loads a plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..grpo import RolloutBatch
from .actor import CALIBRATION_MICROBATCHES, LOSSY_CODECS, ActorBenchConfig, batch_exposures, loss_config, make_batch
from .rounds import Progress


def calibrate_on(policy: torch.nn.Module, trace: Any, batch: RolloutBatch, config: ActorBenchConfig) -> Any:
    """``trace`` with sensitivities measured on the update's own loss over
    ``CALIBRATION_MICROBATCHES`` of the batch's microbatches: per kind for
    the accurate codecs, per unit for the lossy ones (``LOSSY_CODECS``).

    Where the error budget binds (int4 on offer), the plans are only as safe
    as their sensitivities: the proxy under-predicted a blind int4 plan's
    error 3x on one microbatch of this model, one kind's int4 error varies up
    to 8x across layers, and one microbatch with the trace loss read 5-20%
    under the update's own error (``passes/calibration.py``).
    """
    from ..grpo import grpo_loss
    from ..models import token_logprobs
    from ..passes.calibration import CalibrationConfig, calibrate

    n, m = batch.input_ids.shape[0], config.microbatch
    num_tokens = float(batch.response_mask.sum())
    # Microbatches whose samples reach the update (a zero-variance group's do not).
    live = [i for i in range(0, n - m + 1, m) if float(batch.advantages[i:i + m].abs().sum()) > 0]
    picked = live[::max(1, len(live) // CALIBRATION_MICROBATCHES)][:CALIBRATION_MICROBATCHES]
    if not picked:
        raise ValueError("the batch has no sample with a nonzero advantage: nothing to calibrate on")

    def microbatch(i: int):
        ids = batch.input_ids[i:i + m]  # (micro, T)

        def loss(logits: torch.Tensor) -> torch.Tensor:
            return grpo_loss(token_logprobs(logits, ids), batch.old_logprobs[i:i + m], batch.advantages[i:i + m],
                             batch.response_mask[i:i + m], loss_config(config), num_sequences=n,
                             num_tokens=num_tokens)
        return [ids], loss

    (first, loss), *more = [microbatch(i) for i in picked]
    accurate = tuple(c for c in config.codecs if c not in LOSSY_CODECS)
    lossy = tuple(c for c in config.codecs if c in LOSSY_CODECS)
    if accurate:
        trace = calibrate(policy, first, loss, trace, more=more,
                          config=CalibrationConfig(verbose=False, codecs=accurate))
    if lossy:
        trace = calibrate(policy, first, loss, trace, more=more,
                          config=CalibrationConfig(verbose=False, codecs=lossy, per_unit=True))
    return trace


def loss_ratio(policy: torch.nn.Module, batch: RolloutBatch, config: ActorBenchConfig) -> float:
    """The update's loss side over the logits' bytes (``measure.loss_side``), as plans take it
    (``measure.plan_loss_ratio``).

    ``grpo.actor_update`` runs the token log-probs and ``grpo_loss`` eagerly
    on the compiled policy's logits; their backward holds about 3x the logits
    (logsumexp's gradient, the gather's dense gradient and their sum) while
    every kept activation is alive.
    """
    from ..grpo import grpo_loss
    from ..models import token_logprobs
    from .measure import loss_side, plan_loss_ratio

    m, n = config.microbatch, batch.input_ids.shape[0]
    ids, num_tokens = batch.input_ids[:m], float(batch.response_mask.sum())  # (m, T)

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return grpo_loss(token_logprobs(logits, ids), batch.old_logprobs[:m], batch.advantages[:m],
                         batch.response_mask[:m], loss_config(config), num_sequences=n, num_tokens=num_tokens)

    shape = (m, config.seq_len, policy.config.vocab_size)
    return plan_loss_ratio(loss_side(loss, shape, next(policy.parameters()).dtype, "cpu"))


def solve_plans(config: ActorBenchConfig, run_dir: Path, progress: Progress,
                gc_peak_bytes: int | None = None, calibrated: Path | None = None) -> dict[str, Any]:
    """Trace the policy at the microbatch shape and solve the bucketed and the blind plan,
    with ``x-gc`` budgets relative to ``gc_peak_bytes`` (GC's measured update peak in tensor bytes) when given.

    ``calibrated``: where the calibrated trace is kept. An existing file is
    read instead of tracing and calibrating again; it must come from the
    same ``config``; a missing one is written.
    """
    from ..evaluation.arms import trace_policy
    from ..models import build_model
    from ..solver import predicted_error, solve
    from ..solver.fixed import exposure_blind_plan
    from ..tracefile import load_trace
    from .methods import uniform_plan

    policy = build_model(config.model, seed=config.seed)
    batch = make_batch(policy, config)
    mix = batch_exposures(batch, config)
    if calibrated is not None and Path(calibrated).exists():
        progress(f"reading the calibrated trace {calibrated}")
        trace = load_trace(calibrated)
    else:
        progress(f"tracing {config.model} at ({config.microbatch}, {config.seq_len})")
        trace = trace_policy(policy, config.microbatch, config.seq_len, codecs=config.codecs)
        per_unit = [c for c in config.codecs if c in LOSSY_CODECS]
        progress("calibrating the codecs' gradient error (one unit of each kind at a time"
                 + (f"; every unit for {', '.join(per_unit)})" if per_unit else ")"))
        trace = calibrate_on(policy, trace, batch, config)
        if calibrated is not None:
            trace.save(calibrated)
    ratio = loss_ratio(policy, batch, config)
    progress(f"loss side: {ratio:g}x the logits' bytes (eager token log-probs and GRPO loss)")
    # The update sums every microbatch's gradient into .grad: the weights'
    # gradients are alive through every microbatch but the first.
    common = dict(risk_budget=config.risk_budget, buckets=config.buckets, codecs=list(config.codecs),
                  exposure_mix=mix, gradient_exposures=batch_exposures(batch, config, on_policy=True),
                  loss_ratio=ratio, gc_peak_bytes=gc_peak_bytes, accumulate_gradients=True)
    plans = {"buckets": solve(trace, config.budget, **common),
             "blind": exposure_blind_plan(trace, config.budget, **common)}
    if "uniform-int8" in config.methods:  # one bucket; its peak is predicted as the others' are
        plans["uniform"] = uniform_plan(trace, "int8", ratio, codecs=list(config.codecs), exposure_mix=mix,
                                        accumulate_gradients=True)
    paths = {name: str(plan.save(run_dir / f"plan-{name}.json")) for name, plan in plans.items()}
    info = {name: {"predicted_error": predicted_error(p), "budget_bytes": p.budget_bytes,
                   "distinct_plans": len({b.decisions for b in p.buckets if not b.skip}),
                   "buckets": {b.bucket.name: {"samples": b.sample_share, "mass": b.mass_share,
                                               "error_share": b.error_share, "risk": b.risk, "time_s": b.time_s,
                                               "memory_bytes": b.memory_bytes}
                               for b in p.buckets}}
            for name, p in plans.items()}
    progress("plans: " + "; ".join(f"{n} predicted error {i['predicted_error']:.2e}, "
                                   f"{i['distinct_plans']} distinct" for n, i in info.items()))
    return {"paths": paths, "info": info, "mix": mix}
