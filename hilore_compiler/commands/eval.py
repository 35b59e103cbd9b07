"""``hilore eval [--task NAME] [--quick] [--seeds N] [--steps N] [-o FILE]``: does the plan hurt training?

``--task max1`` (the default): measures gradient fidelity per exposure bucket
and runs paired GRPO training (exact, hilore under a tight budget,
exposure-blind int8) on a one-token toy task. ``--task multiples16`` (a
preset of ``evaluation.presets``): 16-token responses, the arms a user
chooses between (exact, zero-config hilore, hilore with int4, int8 +
recompute, and plain torch.compile as the control for rounding alone)
trained side by side with the update's per-bucket fidelity measured along
the run. See ``hilore_compiler.evaluation``. Progress goes to
stderr, the summary to stdout, the numbers to
``bench/results/eval-<task>-<time>.json`` (and a PNG of the curves beside it
when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from . import SUMMARIES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval", help=SUMMARIES["eval"],
        description="Trace the tiny policy, plan it at the planned and a tight memory budget, "
                    "compare each compiled arm's gradient with the exact one per exposure bucket, "
                    "then train exact, hilore and an exposure-blind int8 control side by side "
                    "on a verifiable toy task with paired seeds. Defaults are the full run "
                    "(about 10-15 minutes on 2 idle cores); --quick takes 2 minutes. "
                    "--task multiples16 instead trains exact, zero-config hilore, hilore with int4, "
                    "int8 + recompute and plain torch.compile (the rounding control) on 16-token "
                    "responses, measuring each update's cosine to the exact one per exposure bucket "
                    "along the run (16 seeds: about 2 hours; --quick: minutes).",
    )
    p.add_argument("--task", default=ONE_TOKEN, choices=TASKS,
                   help=f"{ONE_TOKEN}: the one-token task with the plan study (default); "
                        "multiples16: 16-token responses, the user-facing arms side by side")
    p.add_argument("--arms", help="multiples16 only: comma-separated arms, exact first "
                                  "(default exact,hilore,hilore-int4,int8-recompute,store-all)")
    p.add_argument("--quick", action="store_true", help="2 seeds, few steps: an end-to-end check")
    p.add_argument("--seeds", type=int, help="paired seeds (default 8, multiples16 16; quick 2)")
    p.add_argument("--steps", type=int, help="GRPO steps per run (default 300, multiples16 400; quick 40 / 60)")
    p.add_argument("--budget", help="the tight memory budget training runs at (default 0.75x-gc)")
    p.add_argument("--risk-budget",
                   help="error budget of the plans: the update's squared relative gradient error, or "
                        "cos>=0.999 (default: half of int8-everywhere's, so that it binds)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default 1)")
    p.add_argument("-o", "--output", help="results JSON (default bench/results/eval-<time>.json, "
                                          "eval-multiples16-<time>.json for that task)")
    p.set_defaults(run=run)


#: The one-token eval's task name (``evaluation.suite``).
ONE_TOKEN = "max1"
#: ``--task`` choices: the one-token eval, then the names of ``evaluation.presets.PRESETS``
#: (spelled out so that building the parser imports no torch; a test checks they agree).
TASKS = (ONE_TOKEN, "multiples16")


def _run_changes(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """The ``--steps``, ``--seeds`` and ``--threads`` changes both configurations share."""
    changes: dict[str, Any] = {}
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        every = min(config.train.eval_every, args.steps)
        changes["train"] = dataclasses.replace(config.train, steps=args.steps, eval_every=every)
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        changes["seeds"] = args.seeds
    if getattr(args, "threads", None) is not None:
        changes["threads"] = args.threads
    return changes


def _config(args: argparse.Namespace):
    """The one-token eval's ``EvalConfig``."""
    from ..evaluation import EvalConfig, quick_config

    config = quick_config() if args.quick else EvalConfig()
    changes = _run_changes(args, config)
    for flag, name in (("budget", "tight_budget"), ("risk_budget", "risk_budget")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    return dataclasses.replace(config, **changes)


def _compare_config(args: argparse.Namespace):
    """A preset's ``CompareConfig`` (``--budget`` and ``--risk-budget`` are the one-token eval's)."""
    from ..evaluation.presets import preset, quick

    if args.budget is not None or args.risk_budget is not None:
        raise ValueError(f"--budget and --risk-budget belong to --task {ONE_TOKEN}; the {args.task} arms "
                         "are planned as hilore bench's methods are")
    config = preset(args.task)
    config = quick(config) if args.quick else config
    changes = _run_changes(args, config)
    if args.arms:
        changes["arms"] = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    return dataclasses.replace(config, **changes)


def run(args: argparse.Namespace) -> int:
    from ..evaluation import report
    from ..evaluation.training import stderr_progress
    from ..jsonio import write_json_atomic

    if args.arms and args.task == ONE_TOKEN:
        raise ValueError(f"--arms needs a preset task ({', '.join(TASKS[1:])}), not {ONE_TOKEN}")
    if args.task == ONE_TOKEN:
        from ..evaluation.suite import run_evaluation

        payload = run_evaluation(_config(args), stderr_progress)
        sections = [report.format_plans(payload["plans"]), report.format_fidelity(payload["fidelity"])]
        name = "eval"  # the one-token eval's files keep their name
    else:
        from ..evaluation.comparison import run_comparison

        payload = run_comparison(_compare_config(args), stderr_progress)
        sections = [report.format_arm_plans(payload["plans"]),
                    report.format_step_fidelity(payload["step_fidelity"])]
        name = f"eval-{args.task}"
    output = Path(args.output or f"bench/results/{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    plot = report.plot_curves(payload["training"], output.with_suffix(".png"))
    payload["plot"] = None if plot is None else str(plot)
    write_json_atomic(output, payload)
    print("\n\n".join([*sections, report.format_training(payload["training"])]))
    print(f"\nwrote {output}" + (f" and {plot}" if plot else "")
          + f" in {payload['timings']['total_s']:.0f} s")
    return 0
