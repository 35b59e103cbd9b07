"""``hilore bench --verl-zero``: verl's actor update at the zero-advantage shares GRPO really has.

One ``spawn`` of ``nproc`` gloo ranks on the CPU builds three FSDP2 engines
on one tiny random Qwen2 and times ``train_batch`` (forward, loss, backward,
optimizer step) with verl's dynamic batch size on:

- ``verl``: verl's ``FSDPEngineWithLMHead``, gradient checkpointing on (its default);
- ``hilore-skip``: ``HiLoReFSDPEngine`` with ``hilore_drop_zero=False``: verl's
  micro-batches, whole zero-exposure ones skipped where every rank can;
- ``hilore-drop``: ``HiLoReFSDPEngine``: zero-exposure samples dropped, the
  rest packed by exposure (``grpo.packing.drop_then_pack``).

Each rank's batch holds ``groups`` GRPO groups of ``group_size`` responses of
random lengths; a ``zero share`` of them have all-equal rewards (advantage 0),
the others a normal advantage per response. Every round runs every share,
and within a share every arm once, the arms' order rotating per round;
a step's time is the slowest rank's. Paired per round: each arm's time over
verl's, geometric mean and 95% t-interval (``paired.geometric_interval``).
Warm-up rounds compile every packed length the hilore arms meet first.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from .paired import format_paired, geometric_interval

#: The engines timed, in the first round's order.
ARMS = ("verl", "hilore-skip", "hilore-drop")


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlZeroConfig:
    """Sizes of ``--verl-zero``: model, batch, verl's token budget, rounds."""

    #: Shares of all-equal-reward groups, each rank alike.
    zero_shares: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75)
    #: GRPO groups per rank, responses per group.
    groups: int = 8
    group_size: int = 4
    #: Longest prompt and response; each sample's lengths are drawn up to them.
    prompt: int = 32
    response: int = 96
    #: verl's ``max_token_len_per_gpu`` (dynamic batch size): tokens per micro-batch.
    max_tokens: int = 1024
    #: The Qwen2's width, blocks and vocabulary.
    hidden: int = 128
    layers: int = 2
    vocab: int = 512
    #: Measured rounds, and rounds before them (compiles, first lengths).
    rounds: int = 5
    warmup: int = 2
    nproc: int = 2
    #: The hilore arms' options (``codecs: []``: exact plans, so only the drop differs).
    hilore: tuple[tuple[str, Any], ...] = (("codecs", ()), ("buckets", 2), ("verbose", False))
    seed: int = 0

    def __post_init__(self) -> None:
        if not all(0.0 <= s < 1.0 for s in self.zero_shares):
            raise ValueError(f"zero shares must be in [0, 1), got {self.zero_shares}")
        if self.max_tokens < self.prompt + self.response:
            raise ValueError("max_tokens must hold the longest sample (verl asserts it)")


#: ``--quick``: fewer and smaller, to check the pipe.
QUICK = {"groups": 4, "response": 32, "max_tokens": 256, "rounds": 2, "warmup": 1}


def rank_batch(config: VerlZeroConfig, rank: int, share: float) -> Any:
    """This rank's GRPO batch at one zero share, as verl's trainer hands it over (no padding)."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(config.seed * 1000 + rank)  # the same samples at every share
    n, p, r = config.groups * config.group_size, config.prompt, config.response
    ids = torch.randint(1, config.vocab, (n, p + r), generator=g)
    prompt_len = torch.randint(p // 2, p + 1, (n,), generator=g)
    response_len = torch.randint(r // 4, r + 1, (n,), generator=g)
    attention = torch.zeros(n, p + r, dtype=torch.long)
    for i in range(n):
        attention[i, p - prompt_len[i]:p + response_len[i]] = 1
    mask = attention[:, p:].clone()  # (B, R)
    adv = torch.randn(n, generator=g)
    zero_groups = torch.randperm(config.groups, generator=g)[:round(share * config.groups)]
    for k in zero_groups.tolist():
        adv[k * config.group_size:(k + 1) * config.group_size] = 0.0
    td = TensorDict({"prompts": ids[:, :p].clone(), "responses": ids[:, p:].clone(), "input_ids": ids,
                     "attention_mask": attention, "response_mask": mask,
                     "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                     "advantages": adv[:, None] * mask, "old_log_probs": torch.zeros(n, r)}, batch_size=[n])
    return left_right_2_no_padding(td)


def _engines(config: VerlZeroConfig, path: str) -> dict[str, Any]:
    from .verl_engines import build_engine

    hilore = {k: list(v) if isinstance(v, tuple) else v for k, v in config.hilore}
    common = dict(micro_batch_size=config.group_size, optimizer="AdamW", lr=1e-6)
    return {
        "verl": build_engine(path, None, enable_gradient_checkpointing=True, **common),
        "hilore-skip": build_engine(path, hilore, engine_fields={"hilore_drop_zero": False}, **common),
        "hilore-drop": build_engine(path, hilore, **common),
    }


def _prepared(config: VerlZeroConfig, engine: Any, rank: int, share: float) -> Any:
    """The batch with verl's settings and on-policy old log-probs (one forward_only pass)."""
    import verl.utils.tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    data = rank_batch(config, rank, share)
    tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=True, temperature=1.0,
                         max_token_len_per_gpu=config.max_tokens, micro_batch_size_per_gpu=config.group_size,
                         global_batch_size=config.nproc * config.groups * config.group_size)
    with engine.eval_mode():
        logp = engine.infer_batch(data.clone(), loss_function=None)["model_output"]["log_probs"]
    data["old_log_probs"] = no_padding_2_padding(logp, data)
    return data


def _timed_update(engine: Any, data: Any, loss: Any) -> float:
    """Seconds of one ``train_batch``, the slowest rank's."""
    torch.distributed.barrier()
    start = time.perf_counter()
    with engine.train_mode():
        engine.train_batch(data.clone(), loss_function=loss)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)
    return float(seconds.item())


def rank_main(rank: int, world: int, config: VerlZeroConfig, path: str) -> dict:
    """Warm-up and measured rounds on this rank; seconds per share and arm, and the packings seen."""
    from verl.plugin.platform import set_platform
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from .verl_engines import cpu_platform

    set_platform(cpu_platform())
    import hilore_compiler.integrations.verl  # noqa: F401  (what verl's external_lib does)

    torch.manual_seed(config.seed)
    engines = _engines(config, path)
    batches = {s: _prepared(config, engines["verl"], rank, s) for s in config.zero_shares}
    actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=world * config.groups * config.group_size,
                        ppo_micro_batch_size_per_gpu=config.group_size, use_dynamic_bsz=True,
                        rollout_n=config.group_size)
    loss = functools.partial(ppo_loss, config=actor)
    seconds = {s: {a: [] for a in ARMS} for s in config.zero_shares}
    packings: dict[float, dict[str, Any]] = {}
    for r in range(config.warmup + config.rounds):
        arms = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # each arm first in turn
        for s in config.zero_shares:
            for arm in arms:
                t = _timed_update(engines[arm], batches[s], loss)
                if r >= config.warmup:
                    seconds[s][arm].append(t)
            packings[s] = {arm: engines[arm].bucket_history[-1] for arm in ARMS[1:]}
    return {"seconds": seconds, "packings": packings}


def summarise(config: VerlZeroConfig, ranks: list[dict]) -> dict:
    """Per share: median seconds per arm, paired ratios over verl's, rank 0's packings."""
    rows = []
    for s in config.zero_shares:
        per_arm = ranks[0]["seconds"][s]  # every rank reports the slowest rank's time
        ratios = {}
        for arm in ARMS[1:]:
            paired = geometric_interval([a / b for a, b in zip(per_arm[arm], per_arm["verl"])])
            ratios[arm] = dataclasses.asdict(paired) if paired else None
        drop_over_skip = geometric_interval([a / b for a, b in zip(per_arm["hilore-drop"], per_arm["hilore-skip"])])
        rows.append({"zero_share": s, "median_seconds": {a: statistics.median(v) for a, v in per_arm.items()},
                     "seconds": per_arm, "time_over_verl": ratios,
                     "drop_over_skip": dataclasses.asdict(drop_over_skip) if drop_over_skip else None,
                     "packings_rank0": ranks[0]["packings"][s]})
    return {"config": dataclasses.asdict(config), "arms": list(ARMS), "rows": rows}


def run_verl_zero(config: VerlZeroConfig) -> dict:
    """Save the model, spawn the ranks, summarise."""
    from ..distributed import spawn
    from .verl_engines import save_tiny_qwen2

    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_qwen2(tmp, hidden=config.hidden, layers=config.layers, vocab=config.vocab,
                        max_positions=config.prompt + config.response, seed=config.seed)
        ranks = spawn(rank_main, config.nproc, config, tmp, backend="gloo", timeout_s=3600)
    return summarise(config, ranks)


def format_table(report: dict) -> str:
    """Median update seconds per arm and paired time ratios, one line per zero share."""
    lines = ["zero groups | verl s | hilore-skip s | hilore-drop s | skip / verl | drop / verl | drop / skip"]
    for row in report["rows"]:
        m, r = row["median_seconds"], row["time_over_verl"]
        cells = [format_paired(r["hilore-skip"]), format_paired(r["hilore-drop"]), format_paired(row["drop_over_skip"])]
        lines.append(f"{row['zero_share']:>10.0%} | {m['verl']:.3f} | {m['hilore-skip']:.3f} | "
                     f"{m['hilore-drop']:.3f} | " + " | ".join(cells))
    return "\n".join(lines)


__all__ = ["ARMS", "QUICK", "VerlZeroConfig", "format_table", "rank_batch", "run_verl_zero", "summarise"]
