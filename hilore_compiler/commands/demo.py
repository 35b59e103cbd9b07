"""``hilore demo``: the whole pipeline on a built-in model, end to end, with a verdict.

trace -> plan (one ILP over the exposure buckets) -> ``torch.compile(backend="hilore")``
-> one GRPO actor update, whose peak is measured against the plan's ceiling and
whose gradient is compared with an exact (store-all, eager) update's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..progress import tell
from ..vocabulary import DEFAULT_CODECS, ZERO_BUCKET
from . import SUMMARIES

if TYPE_CHECKING:
    import torch

    from ..grpo import RolloutBatch

#: The gradient cosine against the exact update the demo calls a pass: the
#: solver's default target (``solver.risk.DEFAULT_TARGET_COSINE``).
PASS_COSINE = 0.999
#: Seconds CBC may spend on the demo's ILP: on ``small`` it proves a plan
#: within about 1% of optimal in that time, and the demo is about the
#: pipeline, not the last percent.
DEMO_TIME_LIMIT_S = 5.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..models import model_names  # imports torch: only when `hilore demo` is chosen

    p = subparsers.add_parser("demo", help=SUMMARIES["demo"])
    p.add_argument("--model", default="small", choices=model_names(),
                   help="built-in model (default small; tiny is quicker)")
    p.add_argument("--batch", type=int, default=8, help="rollout samples in the update (default 8)")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt group (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256)")
    p.add_argument("--microbatch", type=int, default=2, help="samples per microbatch (default 2)")
    p.add_argument("--budget", default="1.10x-gc", help="memory ceiling (default 1.10x-gc: 1.10 times "
                                                       "gradient checkpointing's peak)")
    p.add_argument("--time-limit", type=float, default=DEMO_TIME_LIMIT_S,
                   help=f"seconds the solver may spend (default {DEMO_TIME_LIMIT_S:g})")
    p.add_argument("--out", default="hilore-demo", help="folder for the trace and plan (default ./hilore-demo)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


class _Progress:
    """``[demo 12s] message`` on stderr: the time since the demo began, then the message."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        tell(f"[demo {time.perf_counter() - self.start:4.0f}s] {message}")


def demo_rollout(vocab: int, batch: int, seq_len: int, group_size: int, seed: int) -> RolloutBatch:
    """A rollout batch made in code: random tokens, binary rewards per group of prompts.

    The first group's rewards are all equal, so its advantages (and exposure)
    are exactly zero and the update skips it. Every other group is half solved,
    so all its samples have |advantage| 1: they fall in one exposure bucket and
    every microbatch has the traced shape, which keeps the demo to one compile.
    """
    import torch

    from ..grpo import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)  # (B, T)
    prompt = seq_len // 4
    mask = torch.zeros(batch, seq_len - 1)
    mask[:, prompt - 1:] = 1.0  # response tokens, aligned with token_logprobs' shift
    position = torch.arange(batch) % group_size
    rewards = (position < group_size // 2).float()
    rewards[:group_size] = 1.0
    return RolloutBatch(input_ids=ids, response_mask=mask, old_logprobs=torch.zeros(batch, seq_len - 1),
                        rewards=rewards, group_ids=torch.arange(batch) // group_size)


def _on_policy(batch: RolloutBatch, model: torch.nn.Module) -> RolloutBatch:
    """Set old log-probs to the current policy's, as right after rollout."""
    import dataclasses

    import torch

    from ..models import token_logprobs

    with torch.no_grad():
        old = token_logprobs(model(batch.input_ids), batch.input_ids)
    return dataclasses.replace(batch, old_logprobs=old)


def _loss_ratio(model: torch.nn.Module, batch: RolloutBatch, microbatch: int) -> float:
    """The eager loss side's peak over the logits' bytes, measured (``bench.measure.loss_side``),
    so that the plan's ceiling covers the whole update, not the compiled graph alone."""
    from ..bench.measure import loss_side, plan_loss_ratio
    from ..grpo import GRPOConfig, grpo_loss
    from ..models import token_logprobs

    import torch

    ids = batch.input_ids[:microbatch]  # (m, T)
    tokens = float(batch.response_mask.sum())
    advantages = torch.ones(microbatch)  # (m,): the loss's peak does not depend on their values
    n = batch.input_ids.shape[0]

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return grpo_loss(token_logprobs(logits, ids), batch.old_logprobs[:microbatch], advantages,
                         batch.response_mask[:microbatch], GRPOConfig(), num_sequences=n, num_tokens=tokens)

    shape = (microbatch, ids.shape[1], model.config.vocab_size)
    with _quiet_stderr():
        return plan_loss_ratio(loss_side(loss, shape, next(model.parameters()).dtype, "cpu"))


def run(args: argparse.Namespace) -> int:
    import torch

    from ..backend import HiLoReBackend
    from ..grpo import plan_buckets
    from ..models import build_model
    from .plan import summary_lines

    say, out = _Progress(), Path(args.out)
    model = build_model(args.model, seed=args.seed)
    say(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"a GRPO update of {args.batch} samples x {args.seq_len} tokens, microbatches of {args.microbatch}")
    batch = _on_policy(demo_rollout(model.config.vocab_size, args.batch, args.seq_len, args.group_size,
                                    args.seed), model)
    plan = _trace_and_plan(model, batch, args, out, say)
    plan.save(out / "plan.json")
    print("\n".join(summary_lines(plan)))
    say(f"plan -> {out / 'plan.json'} (read it with: hilore show {out / 'plan.json'})")

    say("3/4 compile the policy with the plan and run the update (compiling takes a while)")
    compiled = torch.compile(model, backend=HiLoReBackend({"plan": plan, "verbose": False}), dynamic=False)
    buckets = plan_buckets(plan, args.batch)
    report, peak = _measured_peak(model, lambda: _update(compiled, batch, args.microbatch, buckets))
    hilore_grad = _flat_grad(model)
    say("4/4 the exact update (store-all, eager) for comparison")
    model.zero_grad(set_to_none=True)
    _update(model, batch, args.microbatch, buckets)
    lines, passed = verdict(report, DemoResult(peak_bytes=peak, ceiling_bytes=plan.budget_bytes,
                                               predicted_bytes=_predicted(plan, report)),
                            hilore_grad, _flat_grad(model))
    print("\n".join(lines))
    return 0 if passed else 1


def _trace_and_plan(model: torch.nn.Module, batch: RolloutBatch, args: argparse.Namespace, out: Path, say):
    """Steps 1 and 2: trace the policy at the microbatch shape, then solve the plan."""
    from ..passes.tracer import TraceConfig, trace
    from ..solver import SolverOptions, solve
    from .trace import example_batch, grpo_trace_loss

    say("1/4 trace: capture the joint graph, then time each recovery unit's store, compress and "
        "recompute (about a minute)")
    micro = example_batch(model, args.microbatch, args.seq_len, args.seed, "cpu")
    traced = trace(model, [micro], grpo_trace_loss(micro, args.seed),
                   config=TraceConfig(model_name=args.model, repeats=3, codecs=DEFAULT_CODECS))
    traced.save(out / "trace.json")
    say(f"trace: {len(traced.units)} recovery units -> {out / 'trace.json'}")
    say(f"2/4 plan: one ILP over the exposure buckets, ceiling {args.budget} (x-gc: times the peak "
        "the memory model predicts for gradient checkpointing, GC)")
    return solve(traced, budget=args.budget, codecs=DEFAULT_CODECS, accumulate_gradients=True,
                 loss_ratio=_loss_ratio(model, batch, args.microbatch),
                 options=SolverOptions(time_limit_s=args.time_limit))


def _update(model, batch: RolloutBatch, microbatch: int, buckets):
    """One GRPO actor update, gradients summed into ``.grad``; ``buckets`` None: one bucket."""
    from ..grpo import GRPOConfig, UpdateConfig, actor_update

    update = UpdateConfig(microbatch_size=microbatch, n_buckets=1)
    return actor_update(model, None, batch, GRPOConfig(), update=update, buckets=buckets)


def _measured_peak(model, run) -> tuple[object, int]:
    """(what ``run()`` returned, the allocator's peak bytes during it): run once to warm up
    (compiles, lazy allocations), then again measured, the gradients freed before each
    run as ``optimizer.zero_grad`` does."""
    from ..bench.measure import allocator_peak

    model.zero_grad(set_to_none=True)
    run()
    model.zero_grad(set_to_none=True)
    results = []
    with _quiet_stderr():
        peak = allocator_peak(lambda: results.append(run()))
    return results[0], peak


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: torch.profiler's kineto prints profiler_start/stop
    lines there from C++, which ``sys.stderr`` cannot catch."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _predicted(plan, report) -> int:
    """The plan's predicted peak over the buckets the update ran."""
    ran = {name for name, count in report.samples_per_bucket.items() if count and name != ZERO_BUCKET}
    return max((b.memory_bytes for b in plan.buckets if b.bucket.name in ran), default=0)


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    import torch

    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoResult:
    """The update's measured peak beside the plan's ceiling and prediction."""

    peak_bytes: int
    ceiling_bytes: int
    predicted_bytes: int


def verdict(report, memory: DemoResult, hilore_grad: torch.Tensor,
            exact_grad: torch.Tensor) -> tuple[list[str], bool]:
    """The demo's closing lines (what ran where, then the two checks in words) and whether
    both checks passed."""
    import torch

    from ..solver.budget import format_bytes

    # float64: an fp32 cosine of millions of elements can round above 1.
    hilore_grad, exact_grad = hilore_grad.double(), exact_grad.double()
    cosine = torch.nn.functional.cosine_similarity(hilore_grad, exact_grad, dim=0).item()
    rel = ((hilore_grad - exact_grad).norm() / exact_grad.norm()).item()
    ran = ", ".join(f"{name} {count}" for name, count in report.samples_per_bucket.items()
                    if count and name != ZERO_BUCKET)
    held, matches = memory.peak_bytes <= memory.ceiling_bytes, cosine >= PASS_COSINE
    return [
        f"samples: {report.samples_skipped} skipped (zero exposure: equal rewards in their group), "
        f"{ran or 'none'} run; {report.microbatches} microbatches",
        f"plan {'held' if held else 'did NOT hold'} the ceiling: peak {format_bytes(memory.peak_bytes)} of "
        f"{format_bytes(memory.ceiling_bytes)} (predicted {format_bytes(memory.predicted_bytes)})",
        f"update {'matches' if matches else 'does NOT match'} the exact one: cosine "
        f"{cosine:.6f}, rel. L2 {rel:.2e} ({'pass' if matches else 'fail'}: cosine >= {PASS_COSINE})",
    ], held and matches
