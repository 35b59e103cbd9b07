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
the 95% interval. ``--buckets`` also times HiLoRe's step under each of its
exposure buckets' plans (``hilore@b0``...), which the step bench's fixed
batch cannot: it runs the one bucket its exposures fall in. Run from the
repository root:

    python3 bench/headroom.py [--pairs 24] [--seq-len 2048] [--dtype bfloat16 --codecs int8,int4 --buckets]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
from pathlib import Path

import torch

from hilore_compiler.bench.measure import allocator_peak
from hilore_compiler.bench.methods import MethodOptions
from hilore_compiler.bench.paired import geometric_interval
from hilore_compiler.bench.worker import Worker, WorkerConfig
from hilore_compiler.models import DTYPES

from bucket_decisions import describe  # bench/bucket_decisions.py: a script's own directory is on sys.path

METHODS = ("gc", "store-all", "hilore-blind", "hilore")
REFERENCE = "hilore-blind"


def worker(method: str, args: argparse.Namespace, options: MethodOptions) -> Worker:
    config = WorkerConfig(method=method, model=args.model, batch=args.batch, seq_len=args.seq_len, seed=0,
                          device="cpu", warmup=1, options=options, dtype=args.dtype)
    w = Worker(config)
    w.setup()  # compiles, then one warm-up step
    return w


@dataclasses.dataclass
class Run:
    """A compiled worker and the exposure bucket its step runs under."""

    worker: Worker
    bucket: str | None

    def peak(self) -> int:
        """The tensor peak of one step, gradients allocated inside it as in the bench."""
        self.worker.bucket = self.bucket
        self.worker.model.zero_grad(set_to_none=True)
        return allocator_peak(self.worker._step)

    def seconds(self) -> float:
        self.worker.bucket = self.bucket
        return self.worker.measure(1)[0].seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=24, help="rounds; each times one step of every method")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--codecs", default="bf16,int8", help="codecs HiLoRe's plans may use")
    parser.add_argument("--buckets", action="store_true", help="time HiLoRe under each bucket's plan too")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        codecs = tuple(c for c in args.codecs.split(",") if c)
        options = MethodOptions(hilore_cache_dir=str(Path(tmp) / "hilore"), verbose=False, hilore_codecs=codecs)
        workers = {"gc": worker("gc", args, options)}
        gc_peak = Run(workers["gc"], None).peak()
        print(f"GC's tensor peak {gc_peak / 1e6:.1f} MB; plans at 1.10x of it", flush=True)
        planned = dataclasses.replace(options, gc_peak_bytes=gc_peak)
        for method in METHODS[1:]:
            workers[method] = worker(method, args, planned if method.startswith("hilore") else options)
            print(f"compiled {method}", flush=True)
        runs = {m: Run(w, w.bucket) for m, w in workers.items()}
        if args.buckets:
            hilore = workers["hilore"]
            plan = hilore.prepared.backend.graphs[0].plan
            for bucket in plan.buckets:
                if not bucket.skip:
                    runs[f"hilore@{bucket.bucket.name}"] = Run(hilore, bucket.bucket.name)
                    print(f"hilore@{bucket.bucket.name}: {bucket.sample_share or 0:.0%} of the mix's samples, "
                          f"predicted recovery {bucket.time_s * 1e3:.1f} ms, {describe(bucket)}", flush=True)
            blind = [b for b in workers["hilore-blind"].prepared.backend.graphs[0].plan.buckets if not b.skip][0]
            print(f"hilore-blind: predicted recovery {blind.time_s * 1e3:.1f} ms, {describe(blind)}", flush=True)
        names = list(runs)
        peaks = {m: r.peak() for m, r in runs.items()}
        times: dict[str, list[float]] = {m: [] for m in names}
        for i in range(args.pairs):
            for m in names[i % len(names):] + names[:i % len(names)]:
                times[m].append(runs[m].seconds())
            print(f"round {i + 1}/{args.pairs}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in names),
                  flush=True)
    print(f"\nmethod | median step s | tensor peak MB (x GC) | speed / {REFERENCE}'s [95% CI]")
    for m in names:
        ratio = geometric_interval([b / a for a, b in zip(times[m], times[REFERENCE])])
        print(f"{m} | {statistics.median(times[m]):.3f} | {peaks[m] / 1e6:.1f} ({peaks[m] / gc_peak:.3f}) | "
              f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]")


if __name__ == "__main__":
    main()
