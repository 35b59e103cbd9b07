"""Per-bucket decisions on the checked-in traces, against the exposure-blind control.

Prints the table "Per-bucket decisions at 1.10x-gc" of docs/fidelity.md: for each trace
and error target, each bucket's plan, the summed risk against the budget,
each bucket's own squared error (its risk over its error share), and
the recovery time over the default exposure mix (each bucket's time weighted
by its share of samples) of the joint plan and of the exposure-blind one at
the same memory and error budget. ``--trace`` and ``--budgets`` print the
same columns for one trace at several memory budgets instead (how much
exposure saves as memory tightens). Run from the repository root:

    python3 bench/bucket_decisions.py [--trace T --budgets 1.10x-gc,1.0x-gc,0.9x-gc]
"""

from __future__ import annotations

import argparse
from collections import Counter

from hilore_compiler.planfile import BucketPlan
from hilore_compiler.solver import solve
from hilore_compiler.solver.fixed import exposure_blind_plan

CASES = (("small", "traces/small-cpu-T2048.json"), ("8B", "traces/llama-8b-roofline-h100.json"),
         ("small with int4", "traces/small-cpu-T2048-int4.json"))
TARGETS = ("cos>=0.999", "cos>=0.99999")


def describe(bucket: BucketPlan) -> str:
    counts = Counter(option for _, option in bucket.decisions)
    parts = [f"{counts.pop('store', 0)} store", f"{counts.pop('recompute', 0)} recompute"]
    parts += [f"{n} {option.removeprefix('compress:')}" for option, n in counts.most_common()]
    return ", ".join(parts)


def own_error(bucket: BucketPlan) -> float:
    """The bucket's squared relative gradient error were it the whole update
    (its risk over its error share): how lossy its plan is per sample."""
    return bucket.risk / bucket.error_share if bucket.error_share else 0.0


def mix_seconds(buckets: list[BucketPlan]) -> float:
    return sum(b.sample_share * b.time_s for b in buckets)


def row(name: str, path: str, budget: str, target: str) -> str:
    """One table row: each bucket's plan, risks, own errors, recovery over the mix against blind."""
    plan = solve(path, budget, risk_budget=target)
    joint = [b for b in plan.buckets if not b.skip]
    blind = [b for b in exposure_blind_plan(path, budget, risk_budget=target).buckets if not b.skip]
    risk = sum(b.risk for b in joint)
    return (f"| {name}, {target.replace('cos>=', 'cos >= ')} | "
            + " | ".join(describe(b) for b in joint)
            + f" | {risk:.1e} / {plan.risk_budget:.1e} | "
            + " / ".join(f"{own_error(b):.1e}" for b in joint)
            + f" | {mix_seconds(joint) * 1e3:.1f} vs {mix_seconds(blind) * 1e3:.1f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", help="one trace instead of the checked-in ones")
    parser.add_argument("--budgets", default="1.10x-gc", help="memory budgets for --trace, comma-separated")
    parser.add_argument("--target", default="cos>=0.999", help="error target for --trace")
    args = parser.parse_args()
    print("| trace, target | b0 | b1 | b2 | summed risk / budget | own squared error b0 / b1 / b2 "
          "| recovery time over the mix: buckets vs blind |")
    print("|---|---|---|---|---|---|---|")
    if args.trace:
        for budget in args.budgets.split(","):
            print(row(f"{args.trace} at {budget}", args.trace, budget, args.target), flush=True)
        return
    for name, path in CASES:
        for target in TARGETS:
            print(row(name, path, "1.10x-gc", target), flush=True)


if __name__ == "__main__":
    main()
