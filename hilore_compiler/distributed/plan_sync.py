"""One plan on every rank: rank 0 solves it, the others receive it.

Plans are solved from measured timings, so two ranks that each solved their
own could disagree. Instead rank 0 plans one decoder block (before sharding,
on its own inputs) and broadcasts the plan's JSON; every rank then compiles
its blocks with ``options={"plan": plan, "strict": True}``, so the backend
applies exactly that plan or raises (no silent fallback to Inductor's own
choice on one rank only). ``check_same_plan`` all-gathers the plan's digest,
which makes "identical on every rank" a checked fact, not an assumption.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..planfile import Plan, plan_from_json
from .blocks import block_options, decoder_blocks


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


def block_inputs(model: nn.Module, input_ids: torch.Tensor) -> tuple[Any, ...]:
    """What the first decoder block receives when ``model`` runs ``input_ids`` (eager, no grad)."""
    seen: list[tuple[Any, ...]] = []
    hook = decoder_blocks(model)[0].register_forward_pre_hook(lambda _m, args: seen.append(args))
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        hook.remove()
    return tuple(a.detach().clone().requires_grad_(a.is_floating_point() and i == 0)
                 if isinstance(a, torch.Tensor) else a for i, a in enumerate(seen[0]))


def solve_block_plan(model: nn.Module, input_ids: torch.Tensor,
                     options: Mapping[str, Any] | None = None) -> Plan:
    """A plan for one decoder block of the (unsharded) ``model`` at ``input_ids``' shape.

    Compiles a copy of block 0 with the hilore backend (zero config: trace,
    profile, solve) on the inputs the block sees, and returns that plan.
    """
    from ..backend import HiLoReBackend

    blocks = decoder_blocks(model)
    backend = HiLoReBackend(block_options(options, len(blocks)))
    block = torch.compile(copy.deepcopy(blocks[0]), backend=backend, dynamic=False)
    block(*block_inputs(model, input_ids))
    if not backend.graphs:
        raise RuntimeError("the hilore backend made no graph of the decoder block")
    return backend.graphs[0].plan


def shared_block_plan(model: nn.Module, input_ids: torch.Tensor,
                      options: Mapping[str, Any] | None = None) -> Plan:
    """Rank 0 solves ``solve_block_plan``, every rank returns the same plan (checked)."""
    plan = solve_block_plan(model, input_ids, options) if dist.get_rank() == 0 else None
    plan = broadcast_plan(plan)
    check_same_plan(plan)
    return plan
