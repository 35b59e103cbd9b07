"""Each bucket's plan against the exposure-blind plan, one microbatch at a time, in one process.

The actor bench (``hilore bench --actor-update``) times whole updates in
separate processes, so its pairing by round leaves a 10% interval on 2
shared cores. This study removes what it can of that noise to ask one
question: is each bucket's plan as fast as the solver says, against the
exposure-blind plan? It solves the bench's plans, compiles both policies in
this process, and for each bucket times one microbatch of that bucket's
samples (forward, GRPO loss, backward) under the bucket's plan and under the
blind plan, alternating, ``--pairs`` times. It prints, per bucket, the
plans' predicted recovery times and the measured medians with the paired
ratio's 95% interval, then the mix-weighted update. Run from the repository
root (``--calibrated FILE`` keeps the calibrated trace for the next run;
``--pairs 0`` prints the predictions only):

    python3 bench/bucket_speed.py [--codecs bf16,int8,int4] [--budgets 1.10x-gc,1.0x-gc] [--pairs 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hilore_compiler.bench.actor import ActorBenchConfig, solve_plans
from hilore_compiler.bench.actor_worker import ActorWorker
from hilore_compiler.bench.measure import allocator_peak
from hilore_compiler.bench.paired import geometric_interval
from hilore_compiler.grpo.update import UpdatePlan, _microbatch, plan_update


def timed(w: ActorWorker, plan: UpdatePlan, bucket: str, rows: list[int]) -> float:
    """Seconds of one microbatch's forward and backward under ``bucket`` (``plan``: ``w``'s update plan)."""
    w.model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    _microbatch(w.compiled, w.batch, w.loss, plan, bucket, torch.tensor(rows))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default="bf16,int8,int4", help="the plans' codecs, comma-separated")
    parser.add_argument("--budgets", default="1.10x-gc", help="budgets to solve and time, comma-separated")
    parser.add_argument("--pairs", type=int, default=30, help="alternating timings per bucket and plan")
    parser.add_argument("--calibrated", type=Path, help="the calibrated trace: read if it exists, else written")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        config = ActorBenchConfig(codecs=tuple(args.codecs.split(",")))
        gc = ActorWorker.in_process(config, "gc", {}, run_dir)
        gc.warm()
        gc_peak = allocator_peak(gc.step)
        del gc
        for budget in args.budgets.split(","):
            compare(dataclasses.replace(config, budget=budget), run_dir / budget, gc_peak, args)


def compare(config: ActorBenchConfig, run_dir: Path, gc_peak: int, args: argparse.Namespace) -> None:
    """Solve both plans at ``config.budget`` and time them bucket by bucket."""
    run_dir.mkdir()
    solved = solve_plans(config, run_dir, lambda m: print(f"plans: {m}", flush=True), gc_peak_bytes=gc_peak,
                         calibrated=args.calibrated)
    info = solved["info"]
    print(f"GC's tensor peak {gc_peak / 1e6:.2f} MB, budget {config.budget}; {args.pairs} pairs per bucket")
    print("bucket | samples | predicted recovery ms buckets / blind | measured ms buckets / blind "
          "| blind / buckets [95% CI]")
    names = [n for n in info["buckets"]["buckets"] if n != "zero"]
    if args.pairs < 1:
        for name in names:
            print(f"{name} | {info['buckets']['buckets'][name]['samples']:.3f} | "
                  f"{info['buckets']['buckets'][name]['time_s'] * 1e3:.2f} / "
                  f"{info['blind']['buckets'][name]['time_s'] * 1e3:.2f} | - | -")
        return
    methods = {"buckets": ActorWorker.in_process(config, "hilore-buckets", solved["paths"], run_dir),
               "blind": ActorWorker.in_process(config, "hilore-blind", solved["paths"], run_dir)}
    for w in methods.values():
        w.warm()
    plans = {m: plan_update(w.batch, w.loss, w.update, w.buckets) for m, w in methods.items()}
    weighted = {"buckets": 0.0, "blind": 0.0}
    for name in names:
        rows = next((idx for bucket, idx in plans["buckets"].runs if bucket == name), None)
        if rows is None:
            continue
        times: dict[str, list[float]] = {"buckets": [], "blind": []}
        for i in range(args.pairs):
            for m in (("buckets", "blind") if i % 2 == 0 else ("blind", "buckets")):
                times[m].append(timed(methods[m], plans[m], name, rows))
        ratio = geometric_interval([a / b for a, b in zip(times["blind"], times["buckets"])])
        share = info["buckets"]["buckets"][name]["samples"]
        for m in weighted:
            weighted[m] += share * statistics.median(times[m])
        print(f"{name} | {share:.3f} | {info['buckets']['buckets'][name]['time_s'] * 1e3:.2f} / "
              f"{info['blind']['buckets'][name]['time_s'] * 1e3:.2f} | "
              f"{statistics.median(times['buckets']) * 1e3:.1f} / {statistics.median(times['blind']) * 1e3:.1f} | "
              f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]", flush=True)
    print(f"over the mix: buckets {weighted['buckets'] * 1e3:.1f} ms, blind {weighted['blind'] * 1e3:.1f} ms "
          "per microbatch, weighted by the buckets' sample shares")


if __name__ == "__main__":
    main()
