"""Past one device: hilore under FSDP2 (``fully_shard``) with per-block compile.

Modules, in the order a distributed run meets them:

- ``launch``    ``spawn``: several processes, one process group (tests, bench).
- ``blocks``    ``compile_blocks``: each decoder block compiled on its own with
                the hilore backend (budget stated per block), ``shard_blocks``.
- ``plan_sync`` one whole-step plan on every rank: rank 0 solves, broadcasts, digests checked.
- ``plan_share`` zero-config graphs: rank 0 plans each, the others read its plans
                from the process group's store (no collective inside a compile).
- ``ranks``     what the ranks of ``grpo.actor_update`` agree on: normalisers,
                buckets, microbatch slots (zero-contribution padding).

Names load on first use, so ``grpo`` can import ``ranks`` without the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "spawn": "launch", "RankFailed": "launch",
    "compile_blocks": "blocks", "shard_blocks": "blocks", "decoder_blocks": "blocks",
    "block_budget": "blocks",
    "shared_step_plan": "plan_sync", "solve_step_plan": "plan_sync", "layer_plan": "blocks",
    "broadcast_plan": "plan_sync", "check_same_plan": "plan_sync",
    "PAD": "ranks", "agree_slots": "ranks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hilore_compiler.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
