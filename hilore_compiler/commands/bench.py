"""``hilore bench``: actor-update throughput and peak memory of GC, the baselines and HiLoRe."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

#: Where result files go unless ``-o`` says otherwise (relative to the working directory).
RESULTS_DIR = Path("bench") / "results"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..bench.methods import METHODS
    from ..bench.runner import BenchConfig, QUICK

    d = BenchConfig()
    p = subparsers.add_parser(
        "bench", help="benchmark the actor update: GC, PyTorch baselines and HiLoRe side by side",
        description=(
            "Run one GRPO actor update (forward, token log-probs, GRPO loss, backward) per step "
            "with every method in its own process, alternating, and report tokens/s, peak memory "
            "and gradient fidelity against store-all, as ratios to gradient checkpointing. "
            "Defaults are the full configuration; --quick runs the tiny model. Exit status 1 if "
            "a method failed (its row says why), 0 otherwise, targets met or not."),
    )
    p.add_argument("--quick", action="store_true",
                   help="tiny model, short sequence, fewer repeats: "
                        + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--model", help=f"built-in policy (default {d.model})")
    p.add_argument("--batch", type=int, help=f"sequences per step (default {d.batch})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--repeats", type=int, help=f"rounds of alternation (default {d.repeats})")
    p.add_argument("--steps-per-round", type=int,
                   help=f"measured steps per method per round (default {d.steps_per_round})")
    p.add_argument("--warmup", type=int, help=f"steps after compiling, not in the rounds (default {d.warmup})")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)} (default all)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help=f"(default {d.device})")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: torch's)")
    p.add_argument("--hilore-budget", help=f"HiLoRe's memory budget (default {d.hilore_budget})")
    p.add_argument("--pt-budget", type=float,
                   help="fixed activation_memory_budget for pt-budget (default: searched to HiLoRe's peak)")
    p.add_argument("--budget-probes", type=int,
                   help=f"processes the pt-budget search may use (default {d.budget_probes})")
    p.add_argument("--seed", type=int, help=f"weights and batch seed (default {d.seed})")
    p.add_argument("--cache-dir", help="persistent Inductor and hilore caches, shared by later runs "
                                       "(default: fresh per run; clear it after changing hilore, whose "
                                       "cached plans are keyed by graph and options, not by its code)")
    p.add_argument("-o", "--output", help="result JSON (default bench/results/bench-<model>-T<len>.json)")
    p.add_argument("--nproc", type=int,
                   help="FSDP2 across this many processes (gloo on CPU, nccl on GPUs): GC, store-all "
                        "and HiLoRe compiled per block; --batch is then per rank "
                        "(see hilore_compiler/bench/distributed.py)")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace):
    """BenchConfig from the defaults, then ``--quick``'s preset, then explicit options."""
    from ..bench.runner import BenchConfig, QUICK

    values = dict(QUICK) if args.quick else {}
    for f in dataclasses.fields(BenchConfig):
        given = getattr(args, f.name, None)
        if given is not None and f.name != "methods":
            values[f.name] = given
    if args.methods:
        values["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    return BenchConfig(**values)


def _progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from ..bench.report import format_table, format_targets, save_json, save_png, summarise
    from ..bench.runner import run_bench

    if args.nproc:
        from ..bench.distributed import run_command

        return run_command(args)
    config = config_from_args(args)
    output = Path(args.output or RESULTS_DIR / f"bench-{config.model}-T{config.seq_len}.json")
    result = run_bench(config, _progress)
    report = summarise(result)
    print(format_table(report))
    print("targets (paper, at 1.10 x GC's peak):")
    print(format_targets(report))
    print(f"results: {save_json(report, output)}")
    png = save_png(report, output.with_suffix(".png"))
    print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib)")
    if result.run_dir:
        print(f"a method failed; worker logs kept in {result.run_dir}")
    return 1 if any(r.status != "ok" for r in result.runs) else 0
