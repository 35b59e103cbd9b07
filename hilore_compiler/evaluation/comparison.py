"""``run_comparison``: the arms a user chooses between, trained side by side, paired by seed.

Order of work (each step reports on stderr):

1. compile every arm of ``CompareConfig.arms`` (``arms.bench_arm``) and call
   it once: the backend traces, profiles and plans the policy at the
   microbatch shape, as on a user's first call (``exact`` is the eager policy,
   ``store-all`` plain ``torch.compile``, the control for rounding alone);
2. paired training (``training.train_paired``): every arm from each seed's
   initial weights, on the same prompts and sampling draws, with the KL
   reference at those initial weights; every ``fidelity_every`` steps a
   compiled arm's update is measured against the exact one (``stepfidelity``);
3. the results: each arm's paired final-score difference to ``exact`` with its
   95% interval, the per-bucket gradient cosines, the plans (``report``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ..backend.cache import default_cache_dir
from ..grpo import GRPOConfig, UpdateConfig
from ..models import build_model
from . import arms as arms_mod
from .report import step_fidelity_summary, training_summary
from .suite import machine, torch_threads
from .task import TaskConfig
from .training import Progress, RunSetup, TrainConfig, train_paired

SCHEMA = "hilore.eval-compare/v1"
#: The reference every other arm is compared with.
EXACT = "exact"


@dataclass(frozen=True, slots=True, kw_only=True)
class CompareConfig:
    """One comparison: the task, the GRPO run, the arms and how many paired seeds."""

    #: The preset this came from (``presets.PRESETS``), for the record.
    preset: str
    task: TaskConfig
    train: TrainConfig
    grpo: GRPOConfig
    #: ``exact`` first, then names of ``arms.BENCH_ARMS``.
    arms: tuple[str, ...] = (EXACT, "hilore", "hilore-int4", "int8-recompute", "store-all")
    #: Paired seeds 0 .. seeds - 1.
    seeds: int = 16
    #: Rows per forward/backward; the compiled arms are planned at this batch.
    microbatch: int = 16
    #: Exposure buckets the exact arm cuts a batch into (compiled arms use their plan's).
    buckets: int = 3
    #: Torch CPU threads (the tiny policy's matmuls are too small to split).
    threads: int = 1
    #: Where the backend caches traces and plans.
    cache_dir: str = field(default_factory=default_cache_dir)
    model: str = "tiny"

    def __post_init__(self) -> None:
        if self.arms[:1] != (EXACT,):
            raise ValueError(f"arms must start with {EXACT!r}, the reference; got {list(self.arms)}")
        unknown = [a for a in self.arms[1:] if a not in arms_mod.BENCH_ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; arms: {[EXACT, *arms_mod.BENCH_ARMS]}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")


def plan_record(arm: arms_mod.Arm) -> dict[str, Any]:
    """What the backend planned for ``arm``: budget, bytes and option counts per bucket."""
    plan = arm.plan
    return {"budget": plan.budget, "budget_bytes": plan.budget_bytes, "gc_bytes": plan.gc_bytes,
            "store_bytes": plan.store_bytes, "codecs": list(plan.codecs), "risk_budget": plan.risk_budget,
            "variants": len(arm.backend.graphs[0].variants),
            "buckets": {b.bucket.name: {"options": arms_mod.option_counts(b), "memory_bytes": b.memory_bytes,
                                        "risk": b.risk, "lo": b.bucket.lo, "hi": b.bucket.hi}
                        for b in plan.buckets if not b.skip}}


def build_arms(config: CompareConfig, say: Progress) -> tuple[list[arms_mod.Arm], dict[str, float]]:
    """The exact arm and every compiled arm, planned and compiled; and each one's compile seconds."""
    built, seconds = [arms_mod.exact_arm(build_model(config.model, seed=0))], {}
    for name in config.arms[1:]:
        start = time.perf_counter()
        arm = arms_mod.bench_arm(name, build_model(config.model, seed=0), config.microbatch, config.cache_dir)
        built.append(arms_mod.warm_up(arm, config.microbatch, config.task.seq_len))
        seconds[name] = time.perf_counter() - start
        plan = built[-1].plan
        say(f"compiled {name} in {seconds[name]:.0f} s: " + (", ".join(
            f"{b.bucket.name} {arms_mod.option_counts(b)}" for b in plan.buckets if not b.skip)
            if plan is not None else "Inductor's own partition"))
    return built, seconds


def run_comparison(config: CompareConfig, say: Progress) -> dict[str, Any]:
    """Run the comparison (module docstring) under ``config.threads`` threads; the results payload."""
    with torch_threads(config.threads):
        return _run(config, say)


def _run(config: CompareConfig, say: Progress) -> dict[str, Any]:
    start = time.perf_counter()
    say(f"{config.preset}: {len(config.arms)} arms x {config.seeds} seeds x {config.train.steps} steps, "
        f"samples of {config.task.seq_len} tokens ({config.task.response_len} generated)")
    arms, compile_s = build_arms(config, say)
    t = time.perf_counter()
    setup = RunSetup(task=config.task, train=config.train, grpo=config.grpo, model=config.model,
                     update=UpdateConfig(microbatch_size=config.microbatch, n_buckets=config.buckets))
    runs = train_paired(arms, list(range(config.seeds)), setup, say)
    training_s = time.perf_counter() - t
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": dataclasses.asdict(config),
        "machine": machine(),
        "plans": {arm.name: plan_record(arm) for arm in arms if arm.plan is not None},
        "training": training_summary(runs, reference=EXACT),
        "step_fidelity": step_fidelity_summary(runs),
        "runs": [dataclasses.asdict(r) for r in runs],
        "timings": {"compile_s": compile_s, "training_s": training_s, "total_s": time.perf_counter() - start},
    }
