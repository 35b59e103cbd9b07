"""``hilore plan TRACE --budget B -o PLAN.json``: plan offline from a trace (no torch)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from ..jsonio import check_output_path, save_or_fallback
from ..planfile import Plan
from ..solver import DEFAULT_BUDGET, DEFAULT_NUM_BUCKETS, DEFAULT_RISK_BUDGET, SolverOptions, solve
from ..solver.budget import ACCEPTED_FORMS, format_bytes, format_seconds
from ..solver.devicefit import fit_lines
from ..solver.risk import format_error
from ..vocabulary import DEFAULT_CODECS
from ..solver.lengths import solve_length_buckets
from . import SUMMARIES, length_list
from .show import exposure_range
from ..progress import tell


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan", help=SUMMARIES["plan"],
        description="Solve one ILP over all exposure buckets (PuLP + CBC), sharing one error budget "
                    "for the whole update over a batch's exposure mix, and write a hilore.plan/v1 file. "
                    "Needs no model and no torch.",
    )
    p.add_argument("trace", help="hilore.trace/v1 JSON file")
    p.add_argument("--budget", default=DEFAULT_BUDGET,
                   help=f"activation memory budget (default {DEFAULT_BUDGET}): {ACCEPTED_FORMS}")
    p.add_argument("--risk", type=_risk_budget, default=DEFAULT_RISK_BUDGET,
                   help="error budget of the whole update's gradient: a relative L2 error such as "
                        f"l2<=0.045, or a cosine to the exact one such as cos>=0.9999 (default {DEFAULT_RISK_BUDGET})")
    p.add_argument("--exposure-mix", default=None,
                   help="hilore.exposure-mix/v1 file: plan exposures of a typical batch, which weigh the "
                        "buckets' time and error (default: GRPO groups of 8, binary rewards, 50%% solve rate)")
    p.add_argument("--buckets", type=int, default=DEFAULT_NUM_BUCKETS,
                   help=f"number of exposure buckets besides 'zero' (default {DEFAULT_NUM_BUCKETS})")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                   help="comma-separated codecs the plan may use, of those the trace measured (default "
                        f"{','.join(DEFAULT_CODECS)}, as the backend; int4 and fp8 are opt-in)")
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
    p.add_argument("--loss-ratio", type=float, default=None,
                   help="the loss's own peak as a multiple of the graph outputs' bytes, when the loss "
                        "runs after the compiled graph (0: a graph that returns its loss; default: "
                        "modelled from the outputs' dtype as fp32 token log-probs, 3 for fp32 logits, "
                        "8 for bf16)")
    p.add_argument("--gc-peak", type=int, default=None,
                   help="GC's measured step peak in bytes: x-gc budgets become multiples of it "
                        "(default: GC's peak as the memory model predicts it)")
    p.add_argument("--time-limit", type=float, default=SolverOptions().time_limit_s,
                   help="seconds CBC may spend on each bucket's ILP")
    p.add_argument("--full-ilp", action="store_true",
                   help="decide every unit alone instead of each block class's members by a few shared "
                        "patterns (slower past a few layers; for comparison)")
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
    """The plan in a few lines under 100 columns: the budget, then per bucket its exposure
    range, memory against GC, recovery time and error; buckets sharing one plan say so."""
    lines = [f"{plan.model}: budget {plan.budget} = {format_bytes(plan.budget_bytes)}; predicted peaks: "
             f"GC {format_bytes(plan.gc_bytes)}, store-all {format_bytes(plan.store_bytes)}"]
    solved = [b for b in plan.buckets if not b.skip]
    for b in plan.buckets:
        spec = b.bucket
        if b.skip:
            lines.append(f"  {spec.name:>4}  exposure 0: no gradient, backward skipped")
            continue
        gc = f" ({b.memory_bytes / plan.gc_bytes:.2f}x GC)" if plan.gc_bytes else ""
        lines.append(f"  {spec.name:>4}  exposure {exposure_range(spec)}: memory {format_bytes(b.memory_bytes)}"
                     f"{gc}, recovery {format_seconds(b.time_s)}, {format_error(b.risk, cosine=False)}")
    if len(solved) > 1 and len({b.decisions for b in solved}) == 1:
        lines.append(f"  {', '.join(b.bucket.name for b in solved)} run the same plan (one compiled variant)")
    lines += fit_lines(plan)
    total = sum(b.risk for b in solved)
    lines.append(f"  whole update: {format_error(total)}; budget {format_error(plan.risk_budget)}")
    if any(b.proxy_sensitivity for b in solved):
        lines.append("  (errors from proxy sensitivities: `hilore calibrate` measures them)")
    if solved:
        stats = solved[0].solver
        gap = "" if stats.gap is None else f", gap {stats.gap:.2%}"
        lines.append(f"  solver: {stats.status} in {stats.seconds:.2f} s{gap}")
    return lines


def run(args: argparse.Namespace) -> int:
    check_output_path(args.output, inputs=[args.trace])
    common = dict(risk_budget=args.risk, buckets=args.buckets, codecs=args.codecs, batch=args.batch,
                  exposure_mix=args.exposure_mix, loss_ratio=args.loss_ratio, gc_peak_bytes=args.gc_peak,
                  options=SolverOptions(time_limit_s=args.time_limit, tie_blocks=not args.full_ilp),
                  progress=tell)
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
