"""What the ranks of a data-parallel actor update agree on, outside compiled code.

Under FSDP2 every forward all-gathers weights and every backward
reduce-scatters gradients, so every rank must run the same number of
microbatch forward/backward passes, or the collectives pair up wrongly and
hang. Each rank still orders its own samples by bucket and picks its own
exposure bucket per microbatch (the compiled blocks hold no collective, so two
ranks may run different variants in the same slot). What they agree on:

- the loss normalisers: every rank divides by its share of the global totals
  (``global / world``), so FSDP's averaging reduce-scatter gives exactly the
  gradient of the whole batch's loss;
- the exposure buckets, made from every rank's estimates when not given;
- the microbatch slots: a slot runs if any rank has real work in it; a rank
  with nothing real there runs a zero-contribution microbatch (``PAD``), so
  the zero-bucket skip is taken only where every rank skips the same slot.

All collectives here are small all_reduce / all_gather calls on the batch's
device (CPU tensors for gloo, CUDA tensors for nccl).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

#: Bucket name of a zero-contribution microbatch: it runs forward and backward
#: so that the collectives match, with its loss multiplied by 0.
PAD = "pad"

Run = tuple[str, list[int]]


def world_size() -> int:
    """Ranks in the default process group; 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def _all_reduce(values: Sequence[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def sum_over_ranks(values: Sequence[float], device: torch.device) -> list[float]:
    """Elementwise sum of ``values`` over ranks."""
    return _all_reduce(values, dist.ReduceOp.SUM, device)


def gather_all(x: Tensor) -> Tensor:
    """(n_r,) per rank -> the concatenation over ranks in rank order (ranks may differ in n_r)."""
    parts: list[Tensor | None] = [None] * world_size()
    dist.all_gather_object(parts, x.detach().cpu())
    return torch.cat(parts).to(x.device)


def agree_slots(work: list[Run], zero: list[Run], device: torch.device) -> tuple[list[Run], int]:
    """Microbatch slots every rank runs in step; returns (slots, zero samples skipped here).

    ``work``: this rank's runs that need a backward, in bucket order;
    ``zero``: its zero-bucket runs, which may be skipped. Slot i is run
    when any rank has real work there (one all_reduce MAX of a per-slot
    flag); a rank without real work in it runs ``(PAD, rows)`` with one of
    its zero runs' rows if any is left (the skip is simply not taken) or a
    real run's rows (same shape, no recompile), contributing exactly 0.
    """
    local = work + zero
    if not local:
        raise ValueError("every rank needs at least one sample in the batch")
    n = int(_all_reduce([len(local)], dist.ReduceOp.MAX, device)[0])
    flags = [1.0 if i < len(work) else 0.0 for i in range(n)]  # 1: real work in slot i
    needed = _all_reduce(flags, dist.ReduceOp.MAX, device)
    slots: list[Run] = []
    for i, flag in enumerate(needed):
        if flag < 0.5:  # no rank has real work here: every rank skips this slot
            continue
        if i < len(work):
            slots.append(work[i])
        else:
            slots.append((PAD, local[i][1] if i < len(local) else local[0][1]))
    ran_zero = sum(len(rows) for i, (_, rows) in enumerate(zero) if needed[len(work) + i] >= 0.5)
    return slots, sum(len(rows) for _, rows in zero) - ran_zero
