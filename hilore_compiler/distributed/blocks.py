"""Per-block compile: torchtitan's ``apply_compile`` with the hilore backend.

FSDP2 puts its all-gather and reduce-scatter hooks around each decoder block,
so a whole-model ``torch.compile`` is cut into graphs at every block boundary.
The usual recipe (torchtitan, verl) compiles each block on its own instead;
``compile_blocks`` does that, before ``fully_shard`` wraps the blocks, so the
collectives run eagerly between compiled blocks and never inside them.

Budget: the whole step's, shared out across blocks by the solver. A budget
relative to GC means nothing for one block alone: GC keeps a layer's input
and pays one layer's recompute transient once per step, so one block's GC
reference (its input plus its whole recompute transient) is above its
store-all bytes, and ``1.10x-gc`` of it would store everything. So the plan
is made for the whole step (``plan_sync.solve_step_plan``: the unsharded model
traced at the microbatch shape and solved at ``1.10x-gc`` of the whole step,
one decision per unit of every layer), and block i applies layer i's
decisions (``layer_plan``). Blocks whose decisions agree share one backend
object, hence one dynamo graph and one set of bucket variants.

Without a step plan every block graph plans for itself (zero config) and the
budget then refers to that block graph alone; an absolute budget is first
divided evenly over the blocks (``block_budget``).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..planfile import Plan
from ..solver.budget import parse_budget

#: The backend's own default budget (``BackendOptions.memory_budget``).
DEFAULT_BUDGET = "1.10x-gc"


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder blocks: ``model.layers`` (built-in and Hugging Face layout)."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    raise ValueError(f"{type(model).__name__} has no non-empty nn.ModuleList 'layers' of decoder blocks")


def block_budget(budget: str, n_blocks: int) -> str:
    """One block's share of a whole-model budget: relative ones unchanged, bytes split evenly."""
    parsed = parse_budget(budget)
    if parsed.reference != "bytes":
        return parsed.text
    return str(int(parsed.value // n_blocks))


def block_options(options: Mapping[str, Any] | None, n_blocks: int) -> dict[str, Any]:
    """The hilore options each block's compile gets (see the module docstring for the budget)."""
    out = dict(options or {})
    out["memory_budget"] = block_budget(str(out.get("memory_budget", DEFAULT_BUDGET)), n_blocks)
    return out


def layer_plan(plan: Plan, layer: int) -> Plan:
    """Layer ``layer``'s part of a whole-step plan, keyed as its block's own graph keys them.

    Whole-model keys read ``layers.<i>.self_attn.q_proj:view:0`` (and
    ``layers.<i>:add:0`` for the block's own ops); a block compiled on its own
    names the same unit ``self_attn.q_proj:view:0`` (``:add:0``).
    """
    prefix = f"layers.{layer}"

    def local(key: str) -> str | None:
        if not key.startswith(prefix) or key[len(prefix):len(prefix) + 1] not in (".", ":"):
            return None
        return key[len(prefix) + (key[len(prefix)] == "."):]

    units = tuple(dataclasses.replace(u, key=local(u.key), layer=0) for u in plan.units if local(u.key))
    buckets = tuple(dataclasses.replace(b, decisions=tuple((local(k), o) for k, o in b.decisions if local(k)))
                    for b in plan.buckets)
    return dataclasses.replace(plan, units=units, buckets=buckets,
                               notes=(*plan.notes, f"layer {layer} of a whole-step plan"))


def _block_compilers(plan: Plan | None, options: dict[str, Any], n_blocks: int) -> list[Any]:
    """One hilore backend per block; blocks with identical decisions share one."""
    from ..backend import HiLoReBackend

    if plan is None:  # zero config: one backend, every block graph plans for itself
        return [HiLoReBackend(block_options(options, n_blocks))] * n_blocks
    shared: dict[str, Any] = {}
    out = []
    for i in range(n_blocks):
        mine = layer_plan(plan, i)
        key = json.dumps([b.decisions for b in mine.buckets])
        if key not in shared:
            shared[key] = HiLoReBackend({**options, "plan": mine})
        out.append(shared[key])
    return out


def _check_recompile_limit(graphs: int) -> None:
    """Warn when the blocks need more dynamo graphs than dynamo keeps per code object.

    Every block runs the same ``forward`` code, and dynamo caches at most
    ``recompile_limit`` graphs for one code object; blocks past it would run
    eagerly. The limit is the user's global setting, so it is named, not changed.
    """
    import torch._dynamo.config as dynamo_config

    if graphs > dynamo_config.recompile_limit:
        warnings.warn(
            f"hilore: the plan gives the blocks {graphs} distinct decision sets (one dynamo graph "
            f"each) but torch._dynamo.config.recompile_limit is {dynamo_config.recompile_limit}: "
            "blocks beyond it run eagerly; raise the limit to at least the number of blocks",
            stacklevel=3)


def compile_blocks(model: nn.Module, options: Mapping[str, Any] | None = None, *,
                   backend: str = "hilore", dynamic: bool | None = False, fullgraph: bool = True,
                   in_place: bool = False) -> list[Any]:
    """Compile every decoder block of ``model`` on its own, in place; returns each block's backend.

    Each ``model.layers[i]`` is replaced by ``torch.compile(block, ...)``, as
    torchtitan's ``apply_compile`` does; call it before ``fully_shard`` so
    FSDP2's hooks wrap the compiled blocks (parameter names gain an
    ``_orig_mod.`` part, as they do in torchtitan). With ``backend="hilore"``
    and a whole-step plan in ``options["plan"]`` (``plan_sync``), block i runs
    layer i's decisions; without one, each block graph plans for itself (see
    the module docstring). The returned backends keep what they compiled
    (``.graphs``). Another backend name is passed to ``torch.compile`` with
    ``options``. Under ``runtime.exposure(bucket)`` every block runs that
    bucket's variant.

    ``in_place=True`` calls ``block.compile(...)`` instead of wrapping: the
    block keeps its class and its state-dict keys, which frameworks that pick
    the blocks to shard by class name (verl's ``apply_fsdp2``) need; FSDP2's
    hooks then run eagerly around the compiled call, as they do around a
    wrapper.
    """
    blocks = decoder_blocks(model)
    options = dict(options or {})
    if backend == "hilore":
        plan = options.pop("plan", None)
        if plan is not None and not isinstance(plan, Plan):
            from ..planload import load_plan

            plan = load_plan(plan)
        compilers, kwargs = _block_compilers(plan, options, len(blocks)), {}
        _check_recompile_limit(len({id(c) for c in compilers}))
    else:
        compilers, kwargs = [backend] * len(blocks), ({"options": options} if options else {})
    for i, block in enumerate(blocks):
        # Blocks sharing a compiler object share dynamo's cache entry for their
        # common forward code: identical blocks reuse one graph.
        if in_place:
            block.compile(backend=compilers[i], dynamic=dynamic, fullgraph=fullgraph, **kwargs)
        else:
            blocks[i] = torch.compile(block, backend=compilers[i], dynamic=dynamic, fullgraph=fullgraph,
                                      **kwargs)
    return compilers


def fsdp_weight_bytes(model: nn.Module, world: int) -> dict[str, int]:
    """Weight bytes one rank holds under ``shard_blocks`` (unsharded ``model``, ``world`` ranks).

    - ``sharded``: every parameter's 1/world share, held all the time;
    - ``gathered_block``: the largest block unsharded, held while it runs
      forward and again while it runs backward (FSDP2 all-gathers it before
      each; with prefetching the next block's too);
    - ``root``: the root's own parameters (embedding, norm, head) unsharded,
      kept from forward to backward (the root does not reshard after forward).

    None of these depends on the plan: recompute in a block's backward runs
    while that block's weights are gathered anyway (the input gradient of a
    matmul needs its weight), so the plan budgets activations only.
    """
    def nbytes(module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    blocks = decoder_blocks(model)
    total = nbytes(model)
    in_blocks = sum(nbytes(b) for b in blocks)
    return {"sharded": -(-total // world), "gathered_block": max(nbytes(b) for b in blocks),
            "root": total - in_blocks}


def shard_blocks(model: nn.Module, mesh: Any = None, **fsdp_kwargs: Any) -> nn.Module:
    """``fully_shard`` each decoder block, then the root (embedding, norm, head), as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model
