"""Where a plan's time goes: forward and backward of one microbatch per method, in one process.

It asks where a plan's measured time over store-all comes from: the
plan's recovery (recompute, encode, decode), or the backend itself (its
partitioner and codec graph, with nothing to recover), and whether the
solver's predicted recovery accounts for it. It found int4's encode running
3x int8's (fixed in commit 1a36683; docs/fidelity.md, "The whole actor
update with int4 on offer"). It compiles, in this process and at the actor
bench's microbatch shape:

- ``store-all``: torch.compile with Inductor's own partitioner;
- ``gc``: per-layer checkpoint;
- ``hilore-store``: the hilore backend with a plan that stores every unit
  (no recovery at all: what the backend costs by itself);
- ``hilore-blind``: the actor bench's exposure-blind plan;

and times forward (policy, token log-probs, GRPO loss) and backward of one
microbatch of the top bucket's samples, methods in rotating order,
``--pairs`` times. It prints per method the medians of forward, backward
and the whole microbatch, and each method's paired ratio to store-all's
whole microbatch with its 95% interval. Run from the repository root
(``--calibrated FILE`` as in bucket_speed.py):

    python3 bench/overhead.py [--codecs bf16,int8,int4] [--pairs 30] [--calibrated FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hilore_compiler.backend import runtime
from hilore_compiler.bench.actor import ActorBenchConfig, solve_plans
from hilore_compiler.bench.actor_worker import ActorWorker
from hilore_compiler.bench.measure import allocator_peak
from hilore_compiler.bench.paired import geometric_interval
from hilore_compiler.grpo import grpo_loss
from hilore_compiler.grpo.update import UpdatePlan, plan_update
from hilore_compiler.models import token_logprobs
from hilore_compiler.planfile import load_plan
from hilore_compiler.solver.fixed import fixed_plan, uniform_codec

METHODS = ("store-all", "gc", "hilore-store", "hilore-blind")


def timed(w: ActorWorker, plan: UpdatePlan, bucket: str, rows: list[int]) -> tuple[float, float]:
    """Seconds of forward (to the loss) and of backward of one microbatch, as ``grpo.update`` runs it."""
    w.model.zero_grad(set_to_none=True)
    idx = torch.tensor(rows)
    ids = w.batch.input_ids[idx]  # (b, T)
    with runtime.exposure(bucket):
        start = time.perf_counter()
        logits = w.compiled(ids)  # (b, T, V)
        loss = grpo_loss(token_logprobs(logits, ids), old_logprobs=w.batch.old_logprobs[idx],
                         advantages=plan.advantages[idx], mask=w.batch.response_mask[idx], config=w.loss,
                         num_sequences=plan.num_sequences, num_tokens=plan.num_tokens)
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
    return mid - start, end - mid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default="bf16,int8,int4", help="the plans' codecs, comma-separated")
    parser.add_argument("--pairs", type=int, default=30, help="timings per method, in rotating order")
    parser.add_argument("--calibrated", type=Path, help="the calibrated trace: read if it exists, else written")
    args = parser.parse_args()
    config = ActorBenchConfig(codecs=tuple(args.codecs.split(",")))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        gc = ActorWorker.in_process(config, "gc", {}, run_dir)
        gc.warm()
        calibrated = args.calibrated or run_dir / "calibrated.json"
        solved = solve_plans(config, run_dir, lambda m: print(f"plans: {m}", flush=True),
                             gc_peak_bytes=allocator_peak(gc.step), calibrated=calibrated)
        blind = load_plan(solved["paths"]["blind"])
        store = fixed_plan(calibrated, uniform_codec(None), buckets=3, codecs=list(config.codecs),
                           batch=blind.batch, seq_len=blind.seq_len, exposure_mix=solved["mix"],
                           label="store-every-unit")
        (run_dir / "store").mkdir()
        paths = {"blind": solved["paths"]["blind"], "store": str(store.save(run_dir / "plan-store.json"))}
        workers = {"store-all": ActorWorker.in_process(config, "store-all", {}, run_dir), "gc": gc,
                   "hilore-store": ActorWorker.in_process(config, "hilore-blind", {"blind": paths["store"]},
                                                          run_dir / "store"),
                   "hilore-blind": ActorWorker.in_process(config, "hilore-blind", paths, run_dir)}
        for w in workers.values():
            w.warm()
        reference = workers["hilore-blind"]
        plan = plan_update(reference.batch, reference.loss, reference.update, reference.buckets)
        bucket, rows = next((b, r) for b, r in reversed(plan.runs) if b != "zero")
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
        for i in range(args.pairs):
            for m in METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]:
                times[m].append(timed(workers[m], plan, bucket, rows))
        recovery = blind.bucket(bucket).time_s
        print(f"one microbatch of bucket {bucket} ({len(rows)} rows x {config.seq_len} tokens), {args.pairs} "
              f"timings per method; the blind plan's predicted recovery: {recovery * 1e3:.2f} ms")
        print("method | forward ms | backward ms | microbatch ms | x store-all's microbatch [95% CI]")
        whole = {m: [f + b for f, b in t] for m, t in times.items()}
        for m in METHODS:
            ratio = geometric_interval([a / b for a, b in zip(whole[m], whole["store-all"])])
            print(f"{m} | {statistics.median(f for f, _ in times[m]) * 1e3:.1f} | "
                  f"{statistics.median(b for _, b in times[m]) * 1e3:.1f} | {statistics.median(whole[m]) * 1e3:.1f} | "
                  + ("-" if m == "store-all" else f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]"),
                  flush=True)


if __name__ == "__main__":
    main()
