"""How much faster than the exposure-blind plan can any plan that fits be? Store-all bounds it.

Store-all recovers nothing: it keeps every saved activation as it is, so no
plan, whatever it stores, compresses or recomputes, runs its step faster
(short of memory effects). Its lead over HiLoRe's exposure-blind plan is
therefore the room that exposure conditioning, or anything else a plan
could do, has on the step bench's step. The step bench times methods in
processes of their own, which leaves a +-7% interval on 2 shared cores;
this study removes what it can of that noise. It compiles, in this
process and at the step bench's shape (``small``, batch 2, sequence 2048,
fp32), GC, store-all, ``hilore-blind`` and ``hilore`` (both at 1.10x GC's
tensor peak as the allocator measures it here, 1% headroom), then times
one step of each, methods in rotating order, ``--pairs`` times. It prints
each method's median step and its paired ratio to the blind plan's with
the 95% interval. Run from the repository root:

    python3 bench/headroom.py [--pairs 24] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from hilore_compiler.bench.measure import allocator_peak
from hilore_compiler.bench.methods import MethodOptions
from hilore_compiler.bench.paired import geometric_interval
from hilore_compiler.bench.worker import Worker, WorkerConfig

METHODS = ("gc", "store-all", "hilore-blind", "hilore")
REFERENCE = "hilore-blind"


def worker(method: str, args: argparse.Namespace, options: MethodOptions) -> Worker:
    config = WorkerConfig(method=method, model=args.model, batch=args.batch, seq_len=args.seq_len, seed=0,
                          device="cpu", warmup=1, options=options)
    w = Worker(config)
    w.setup()  # compiles, then one warm-up step
    return w


def step_peak(w: Worker) -> int:
    """The tensor peak of one step, gradients allocated inside it as in the bench."""
    w.model.zero_grad(set_to_none=True)
    return allocator_peak(w._step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=24, help="rounds; each times one step of every method")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        options = MethodOptions(hilore_cache_dir=str(Path(tmp) / "hilore"), verbose=False)
        workers = {"gc": worker("gc", args, options)}
        gc_peak = step_peak(workers["gc"])
        print(f"GC's tensor peak {gc_peak / 1e6:.1f} MB; plans at 1.10x of it", flush=True)
        planned = MethodOptions(hilore_cache_dir=options.hilore_cache_dir, verbose=False, gc_peak_bytes=gc_peak)
        for method in METHODS[1:]:
            workers[method] = worker(method, args, planned if method.startswith("hilore") else options)
            print(f"compiled {method}", flush=True)
        peaks = {m: step_peak(w) for m, w in workers.items()}
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for i in range(args.pairs):
            order = METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]
            for m in order:
                times[m].append(workers[m].measure(1)[0].seconds)
            print(f"round {i + 1}/{args.pairs}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in METHODS),
                  flush=True)
    print(f"\nmethod | median step s | tensor peak MB (x GC) | speed / {REFERENCE}'s [95% CI]")
    for m in METHODS:
        ratio = geometric_interval([b / a for a, b in zip(times[m], times[REFERENCE])])
        print(f"{m} | {statistics.median(times[m]):.3f} | {peaks[m] / 1e6:.1f} ({peaks[m] / gc_peak:.3f}) | "
              f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]")


if __name__ == "__main__":
    main()
