"""``hilore bench --nproc N``: GC, store-all and HiLoRe per block under FSDP2, N processes.

One ``spawn`` of N ranks (gloo on CPU, nccl where each rank has a GPU) runs
every method, each with its own model (same weights, same per-rank batches):
``compile_blocks`` (GC: each block under ``torch.utils.checkpoint`` first),
``shard_blocks`` (FSDP2 on each block and the root), one warm-up
``grpo.actor_update`` (compiles), then ``steps`` rounds in which every method
runs one measured update in turn, so load from other jobs hits them alike.
Reported per method: each rank's peak memory of the step (``bench.measure``:
CPU VmHWM with ``MALLOC_MMAP_THRESHOLD_``, so freed tensors leave the process
and one method's step does not hide in another's; CUDA max_memory_allocated)
and the aggregate tokens/s (summed over ranks by ``actor_update``), median of
rounds.

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


#: Every method compiles fresh in every rank, so no method is timed off
#: another's cached kernels. (This once also hid a failure: Inductor's cache
#: keys pickled the hilore partitioner's real tensors, freed by FSDP by the
#: time a lazily compiled backward was keyed; partitioners now pickle to
#: their identity.)
NO_INDUCTOR_CACHE = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}


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


def _setup(method: str, config: DistBenchConfig, rank: int, world: int, device: torch.device):
    """Build, compile and shard one method's model; returns (one update, what to report)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..distributed import shard_blocks
    from ..distributed.blocks import fsdp_weight_bytes
    from ..grpo import GRPOConfig, UpdateConfig, actor_update
    from ..models import build_model

    model = build_model(config.model, seed=config.seed, device=device)
    batch = rank_batch(config, rank, model.config.vocab_size)
    batch = dataclasses.replace(batch, **{f: getattr(batch, f).to(device) for f in
                                          ("input_ids", "response_mask", "old_logprobs", "advantages")})
    info = {"weights": fsdp_weight_bytes(model, world), **_prepare(method, model, config, batch)}
    shard_blocks(model, init_device_mesh(device.type, (world,)))
    update = UpdateConfig(microbatch_size=1, n_buckets=config.hilore_buckets)
    return (lambda: actor_update(model, None, batch, GRPOConfig(), update=update)), info


def rank_main(rank: int, world: int, config_json: str) -> dict[str, Any]:
    """One rank: every method set up and warmed up, then measured updates alternating by round."""
    from .measure import measure_step

    config = DistBenchConfig(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in json.loads(config_json).items()})
    device = torch.device(f"cuda:{rank}" if torch.cuda.is_available() and config.backend != "gloo"
                          else "cpu")
    steps, out, reports = {}, {}, {m: [] for m in config.methods}
    for method in config.methods:
        update, info = _setup(method, config, rank, world, device)
        steps[method] = lambda m=method, u=update: reports[m].append(u())
        out[method] = {"rank": rank, "compile_s": measure_step(steps[method], device).seconds,
                       "peaks": [], **info}
    for _ in range(config.steps):  # alternating: load from other jobs hits every method alike
        for method in config.methods:
            out[method]["peaks"].append(measure_step(steps[method], device).peak_bytes)
    for method, r in out.items():
        measured = reports[method][1:]
        r.update(peak_bytes=max(r.pop("peaks")),
                 tokens_per_s=statistics.median(x.tokens_per_s for x in measured),
                 microbatches=measured[-1].microbatches, run_buckets=measured[-1].run_buckets,
                 skipped=measured[-1].samples_skipped)
    return out


def run_dist_bench(config: DistBenchConfig, progress=lambda m: None) -> dict[str, Any]:
    """Every method in one spawn of ``config.nproc`` ranks, alternating; results by method."""
    from ..distributed import RankFailed, spawn
    from .measure import MMAP_THRESHOLD_ENV

    progress(f"{', '.join(config.methods)}: {config.nproc} ranks, {config.steps} alternating rounds")
    try:
        ranks = spawn(rank_main, config.nproc, json.dumps(dataclasses.asdict(config)),
                      backend=config.backend, threads=config.threads,
                      env={**MMAP_THRESHOLD_ENV, **NO_INDUCTOR_CACHE}, timeout_s=3600)
        results = {m: {"status": "ok", "ranks": [r[m] for r in ranks]} for m in config.methods}
    except RankFailed as e:
        last = str(e).strip().splitlines()[-1]
        progress(f"failed: {last}")
        results = {m: {"status": "failed", "error": last, "traceback": str(e)[-6000:]}
                   for m in config.methods}
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
    from ..commands import comma_list

    values: dict[str, Any] = dict(DIST_QUICK) if args.quick else {}
    for name in ("model", "batch", "seq_len", "seed", "threads", "hilore_budget"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    if getattr(args, "steps_per_round", None) is not None:
        values["steps"] = args.steps_per_round  # measured updates per method
    if args.methods:
        values["methods"] = comma_list(args.methods)
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
