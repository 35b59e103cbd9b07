"""``hilore demo``: the whole pipeline on a built-in model, end to end.

trace -> plan (one ILP per exposure bucket) -> ``torch.compile(backend="hilore")``
-> one bucketed GRPO actor update, checked against an exact update.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ..vocabulary import ZERO_BUCKET


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..models import model_names

    p = subparsers.add_parser("demo", help="trace, plan, compile and run one GRPO update on a built-in model")
    p.add_argument("--model", default="small", choices=model_names(), help="built-in model (default small)")
    p.add_argument("--batch", type=int, default=8, help="rollout samples in the update (default 8)")
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt group (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256)")
    p.add_argument("--microbatch", type=int, default=2, help="samples per microbatch (default 2)")
    p.add_argument("--budget", default="1.10x-gc", help="memory budget (default 1.10x-gc)")
    p.add_argument("--out", default="hilore-demo", help="folder for the trace and plan (default ./hilore-demo)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def synthetic_rollout(vocab: int, batch: int, seq_len: int, group_size: int, seed: int):
    """A rollout batch made in code: random tokens, binary rewards per group.

    The first group's rewards are all equal, so its advantages (and exposure)
    are exactly zero and the update skips it; the others span the buckets.
    """
    from ..grpo import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)  # (B, T)
    prompt = seq_len // 4
    mask = torch.zeros(batch, seq_len - 1)
    mask[:, prompt - 1:] = 1.0  # response tokens, aligned with token_logprobs' shift
    rewards = (torch.rand(batch, generator=g) > 0.5).float()
    rewards[:group_size] = 1.0
    groups = torch.arange(batch) // group_size
    return RolloutBatch(input_ids=ids, response_mask=mask, old_logprobs=torch.zeros(batch, seq_len - 1),
                        rewards=rewards, group_ids=groups)


def _on_policy(batch, model: torch.nn.Module):
    """Set old log-probs to the current policy's, as right after rollout."""
    import dataclasses

    from ..models import token_logprobs

    with torch.no_grad():
        old = token_logprobs(model(batch.input_ids), batch.input_ids)
    return dataclasses.replace(batch, old_logprobs=old)


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(grads)


def run(args: argparse.Namespace) -> int:
    from ..backend import HiLoReBackend
    from ..grpo import GRPOConfig, UpdateConfig, actor_update, plan_buckets
    from ..models import build_model
    from ..solver import solve
    from ..passes.tracer import TraceConfig, trace
    from .plan import summary_lines
    from .trace import example_batch, grpo_trace_loss

    out = Path(args.out)
    model = build_model(args.model, seed=args.seed)
    _say(f"model {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    micro = example_batch(model, args.microbatch, args.seq_len, args.seed, "cpu")
    traced = trace(model, [micro], grpo_trace_loss(micro, args.seed),
                   config=TraceConfig(model_name=args.model, repeats=3))
    traced.save(out / "trace.json")
    _say(f"trace: {len(traced.units)} recovery units -> {out / 'trace.json'}")
    plan = solve(traced, budget=args.budget)
    plan.save(out / "plan.json")
    print("\n".join(summary_lines(plan)))
    _say(f"plan -> {out / 'plan.json'} (inspect with: hilore show {out / 'plan.json'})")

    # A microbatch of another size compiles anew, re-solving from the trace.
    backend = HiLoReBackend({"plan": plan, "trace": str(out / "trace.json")})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    batch = _on_policy(synthetic_rollout(model.config.vocab_size, args.batch, args.seq_len,
                                         args.group_size, args.seed), model)
    config, update = GRPOConfig(), UpdateConfig(microbatch_size=args.microbatch)
    buckets = plan_buckets(plan, args.batch)
    start = time.perf_counter()
    report = actor_update(compiled, None, batch, config, update=update, buckets=buckets)
    _say(f"compiled and ran the update in {time.perf_counter() - start:.1f}s")
    hilore_grad = _flat_grad(model)
    model.zero_grad()
    actor_update(model, None, batch, config, update=update, buckets=buckets)
    exact_grad = _flat_grad(model)
    _print_result(report, backend, hilore_grad, exact_grad)
    return 0


def _print_result(report, backend, hilore_grad: torch.Tensor, exact_grad: torch.Tensor) -> None:
    # float64: an fp32 cosine of 100k-element vectors can round above 1.
    hilore_grad, exact_grad = hilore_grad.double(), exact_grad.double()
    cosine = torch.nn.functional.cosine_similarity(hilore_grad, exact_grad, dim=0).item()
    rel = ((hilore_grad - exact_grad).norm() / exact_grad.norm()).item()
    print(f"samples per bucket: {report.samples_per_bucket}, skipped (zero exposure): "
          f"{report.samples_skipped}, microbatches: {report.microbatches}")
    for graph in backend.graphs:
        shape = f"batch {graph.plan.batch}, seq {graph.plan.seq_len}"
        for bucket, source in graph.variant_of.items():
            actual = graph.actual_saved_bytes(bucket)
            if bucket == ZERO_BUCKET or source != bucket or actual is None:
                continue
            print(f"{shape}, bucket {bucket}: saved activations predicted "
                  f"{graph.predicted_saved_bytes(bucket) / 2**20:.3f} MiB, measured in the compiled "
                  f"forward {actual / 2**20:.3f} MiB")
    print(f"gradient vs exact update: cosine {cosine:.6f}, relative L2 error {rel:.2e}")
