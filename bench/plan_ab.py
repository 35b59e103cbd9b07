"""Time `small` under several hilore plan files in one process, alternating, to compare plans.

    python bench/plan_ab.py ROUNDS A.plan.json B.plan.json [C.plan.json ...]

A plan may instead be ``inductor-fp8:SIZE_MB``: plain Inductor with its fp8 saved activations
(the bench's ``inductor-fp8`` at that ``size_in_mb``), to compare a plan with that peer in one
process.

Every plan compiles its own copy of the policy (same weights, same batch: fp32, batch 2, 2048
tokens, one thread); each round runs two steps of each, in forward then reversed order. One
process for all removes the bench's per-worker differences but keeps the allocator's placement
of each copy's buffers (docs/benchmarks.md, "Why the intervals are wide"): run it under a fixed
heap (MALLOC_MMAP_THRESHOLD_ etc.) as well before reading a few percent into it.
"""

import statistics
import sys
import time

import torch

from hilore_compiler.bench.peers import INDUCTOR_FP8, compile_context
from hilore_compiler.bench.worker import actor_step, make_data
from hilore_compiler.grpo import GRPOConfig
from hilore_compiler.models import build_model


def main(rounds: int, plans: list[str]) -> None:
    torch.set_num_threads(1)
    config, runs = GRPOConfig(), []
    for plan in plans:
        model = build_model("small", seed=0)
        data = make_data(model.config.vocab_size, 2, 2048, 0, torch.device("cpu"))
        began = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if plan.startswith(INDUCTOR_FP8 + ":"):
            policy = torch.compile(model)
            with compile_context(INDUCTOR_FP8, float(plan.split(":", 1)[1]), torch.device("cpu"))():
                actor_step(policy, data, config)  # compiles under the fp8 pass
        else:
            policy = torch.compile(model, backend="hilore", options={"plan": plan})
            actor_step(policy, data, config)
        print(f"{plan}: first step {time.perf_counter() - began:.1f} s", flush=True)
        runs.append((plan, model, policy, data))
    seconds: dict[str, list[float]] = {plan: [] for plan in plans}
    for r in range(rounds):
        for plan, model, policy, data in runs if r % 2 == 0 else runs[::-1]:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                began = time.perf_counter()
                actor_step(policy, data, config)
                seconds[plan].append(time.perf_counter() - began)
    first = statistics.median(seconds[plans[0]])
    for plan in plans:
        median = statistics.median(seconds[plan])
        print(f"{plan}: median {median:.3f} s/step, {median / first:.3f} x the first plan's")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
