"""Compile Hugging Face causal LMs (tiny configs, random weights) with hilore.

For each architecture: the gradient of one step through
``torch.compile(model, backend="hilore")`` (zero config, store/recompute
only, so it must equal eager up to rounding) against eager, and the compile
time against plain Inductor on the same model. Nothing is downloaded.

    python examples/hf_compile.py [--archs llama qwen2 mistral gemma gpt2] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from hilore_compiler import HiLoReBackend
from hilore_compiler.models.hf import HF_ARCHS, build_hf_model

def step(model: torch.nn.Module, run, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Gradient of one forward + backward, and its wall time."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    run(**batch).logits.float().log_softmax(-1).pow(2).mean().backward()
    seconds = time.perf_counter() - start
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=list(HF_ARCHS), choices=HF_ARCHS)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    print(f"{'arch':<8} {'rel. L2 vs eager':>16} {'recomputed':>10} {'inductor s':>10} {'hilore s':>9}")
    for arch in args.archs:
        model = build_hf_model(arch, vocab_size=args.vocab, hidden=64, intermediate=128, max_positions=256)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        eager, _ = step(model, model, batch)
        # The first call compiles: its time is the compile time (plus one step).
        _, inductor_s = step(model, torch.compile(model, dynamic=False), batch)
        torch._dynamo.reset()
        backend = HiLoReBackend({"codecs": [], "buckets": 1, "memory_budget": "1.0x-gc", "verbose": False,
                                 "cache_dir": tempfile.mkdtemp(prefix="hilore-hf-")})
        got, hilore_s = step(model, torch.compile(model, backend=backend, dynamic=False), batch)
        torch._dynamo.reset()
        rel = float((got - eager).norm() / eager.norm())
        recomputed = sum(r.counts.get("recompute", 0) for g in backend.graphs for r in g.records)
        print(f"{arch:<8} {rel:>16.2e} {recomputed:>10} {inductor_s:>10.1f} {hilore_s:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
