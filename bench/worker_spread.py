"""How much two worker processes running the same method differ in speed.

``hilore bench --actor-update`` runs each method in a process of its own and
pairs the methods' speeds by round, which cancels the machine's drift but not
a speed a process keeps for its whole life (heap layout, where its compiled
code landed). This study measures that directly: ``--workers`` processes of
one method, same plan, same batch, measured in the bench's rotating rounds,
each paired with the first. Run from the repository root (about 10 minutes):

    python3 bench/worker_spread.py [--method hilore-buckets] [--workers 3] [--repeats 12]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from hilore_compiler.bench.actor import (ACTOR_METHODS, BASELINES, ActorBenchConfig, solve_plans, start, tensor_peak,
                                         timing_env)
from hilore_compiler.bench.paired import paired_ratio
from hilore_compiler.bench.rounds import close_workers, measure_rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="hilore-buckets", choices=ACTOR_METHODS)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--codecs", default="bf16,int8,int4", help="the plans' codecs, comma-separated")
    parser.add_argument("--calibrated", type=Path, help="the calibrated trace: read if it exists, else written")
    args = parser.parse_args()
    config = ActorBenchConfig(codecs=tuple(args.codecs.split(",")), repeats=args.repeats)
    run_dir = Path(tempfile.mkdtemp(prefix="hilore-worker-spread-"))
    env = timing_env(run_dir)  # timed as the actor bench times its workers
    say = lambda m: print(m, flush=True)  # noqa: E731
    runs = []
    try:
        paths = {}
        if args.method not in BASELINES:
            gc_peak = tensor_peak(config, "gc", run_dir, env, say)
            paths = solve_plans(config, run_dir, say, gc_peak_bytes=gc_peak, calibrated=args.calibrated)["paths"]
        for k in range(args.workers):
            own = run_dir / f"worker-{k}"
            own.mkdir()
            runs.append(start(config, args.method, paths, own, env, say))
        measure_rounds(runs, config, say, peaks=False)
    finally:
        close_workers(runs)
    tokens = config.groups * config.group_size * config.seq_len
    print(f"{args.method}, {args.workers} workers, {args.repeats} rounds; speed of each against worker 0:")
    for k, run in enumerate(runs[1:], start=1):
        ratio = paired_ratio(run.samples, runs[0].samples, tokens)
        print(f"worker {k}: {ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]" if ratio and ratio.low
              else f"worker {k}: {ratio}")
    shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
