"""``run_evaluation``: trace, plan, fidelity per bucket, paired training, one results dict.

Order of work (each step reports on stderr):

1. trace the policy once at the microbatch shape (``arms.trace_policy``);
2. solve the hilore plans at the planned and the tight budget; a budget that
   is infeasible is reported and replaced by the smallest feasible one (the
   probe budgets are only solved, to report whether they are feasible);
3. compile the arms: hilore at each budget, the exposure-blind control at the
   same memory and error budget, blind int8, and store-all (Inductor's rounding alone);
4. gradient fidelity of every compiled arm per bucket (``fidelity``);
5. paired training: exact, hilore (at the tight budget, or the planned one if
   the tight plan's buckets collapsed), and the exposure-blind control at the
   same memory and error budget (``training``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend.cache import default_cache_dir
from ..grpo import GRPOConfig, UpdateConfig, plan_buckets
from ..models import build_model
from ..planfile import Plan
from ..tracefile import Trace
from . import arms as arms_mod
from .fidelity import FidelitySetup, arm_fidelity
from .report import training_summary
from .task import TaskConfig
from .training import Progress, RunSetup, TrainConfig, train_paired

SCHEMA = "hilore.eval/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalConfig:
    """Everything ``hilore eval`` runs; the defaults are the full evaluation."""

    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    #: Paired seeds of the training run (0 .. seeds - 1). Eight: 3 arms x 300
    #: steps took 0.06-0.065 s a step on 2 busy cores with 1 thread (quick
    #: run), so about 8 minutes of training plus a few of compiling.
    seeds: int = 8
    #: The budget plans are made for by default (the paper's ceiling).
    planned_budget: str = "1.10x-gc"
    #: A budget that forces compression and recompute; training runs at it.
    #: Not the smallest feasible one: there the top bucket's plan is the only
    #: one that fits and every bucket gets it, so exposure could not matter.
    tight_budget: str = "0.75x-gc"
    #: Budgets only solved (not compiled) to report whether they are feasible
    #: and, if not, the smallest budget that is.
    probe_budgets: tuple[str, ...] = ("0.6x-gc",)
    #: Error budget of the hilore plans (the update's squared relative gradient
    #: error, or ``"cos>=c"``); None: ``auto_risk_budget``, one that binds.
    risk_budget: float | str | None = None
    #: Nonzero exposure buckets of the plans.
    buckets: int = 3
    #: Costs the plans minimise time under. Roofline, not measured: the tiny
    #: policy's units take ~0.3 ms to recompute or encode on CPU, timing noise
    #: at that size reorders them, and two processes solved the same budget
    #: into different plans (other units compressed, buckets merged in one
    #: and split in the other). Roofline costs make the plan a function of the
    #: graph; memory and gradient error, what is evaluated, do not depend on it.
    cost_model: str = "roofline:h100"
    #: Rows per forward/backward; the compiled graphs are traced at this batch.
    microbatch: int = 16
    #: Prompts per fidelity batch (each with ``train.group_size`` samples).
    fidelity_prompts: int = 4
    #: Seed of the weights and samples the fidelity batches use.
    fidelity_seed: int = 7
    #: Torch CPU threads: one, because the tiny model's matmuls are too small
    #: to split and more threads only contend with the other processes.
    threads: int = 1
    #: Where the backend may cache (it is given plans, so it writes little).
    cache_dir: str = field(default_factory=default_cache_dir)
    model: str = "tiny"


def quick_config(**overrides: Any) -> EvalConfig:
    """A few minutes end to end: two seeds, short runs, small held-out set."""
    train = TrainConfig(steps=40, eval_every=20, eval_prompts=300, final_evals=1)
    return dataclasses.replace(EvalConfig(train=train, seeds=2, fidelity_prompts=2), **overrides)


def auto_risk_budget(trace: Trace, config: EvalConfig) -> float:
    """An error budget that binds on the tiny policy: half of what int8 on every
    unit in every bucket would cost over GRPO's default exposure mix.

    At the solver's default (cos >= 0.999) the tiny policy's codecs are far too
    accurate for the budget to bind, and every bucket would get one plan. Half
    of int8-everywhere forces a choice: int8 fits where the coefficient mass
    is small and not everywhere. The equivalent cosine is reported.
    """
    from ..solver import bucket_shares, default_buckets, default_exposure_mix
    from ..solver.fixed import uniform_codec
    from ..solver.memory import cost_model
    from ..solver.risk import plan_risk

    model = cost_model(trace, batch=config.microbatch, seq_len=config.task.seq_len, codecs=arms_mod.CODECS)
    decide = uniform_codec("int8")
    decisions = {u.key: decide(u) for u in model.units}
    mix = default_exposure_mix()
    shares = bucket_shares(default_buckets(config.buckets, mix), mix)
    return 0.5 * sum(plan_risk(model, decisions, s.error) for s in shares)


def resolve_plan(trace: Trace, budget: str, risk: float, buckets: int) -> tuple[Plan, dict[str, Any]]:
    """The plan at ``budget``, or at the smallest feasible budget if it is infeasible."""
    from ..solver import InfeasibleBudgetError

    info: dict[str, Any] = {"requested": budget, "risk_budget": risk}
    try:
        plan = arms_mod.solve_plan(trace, budget, risk_budget=risk, buckets=buckets)
        info["feasible"] = True
    except InfeasibleBudgetError as e:
        info.update(feasible=False, reason=str(e), min_budget_bytes=e.min_budget_bytes)
        plan = arms_mod.solve_plan(trace, str(e.min_budget_bytes), risk_budget=risk, buckets=buckets)
    info.update(solved_budget=plan.budget, budget_bytes=plan.budget_bytes, gc_bytes=plan.gc_bytes,
                store_bytes=plan.store_bytes, budget_x_gc=plan.budget_bytes / max(plan.gc_bytes, 1),
                buckets={b.bucket.name: {"memory_bytes": b.memory_bytes, "risk": b.risk,
                                         "options": arms_mod.option_counts(b),
                                         "decisions": dict(b.decisions)}
                         for b in plan.buckets if not b.skip})
    return plan, info


def _distinct(plan: Plan) -> int:
    """How many different plans the nonzero buckets have."""
    return len({b.decisions for b in plan.buckets if not b.skip})


def trained_arm(plans: dict[str, Plan]) -> str:
    """The hilore arm that trains: the tight one, unless its buckets collapsed to
    one plan (at the smallest feasible budget only the top bucket's plan fits)
    and the planned budget's differ: exposure conditioning must be in the run."""
    if _distinct(plans["hilore-tight"]) == 1 and "hilore-planned" in plans \
            and _distinct(plans["hilore-planned"]) > 1:
        return "hilore-planned"
    return "hilore-tight"


def build_arms(trace: Trace, config: EvalConfig, say: Progress) -> tuple[dict[str, arms_mod.Arm], dict[str, Any]]:
    """Solve the plans and compile one arm per distinct plan; returns arms and plan info."""
    from ..solver import parse_risk_budget

    risk = auto_risk_budget(trace, config) if config.risk_budget is None else parse_risk_budget(config.risk_budget)
    planned, planned_info = resolve_plan(trace, config.planned_budget, risk, config.buckets)
    tight, tight_info = resolve_plan(trace, config.tight_budget, risk, config.buckets)
    for info in (planned_info, tight_info):
        say(f"budget {info['requested']}: " + ("feasible" if info["feasible"] else
            f"infeasible, using the smallest feasible ({info['budget_x_gc']:.3f}x-gc)"))
    plans = {"hilore-tight": tight}
    if planned.budget_bytes != tight.budget_bytes:
        plans["hilore-planned"] = planned
    trained = trained_arm(plans)
    plans["hilore-blind"] = arms_mod.blind_plan(trace, plans[trained].budget, risk_budget=risk,
                                                buckets=config.buckets)
    plans["blind-int8"] = arms_mod.uniform_plan(trace, tight, "int8", "blind-int8")
    plans["store-all"] = arms_mod.uniform_plan(trace, tight, None, "store-all")
    arms, compile_s = {}, {}
    for name, plan in plans.items():
        policy = build_model(config.model, seed=config.fidelity_seed)
        arms[name] = arms_mod.compiled_arm(name, policy, plan, config.cache_dir)
        start = time.perf_counter()
        arms_mod.warm_up(arms[name], config.microbatch, config.task.seq_len)
        compile_s[name] = time.perf_counter() - start
        say(f"compiled {name} ({len(arms[name].backend.graphs[0].variants)} variants) "
            f"in {compile_s[name]:.0f} s")
    probes = [resolve_plan(trace, b, risk, config.buckets)[1] for b in config.probe_budgets]
    info = {"planned": planned_info, "tight": tight_info, "probes": probes, "risk_budget": risk,
            "risk_budget_source": "auto" if config.risk_budget is None else "given",
            "compile_seconds": compile_s,
            "control_memory_bytes": plans["blind-int8"].buckets[-1].memory_bytes,
            "blind_memory_bytes": plans["hilore-blind"].buckets[-1].memory_bytes,
            "trained": trained, "buckets_differ": _distinct(plans[trained]) > 1,
            "predicted_error": {n: math.sqrt(sum(b.risk for b in p.buckets if not b.skip))
                                for n, p in plans.items()},
            "arm_budgets": {n: p.budget for n, p in plans.items()}}
    return arms, info


def machine() -> dict[str, Any]:
    """Where the numbers were measured."""
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__}


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` torch CPU threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_evaluation(config: EvalConfig, say: Progress) -> dict[str, Any]:
    """Run the whole evaluation (module docstring) and return the results payload."""
    with torch_threads(config.threads):
        return _run(config, say)


def _run(config: EvalConfig, say: Progress) -> dict[str, Any]:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    grpo = GRPOConfig()
    update = UpdateConfig(microbatch_size=config.microbatch, n_buckets=config.buckets)
    say(f"tracing {config.model} at batch {config.microbatch}, sequence {config.task.seq_len}")
    trace = arms_mod.trace_policy(build_model(config.model, seed=0), config.microbatch,
                                  config.task.seq_len, config.cost_model)
    timings["trace_s"] = time.perf_counter() - start
    compiled, plan_info = build_arms(trace, config, say)
    timings["compile_s"] = sum(plan_info["compile_seconds"].values())

    t = time.perf_counter()
    exact = arms_mod.exact_arm(build_model(config.model, seed=config.fidelity_seed))
    state = build_model(config.model, seed=config.fidelity_seed).state_dict()
    setup = FidelitySetup(task=config.task, grpo=grpo, update=update, prompts=config.fidelity_prompts,
                          group_size=config.train.group_size, seed=config.fidelity_seed)
    fidelity = []
    for name, arm in compiled.items():
        rows = arm_fidelity(arm, exact, state, setup, plan_info["arm_budgets"][name])
        fidelity += rows
        say(f"fidelity {name}: " + ", ".join(f"{r.bucket} rel_l2 {r.rel_l2:.2e}" for r in rows))
    timings["fidelity_s"] = time.perf_counter() - t

    t = time.perf_counter()
    tight = compiled[plan_info["trained"]]
    batch_size = config.train.prompts_per_step * config.train.group_size
    run_setup = RunSetup(task=config.task, train=config.train, grpo=grpo, update=update,
                         buckets=plan_buckets(tight.plan, batch_size), model=config.model)
    arms = [exact, tight, compiled["hilore-blind"]]
    runs = train_paired(arms, list(range(config.seeds)), run_setup, say)
    timings["training_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - start
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": dataclasses.asdict(config),
        "machine": machine(),
        "trace": {"units": len(trace.units), "batch": trace.batch, "seq_len": trace.seq_len,
                  "fingerprint": trace.fingerprint, "cost_source": trace.cost_source},
        "plans": plan_info,
        "fidelity": [dataclasses.asdict(r) for r in fidelity],
        "training": training_summary(runs),
        "runs": [dataclasses.asdict(r) for r in runs],
        "timings": timings,
    }
