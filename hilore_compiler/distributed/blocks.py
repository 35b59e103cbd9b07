"""Per-block compile: torchtitan's ``apply_compile`` with the hilore backend.

FSDP2 puts its all-gather and reduce-scatter hooks around each decoder block,
so a whole-model ``torch.compile`` is cut into graphs at every block boundary.
The usual recipe (torchtitan, verl) compiles each block on its own instead;
``compile_blocks`` does that, before ``fully_shard`` wraps the blocks, so the
collectives run eagerly between compiled blocks and never inside them.

Budget: stated per block. Every block's graph is planned against its own
references (what GC and store-all keep for that block), with the options'
budget applied to it. Why, rather than sharing one whole-model budget out:

- the blocks are identical, so dynamo makes one graph for all of them (one
  backend object is shared, parameters are graph inputs): one plan and one
  set of bucket variants serve every block, and there is nothing to split;
- a relative budget is additive: the sum over blocks of ``1.10 x GC(block)``
  is ``1.10 x`` the sum of the blocks' GC bytes, i.e. the whole-model
  ``1.10x-gc`` budget less the embedding, final norm and LM head, which run
  eagerly outside the blocks and keep the same bytes under every method;
- under FSDP2 the blocks run one after another, so a per-block bound is the
  one peak memory feels.

An absolute budget (``"6GiB"``) is meant for the whole model: it is divided
evenly over the blocks (``block_budget``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

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


def compile_blocks(model: nn.Module, options: Mapping[str, Any] | None = None, *,
                   backend: str = "hilore", dynamic: bool = False, fullgraph: bool = True) -> Any:
    """Compile every decoder block of ``model`` on its own, in place; returns the backend used.

    Each ``model.layers[i]`` is replaced by ``torch.compile(block, ...)``, as
    torchtitan's ``apply_compile`` does; call it before ``fully_shard`` so
    FSDP2's hooks wrap the compiled blocks (parameter names gain an
    ``_orig_mod.`` part, as they do in torchtitan). With ``backend="hilore"``
    one ``HiLoReBackend`` made from ``block_options(options)`` is shared by
    all blocks (inspect its ``.graphs``: the plan, variants, partitions);
    another backend name is passed to ``torch.compile`` with ``options``.
    Under ``runtime.exposure(bucket)`` every block runs that bucket's variant.
    """
    blocks = decoder_blocks(model)
    if backend == "hilore":
        from ..backend import HiLoReBackend

        compiler: Any = HiLoReBackend(block_options(options, len(blocks)))
        kwargs: dict[str, Any] = {}
    else:
        compiler, kwargs = backend, ({"options": dict(options)} if options else {})
    for i, block in enumerate(blocks):
        # One compiler object for every block: dynamo's cache entry for the
        # shared forward code then matches, and identical blocks reuse one graph.
        blocks[i] = torch.compile(block, backend=compiler, dynamic=dynamic, fullgraph=fullgraph,
                                  **kwargs)
    return compiler


def shard_blocks(model: nn.Module, mesh: Any = None, **fsdp_kwargs: Any) -> nn.Module:
    """``fully_shard`` each decoder block, then the root (embedding, norm, head), as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model
