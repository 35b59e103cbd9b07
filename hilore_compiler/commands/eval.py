"""``hilore eval [--quick] [--seeds N] [--steps N] [-o FILE]``: does the plan hurt training?

Measures gradient fidelity per exposure bucket and runs paired GRPO training
(exact, hilore under a tight budget, exposure-blind int8) on a toy task; see
``hilore_compiler.evaluation``. Progress goes to stderr, the summary to
stdout, the numbers to ``bench/results/eval-<time>.json`` (and a PNG of the
curves beside it when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from . import SUMMARIES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help=SUMMARIES["eval"],
        description="Trace the tiny policy, plan it at the planned and a tight memory budget, "
                    "compare each compiled arm's gradient with the exact one per exposure bucket, "
                    "then train exact, hilore and an exposure-blind int8 control side by side "
                    "on a verifiable toy task with paired seeds. Defaults are the full run "
                    "(about 10-15 minutes on 2 idle cores); --quick takes 2 minutes.",
    )
    p.add_argument("--quick", action="store_true", help="2 seeds, 40 steps: an end-to-end check")
    p.add_argument("--seeds", type=int, help="paired seeds (default 8; quick 2)")
    p.add_argument("--steps", type=int, help="GRPO steps per run (default 300; quick 40)")
    p.add_argument("--budget", help="the tight memory budget training runs at (default 0.75x-gc)")
    p.add_argument("--risk-budget",
                   help="error budget of the plans: the update's squared relative gradient error, or "
                        "cos>=0.999 (default: half of int8-everywhere's, so that it binds)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default 1)")
    p.add_argument("-o", "--output", help="results JSON (default bench/results/eval-<time>.json)")
    p.set_defaults(run=run)


def _config(args: argparse.Namespace):
    from ..evaluation import EvalConfig, quick_config

    config = quick_config() if args.quick else EvalConfig()
    changes = {}
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        every = min(config.train.eval_every, args.steps)
        changes["train"] = dataclasses.replace(config.train, steps=args.steps, eval_every=every)
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        changes["seeds"] = args.seeds
    for flag, name in (("budget", "tight_budget"), ("risk_budget", "risk_budget"), ("threads", "threads")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    return dataclasses.replace(config, **changes)


def run(args: argparse.Namespace) -> int:
    from ..evaluation.report import format_fidelity, format_plans, format_training, plot_curves
    from ..evaluation.suite import run_evaluation
    from ..evaluation.training import stderr_progress
    from ..jsonio import write_json_atomic

    config = _config(args)
    output = Path(args.output or f"bench/results/eval-{time.strftime('%Y%m%d-%H%M%S')}.json")
    payload = run_evaluation(config, stderr_progress)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot = plot_curves(payload["training"], output.with_suffix(".png"))
    payload["plot"] = None if plot is None else str(plot)
    write_json_atomic(output, payload)
    print(format_plans(payload["plans"]))
    print()
    print(format_fidelity(payload["fidelity"]))
    print()
    print(format_training(payload["training"]))
    print(f"\nwrote {output}" + (f" and {plot}" if plot else "")
          + f" in {payload['timings']['total_s']:.0f} s")
    return 0
