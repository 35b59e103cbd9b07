"""``hilore bench --nproc N``: GC, store-all and HiLoRe per block under FSDP2, N processes.

Every method runs in its own ``spawn`` of N ranks (gloo on CPU, nccl where
each rank has a GPU), with the same weights and per-rank batches. Per rank:
``compile_blocks`` (GC: each block under ``torch.utils.checkpoint`` first),
``shard_blocks`` (FSDP2 on each block and the root), then ``grpo.actor_update``
steps: one warm-up (compiles) and ``steps`` measured ones. Reported per
method: each rank's peak memory of the step (``bench.measure``: CPU VmHWM
with ``MALLOC_MMAP_THRESHOLD_``, CUDA max_memory_allocated) and the
aggregate tokens/s (summed over ranks by ``actor_update``), median of steps.

HiLoRe: rank 0 traces the whole step and solves one plan, broadcast to every
rank (``distributed.plan_sync``); block i applies layer i's decisions.
Microbatches hold one sample, so every block graph has one shape and the
plan fits every microbatch.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: Methods of the distributed bench, in run order.
DIST_METHODS = ("gc", "store-all", "hilore")

#: ``--quick``: the tiny model at a short sequence.
DIST_QUICK = {"model": "tiny", "batch": 4, "seq_len": 64, "steps": 3}


@dataclass(frozen=True, slots=True, kw_only=True)
class DistBenchConfig:
    """One distributed bench run; ``batch`` is per rank."""

    nproc: int = 2
    model: str = "small"
    #: Sequences per rank per update.
    batch: int = 4
    seq_len: int = 512
    #: Measured updates per method (after one warm-up update).
    steps: int = 3
    methods: tuple[str, ...] = DIST_METHODS
    hilore_budget: str = "1.10x-gc"
    hilore_codecs: tuple[str, ...] = ("bf16", "int8")
    hilore_buckets: int = 3
    #: torch threads per rank (the ranks share the machine's cores).
    threads: int = 1
    seed: int = 0
    #: "gloo" or "nccl"; None: nccl when GPUs are lent, else gloo.
    backend: str | None = None


def rank_batch(config: DistBenchConfig, rank: int, vocab: int):
    """This rank's rollout batch: one quarter zero-advantage samples, the rest spread in |A|."""
    from ..grpo import RolloutBatch

    g = torch.Generator().manual_seed(config.seed * 1000 + rank)
    ids = torch.randint(vocab, (config.batch, config.seq_len), generator=g)
    adv = torch.randn(config.batch, generator=g)
    adv[: config.batch // 4] = 0.0  # equal-reward groups: the zero bucket
    mask = torch.ones(config.batch, config.seq_len - 1)
    mask[:, : config.seq_len // 4] = 0.0  # the prompt
    return RolloutBatch(input_ids=ids, response_mask=mask, old_logprobs=torch.zeros_like(mask),
                        advantages=adv)


def _prepare(method: str, model: torch.nn.Module, config: DistBenchConfig,
             batch: Any) -> dict[str, Any]:
    """Compile the blocks of ``model`` the way ``method`` runs them; returns what to report."""
    from ..distributed import compile_blocks
    from ..distributed.plan_sync import plan_digest, shared_step_plan
    from .methods import wrap_layers

    if method == "store-all":
        compile_blocks(model, backend="inductor")
        return {}
    if method == "gc":
        compile_blocks(wrap_layers(model), backend="inductor")
        return {}
    if method == "hilore":
        options = {"memory_budget": config.hilore_budget, "codecs": config.hilore_codecs,
                   "buckets": config.hilore_buckets, "verbose": False}
        plan = shared_step_plan(model, batch.input_ids[:1], options)  # the microbatch shape
        compiled = compile_blocks(model, {**options, "plan": plan})
        return {"plan_digest": plan_digest(plan)[:16], "gc_bytes": plan.gc_bytes,
                "store_bytes": plan.store_bytes, "budget_bytes": plan.budget_bytes,
                "block_graphs": len({id(c) for c in compiled})}
    raise ValueError(f"unknown method {method!r}; methods: {', '.join(DIST_METHODS)}")


def rank_main(rank: int, world: int, config_json: str, method: str) -> dict[str, Any]:
    """One rank of one method: build, compile, shard, warm up, measure."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..distributed import shard_blocks
    from ..grpo import GRPOConfig, UpdateConfig, actor_update
    from ..models import build_model
    from .measure import measure_step

    config = DistBenchConfig(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in json.loads(config_json).items()})
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() and config.backend != "gloo"
                          else "cpu")
    model = build_model(config.model, seed=config.seed, device=device)
    batch = rank_batch(config, rank, model.config.vocab_size)
    batch = dataclasses.replace(batch, **{f: getattr(batch, f).to(device) for f in
                                          ("input_ids", "response_mask", "old_logprobs", "advantages")})
    from ..distributed.blocks import fsdp_weight_bytes

    info = {"weights": fsdp_weight_bytes(model, world), **_prepare(method, model, config, batch)}
    shard_blocks(model, init_device_mesh(device.type, (world,)))
    update = UpdateConfig(microbatch_size=1, n_buckets=config.hilore_buckets)
    reports: list[Any] = []

    def step() -> None:
        reports.append(actor_update(model, None, batch, GRPOConfig(), update=update))

    warm = measure_step(step, device)  # compiles
    samples = [measure_step(step, device) for _ in range(config.steps)]
    measured = reports[1:]
    return {"rank": rank, "compile_s": warm.seconds,
            "peak_bytes": max(s.peak_bytes for s in samples),
            "tokens_per_s": statistics.median(r.tokens_per_s for r in measured),
            "microbatches": measured[-1].microbatches, "run_buckets": measured[-1].run_buckets,
            "skipped": measured[-1].samples_skipped, **info}


def run_dist_bench(config: DistBenchConfig, progress=lambda m: None) -> dict[str, Any]:
    """Every method in its own spawn of ``config.nproc`` ranks; results by method."""
    from ..distributed import RankFailed, spawn
    from .measure import MMAP_THRESHOLD_ENV

    results: dict[str, Any] = {}
    text = json.dumps(dataclasses.asdict(config))
    for method in config.methods:
        progress(f"{method}: {config.nproc} ranks")
        try:
            ranks = spawn(rank_main, config.nproc, text, method, backend=config.backend,
                          threads=config.threads, env=MMAP_THRESHOLD_ENV, timeout_s=1800)
            results[method] = {"status": "ok", "ranks": ranks}
        except RankFailed as e:
            last = str(e).strip().splitlines()[-1]
            results[method] = {"status": "failed", "error": last}
            progress(f"{method} failed: {last}")
    return {"config": dataclasses.asdict(config), "torch": torch.__version__, "methods": results}


def format_dist_table(result: dict[str, Any]) -> str:
    """Markdown table: per-rank peak, aggregate tokens/s, both relative to GC."""
    methods = result["methods"]
    gc = methods.get("gc", {})
    gc_tps = statistics.median(r["tokens_per_s"] for r in gc["ranks"]) if gc.get("status") == "ok" else None
    gc_peak = max(r["peak_bytes"] for r in gc["ranks"]) if gc_tps else None
    lines = ["| method | peak per rank (MiB) | peak / GC | tokens/s (all ranks) | speed / GC |",
             "|---|---|---|---|---|"]
    for name, m in methods.items():
        if m["status"] != "ok":
            lines.append(f"| {name} | failed: {m['error'][:80]} | | | |")
            continue
        peaks = [r["peak_bytes"] for r in m["ranks"]]
        tps = statistics.median(r["tokens_per_s"] for r in m["ranks"])
        rel_peak = f"{max(peaks) / gc_peak:.2f}" if gc_peak else "-"
        rel_tps = f"{tps / gc_tps:.2f}" if gc_tps else "-"
        lines.append(f"| {name} | {' / '.join(f'{p / 2**20:.1f}' for p in peaks)} | {rel_peak} "
                     f"| {tps:.0f} | {rel_tps} |")
    return "\n".join(lines)


def run_command(args: Any) -> int:
    """``hilore bench --nproc N`` (called by ``commands/bench.py``); exit 1 if a method failed."""
    values: dict[str, Any] = dict(DIST_QUICK) if args.quick else {}
    for name in ("model", "batch", "seq_len", "seed", "threads", "hilore_budget"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    if args.methods:
        values["methods"] = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if getattr(args, "device", None) == "cpu":
        values["backend"] = "gloo"
    config = DistBenchConfig(nproc=args.nproc, **values)
    result = run_dist_bench(config, lambda m: print(f"bench: {m}", file=sys.stderr, flush=True))
    print(format_dist_table(result))
    out = Path(args.output or Path("bench") / "results" /
               f"bench-fsdp-{config.model}-T{config.seq_len}-np{config.nproc}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"results: {out}")
    return 1 if any(m["status"] != "ok" for m in result["methods"].values()) else 0
