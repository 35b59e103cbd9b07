"""How far a method's VmHWM peak moves between processes of the same plan.

``hilore bench --actor-update`` measures each method's VmHWM peak once, in a
process of its own (``actor.rss_peaks``). This study solves the bench's
plans again and measures each method's peak in ``--processes`` fresh
processes, in turn, so that a reading that belongs to the process (its
heap) can be told from one that belongs to the plan. Run from the
repository root (about 12 minutes):

    python3 bench/actor_peaks.py [--methods gc,hilore-blind,hilore-buckets,hilore-skip] [--processes 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from hilore_compiler.bench.actor import ActorBenchConfig, rss_peaks, solve_plans, tensor_peak, timing_env
from hilore_compiler.bench.process import worker_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="gc,hilore-blind,hilore-buckets,hilore-skip")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--codecs", default="bf16,int8,int4", help="the plans' codecs, comma-separated")
    args = parser.parse_args()
    try:  # the bench's own checks: unknown methods, uniform-int8 without int8
        config = ActorBenchConfig(codecs=tuple(args.codecs.split(",")), methods=tuple(args.methods.split(",")))
    except ValueError as e:
        parser.error(str(e))
    methods = config.methods
    run_dir = Path(tempfile.mkdtemp(prefix="hilore-actor-peaks-"))
    say = lambda m: print(m, flush=True)  # noqa: E731
    try:
        # As the bench does: GC's tensor peak is the x-gc ceiling of the plans.
        gc_peak = tensor_peak(config, "gc", run_dir, timing_env(run_dir), say)
        plans = solve_plans(config, run_dir, say, gc_peak_bytes=gc_peak)["paths"]
        peak_env = worker_env(run_dir / "inductor", peak=True)
        readings = {m: [] for m in methods}
        for _ in range(args.processes):
            for method in methods:
                readings[method].append(rss_peaks(config, method, plans, run_dir, peak_env, say))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    reference = "unmeasured" if gc_peak is None else f"{gc_peak / 1e6:.1f} MB"
    print(f"VmHWM peaks per update (MB), one list per process; GC's tensor peak {reference}")
    for method, per_process in readings.items():
        print(f"{method}: " + "  ".join(str([round(p / 1e6, 2) for p in peaks]) for peaks in per_process))


if __name__ == "__main__":
    main()
