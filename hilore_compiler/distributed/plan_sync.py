"""One plan on every rank: rank 0 solves it, the others receive it.

Plans are solved from measured timings, so two ranks that each solved their
own could disagree. Instead rank 0 traces the whole unsharded model at the
microbatch shape, solves one whole-step plan (the budget shared out across
layers by the ILP, see ``blocks``) and broadcasts its JSON; every rank then
compiles its blocks with it (``compile_blocks(model, {"plan": plan})``).
``check_same_plan`` all-gathers the plan's digest, which makes "identical on
every rank" a checked fact, not an assumption; the backend's matching of a
plan to a graph is deterministic, so identical plans on identical block
graphs give identical decisions.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..planfile import Plan
from ..planload import plan_from_json
from ..tracefile import Trace


def plan_digest(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON."""
    return hashlib.sha256(json.dumps(plan.to_json(), sort_keys=True).encode()).hexdigest()


def broadcast_plan(plan: Plan | None, src: int = 0) -> Plan:
    """``plan`` from rank ``src`` on every rank (the others pass None)."""
    box = [json.dumps(plan.to_json()) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return plan_from_json(json.loads(box[0]), where=f"plan broadcast from rank {src}")


def check_same_plan(plan: Plan) -> str:
    """The plan's digest, after checking that every rank holds the same one."""
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, plan_digest(plan))
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks hold different plans: digests {digests}")
    return digests[0]


def trace_step(model: nn.Module, input_ids: torch.Tensor, codecs: tuple[str, ...]) -> Trace:
    """Trace and profile the whole unsharded ``model`` at ``input_ids``' (microbatch) shape."""
    from ..passes.tracer import TraceConfig, trace

    config = TraceConfig(codecs=codecs, verbose=False, model_name=type(model).__name__)
    return trace(copy.deepcopy(model), [input_ids], config=config)


def solve_step_plan(model: nn.Module, input_ids: torch.Tensor,
                    options: Mapping[str, Any] | None = None) -> Plan:
    """A whole-step plan for the unsharded ``model`` at ``input_ids``' (microbatch) shape.

    Traces the whole model (not one block: a block alone has no meaningful
    GC reference, see ``blocks``) and solves it with the options' budget,
    risk budget, buckets and codecs.
    """
    from ..solver import solve

    options = dict(options or {})
    codecs = tuple(options.get("codecs", ("bf16", "int8")))
    traced = trace_step(model, input_ids, codecs)
    kwargs = {} if options.get("risk_budget") is None else {"risk_budget": options["risk_budget"]}
    batch, seq_len = input_ids.shape
    return solve(traced, budget=options.get("memory_budget", "1.10x-gc"), buckets=options.get("buckets", 3),
                 codecs=list(codecs), batch=int(batch), seq_len=int(seq_len), **kwargs)


MakePlan = Callable[[nn.Module, torch.Tensor, Mapping[str, Any]], Plan]


def shared_step_plan(model: nn.Module, input_ids: torch.Tensor,
                     options: Mapping[str, Any] | None = None, *,
                     make: MakePlan = solve_step_plan) -> Plan:
    """Rank 0 makes the plan (``make``, by default ``solve_step_plan``); every rank returns it (checked)."""
    plan = make(model, input_ids, dict(options or {})) if dist.get_rank() == 0 else None
    plan = broadcast_plan(plan)
    check_same_plan(plan)
    return plan
