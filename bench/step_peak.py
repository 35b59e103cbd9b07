"""The whole actor step's peak: predicted part by part against what was measured.

Builds ``small-v128k`` (Llama-3's vocabulary) at batch 2 x 256 tokens and
runs one step of each:

- GC + chunked log-probs: ``grpo.compiled_step`` with checkpointed chunks of
  128 tokens and GC around every layer, plain Inductor;
- HiLoRe whole step: the hilore backend on the same step with the chunks left
  to the planner, at 1.10x GC + chunked's measured peak (``gc_peak_bytes``).

For each it prints the measured peak twice, as the bench measures it (VmHWM
over the step) and as the allocator counts it (``torch.profiler``), the
allocations of 10 MB or more in order with the running total (the peak
marked), and for HiLoRe the plan's predicted peak and its parts
(``solver.stepterms.PeakParts``). Run from the repository root (about 3 minutes):

    python3 bench/step_peak.py [--codecs bf16,int8]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.bench.measure import MMAP_THRESHOLD_ENV, allocation_trail, measure_cpu
from hilore_compiler.bench.methods import wrap_layers
from hilore_compiler.grpo import GRPOConfig, compiled_step
from hilore_compiler.models import build_model, token_logprobs

BATCH, SEQ, CHUNK, MB = 2, 256, 128, 1e6


def large_allocations(step) -> tuple[int, list[tuple[int, int, bool]]]:
    """(peak bytes the allocator held during ``step()``, [(delta, running total, at peak)] for
    allocations and frees of 10 MB or more)."""
    peak, running = allocation_trail(step)
    return peak, [(d, t, t == peak) for d, t in running if abs(d) >= 10 * MB]


def run(name: str, model: torch.nn.Module, step_fn, batch) -> int:
    def step() -> None:
        step_fn(*batch).backward()

    model.zero_grad(set_to_none=True)
    step()  # compile and warm up
    model.zero_grad(set_to_none=True)
    step()
    model.zero_grad(set_to_none=True)
    measured = measure_cpu(step).peak_bytes
    model.zero_grad(set_to_none=True)
    counted, trail = large_allocations(step)
    print(f"== {name}: measured peak {measured / MB:.1f} MB (VmHWM), {counted / MB:.1f} MB (allocator)")
    print("   allocations >= 10 MB (delta -> running total, * at the peak): " + ", ".join(
        f"{d / MB:+.0f}->{t / MB:.0f}{'*' if p else ''}" for d, t, p in trail))
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--codecs", default="none", help="HiLoRe's codecs, comma-separated (default none: exact)")
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in MMAP_THRESHOLD_ENV.items()):  # VmHWM needs it from the start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MMAP_THRESHOLD_ENV})
    torch.manual_seed(0)
    model = build_model("small-v128k")
    ids = torch.randint(model.config.vocab_size, (BATCH, SEQ))  # (B, T)
    with torch.no_grad():
        old = token_logprobs(model(ids), ids)  # (B, T-1), on-policy
    batch = (ids, old, torch.randn(BATCH), torch.ones(BATCH, SEQ - 1))
    loss = GRPOConfig()
    gc_model = copy.deepcopy(model)  # wrap_layers checkpoints the layers in place
    gc = compiled_step(wrap_layers(gc_model), loss, backend="inductor", chunk_tokens=CHUNK)
    gc_peak = run("GC + chunked log-probs", gc_model, gc, batch)
    del gc_model, gc
    codecs = [] if args.codecs == "none" else args.codecs.split(",")
    with tempfile.TemporaryDirectory() as cache:
        backend = HiLoReBackend({"codecs": codecs, "memory_budget": "1.10x-gc", "gc_peak_bytes": gc_peak,
                                 "buckets": 1, "verbose": False, "cache_dir": cache})
        hilore = compiled_step(model, loss, backend=backend, chunk_tokens=CHUNK, checkpoint_chunks=False)
        measured = run(f"HiLoRe whole step (codecs: {args.codecs})", model, hilore, batch)
        (path,) = Path(cache).glob("*.plan.json")
        bucket = next(b for b in json.loads(path.read_text())["buckets"] if b["plan"] != "skip")
    predicted = bucket["predicted"]
    parts = ", ".join(f"{k} {v / MB:.1f}" for k, v in predicted["peak_parts"].items())
    print(f"   predicted peak {predicted['memory_bytes'] / MB:.1f} MB ({(predicted['memory_bytes'] / measured - 1):+.1%}"
          f" vs measured) at {predicted['peak_at']}: kept {predicted['kept_bytes'] / MB:.1f} + {parts} MB")
    print(f"   HiLoRe / GC + chunked peak: {measured / gc_peak:.3f}")


if __name__ == "__main__":
    main()
