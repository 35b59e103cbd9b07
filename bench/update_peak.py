"""The whole actor update's peak: each plan's predicted peak against the allocator's.

Solves the plans ``hilore bench --actor-update`` solves (``small`` at
microbatches of 2 x 256 tokens, dapo, 1.10x GC's tensor peak), prints every
bucket's predicted peak with where it falls and its parts
(``solver.stepterms.PeakParts``), then runs one whole update per method and
prints its peak by the allocator (``torch.profiler``'s allocation trail,
tensor bytes: what the memory model predicts), the event it falls at, and
the allocations and frees of 0.2 MB or more around it. Run from the
repository root (about 4 minutes with the default codecs; ``int4`` adds its
per-unit calibration, about 8):

    python3 bench/update_peak.py [--codecs bf16,int8,int4] [--methods gc,hilore-blind,hilore-buckets]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hilore_compiler.bench.actor import ActorBenchConfig, solve_plans
from hilore_compiler.bench.actor_worker import ActorWorker
from hilore_compiler.bench.measure import allocation_trail
from hilore_compiler.planfile import load_plan

MB = 1e6


def trail(w: ActorWorker, name: str) -> int:
    """Print one update's allocator peak (``ActorWorker.tensor_peak``'s measure) and the
    trail around it; returns the peak."""
    w.warm()
    peak, running = allocation_trail(w.step)
    w.model.zero_grad(set_to_none=True)
    at = max(range(len(running)), key=lambda i: running[i][1], default=0)  # the first event at the peak
    print(f"== {name}: allocator peak {peak / MB:.2f} MB at event {at} of {len(running)}")
    near = range(max(0, at - 60), min(len(running), at + 30))
    print("   " + " ".join(f"{running[j][0] / MB:+.2f}{'*' if j == at else ''}" for j in near
                          if abs(running[j][0]) >= 0.2 * MB or j == at))
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default="bf16,int8", help="the plans' codecs, comma-separated")
    parser.add_argument("--methods", default="gc,hilore-blind,hilore-buckets",
                        help="methods to trail, comma-separated (gc is always run: it sets the ceiling)")
    args = parser.parse_args()
    config = ActorBenchConfig(codecs=tuple(args.codecs.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        gc_peak = trail(ActorWorker.in_process(config, "gc", {}, run_dir), "gc")
        solved = solve_plans(config, run_dir, lambda m: print(f"plans: {m}", flush=True), gc_peak_bytes=gc_peak)
        for name, path in solved["paths"].items():
            for b in load_plan(path).buckets:
                if not b.skip:
                    parts = ", ".join(f"{k} {v / MB:.2f}" for k, v in b.peak_parts.items())
                    print(f"   {name} {b.bucket.name}: predicted {b.memory_bytes / MB:.2f} MB at {b.peak_at}: "
                          f"kept {b.kept_bytes / MB:.2f} + {parts}")
        for method in (m for m in args.methods.split(",") if m != "gc"):
            trail(ActorWorker.in_process(config, method, solved["paths"], run_dir), method)


if __name__ == "__main__":
    main()
