"""``hilore plan TRACE --budget B -o PLAN.json``: plan offline from a trace (no torch)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from ..jsonio import check_output_path, save_or_fallback
from ..planfile import Plan
from ..solver import DEFAULT_BUDGET, DEFAULT_NUM_BUCKETS, DEFAULT_RISK_BUDGET, SolverOptions, solve
from ..solver.budget import ACCEPTED_FORMS, format_bytes, format_seconds
from ..solver.lengths import solve_length_buckets
from . import length_list
from .show import exposure_range


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help="trace JSON -> plan JSON (store / compress / recompute per bucket)",
        description="Solve one ILP over all exposure buckets (PuLP + CBC), sharing one error budget "
                    "for the whole update over a batch's exposure mix, and write a hilore.plan/v1 file. "
                    "Needs no model and no torch.",
    )
    p.add_argument("trace", help="hilore.trace/v1 JSON file")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help=f"activation memory budget (default {DEFAULT_BUDGET}): {ACCEPTED_FORMS}")
    p.add_argument("--risk", type=_risk_budget, default=DEFAULT_RISK_BUDGET,
                   help="error budget of the whole update: its squared relative gradient error, or a "
                        f"target such as cos>=0.9999 (default {DEFAULT_RISK_BUDGET})")
    p.add_argument("--exposure-mix", default=None,
                   help="hilore.exposure-mix/v1 file: plan exposures of a typical batch, which weigh the "
                        "buckets' time and error (default: GRPO groups of 8, binary rewards, 50%% solve rate)")
    p.add_argument("--buckets", type=int, default=DEFAULT_NUM_BUCKETS,
                   help=f"number of exposure buckets besides 'zero' (default {DEFAULT_NUM_BUCKETS})")
    p.add_argument("--codecs", default=None,
                   help="comma-separated codecs the plan may use, e.g. bf16,int8 (default: all the trace measured)")
    p.add_argument("--batch", type=int, default=None, help="plan for this batch (default: the traced one)")
    p.add_argument("--seq-len", type=seq_lens, default=None,
                   help="plan for this sequence length, or LO:HI for one plan that holds over that range of "
                        "lengths (the ceiling checked across it, recovery time minimised over --length-mix) "
                        "(default: the traced length)")
    p.add_argument("--length-mix", type=functools.partial(length_list, flag="--length-mix"), default=None,
                   help="comma-separated sample sequence lengths of a typical run, for a range (default: "
                        "uniform over it)")
    p.add_argument("--length-buckets", type=int, default=1,
                   help="with a range: split it into at most this many length buckets where that pays, "
                        "one plan file each, PLAN.LO-HI.json (default 1)")
    p.add_argument("--loss-ratio", type=float, default=0.0,
                   help="the loss's own peak as a multiple of the graph outputs' bytes, when the loss "
                        "runs after the compiled graph (3.0 for fp32 token log-probs + GRPO loss; "
                        "default 0: not modelled)")
    p.add_argument("--gc-peak", type=int, default=None,
                   help="GC's measured step peak in bytes: x-gc budgets become multiples of it "
                        "(default: GC's peak as the memory model predicts it)")
    p.add_argument("--time-limit", type=float, default=SolverOptions().time_limit_s,
                   help="seconds CBC may spend on each bucket's ILP")
    p.add_argument("-o", "--output", required=True, help="where to write the plan JSON")
    p.set_defaults(run=run)


def seq_lens(text: str) -> tuple[int, int]:
    """``--seq-len``: ``S`` or ``LO:HI``, positive and ordered."""
    try:
        lo, _, hi = text.partition(":")
        parsed = (int(lo), int(hi or lo))
    except ValueError:
        parsed = (0, 0)
    if not 1 <= parsed[0] <= parsed[1]:
        raise argparse.ArgumentTypeError(f"--seq-len takes a length like 2048 or a range like 512:4096, not {text!r}")
    return parsed


def _risk_budget(text: str) -> float | str:
    """A number, or the solver's string form (``cos>=0.999``), which it parses itself."""
    try:
        return float(text)
    except ValueError:
        return text


def summary_lines(plan: Plan) -> list[str]:
    """One line per bucket: memory against GC and store-all, recovery time, risk, solver."""
    lines = [f"{plan.model}: budget {plan.budget} = {format_bytes(plan.budget_bytes)} "
             f"(GC {format_bytes(plan.gc_bytes)}, store-all {format_bytes(plan.store_bytes)})"]
    for b in plan.buckets:
        spec = b.bucket
        if b.skip:
            lines.append(f"  {spec.name:>6}  exposure 0: skip backward")
            continue
        gc = f"{b.memory_bytes / plan.gc_bytes:.2f}x GC" if plan.gc_bytes else ""
        gap = "" if b.solver.gap is None else f", gap {b.solver.gap:.2%}"
        lines.append(
            f"  {spec.name:>6}  exposure {exposure_range(spec)} at {spec.exposure:g}: memory "
            f"{format_bytes(b.memory_bytes)} ({gc}), recovery {format_seconds(b.time_s)}, risk "
            f"{b.risk:.3g}/{plan.risk_budget:g}{' (proxy sensitivity)' if b.proxy_sensitivity else ''}, "
            f"{b.solver.status} in {b.solver.seconds:.2f} s{gap}"
        )
    return lines


def run(args: argparse.Namespace) -> int:
    check_output_path(args.output, inputs=[args.trace])
    common = dict(risk_budget=args.risk, buckets=args.buckets, codecs=args.codecs, batch=args.batch,
                  exposure_mix=args.exposure_mix, loss_ratio=args.loss_ratio, gc_peak_bytes=args.gc_peak,
                  options=SolverOptions(time_limit_s=args.time_limit),
                  progress=lambda message: print(message, file=sys.stderr, flush=True))
    lo, hi = args.seq_len or (None, None)
    if lo is None or lo == hi:
        plans = (solve(args.trace, args.budget, seq_len=hi, **common),)
    else:
        plans = solve_length_buckets(args.trace, (lo, hi), args.budget, max_buckets=args.length_buckets,
                                     length_mix=args.length_mix, **common)
    for plan in plans:
        output = args.output if len(plans) == 1 else length_bucket_path(args.output, plan)
        path = save_or_fallback(plan.save, output, "plan")
        print("\n".join(summary_lines(plan)))
        print(f"wrote {path}")
    return 0


def length_bucket_path(output: str, plan: Plan) -> str:
    """``plan.json`` -> ``plan.LO-HI.json``: one file per length bucket."""
    path = Path(output)
    lo, hi = plan.length_range
    return str(path.with_name(f"{path.stem}.{lo}-{hi}{path.suffix or '.json'}"))
