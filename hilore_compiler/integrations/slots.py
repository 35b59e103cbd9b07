"""Micro-batch slots of one data-parallel update: bucket order and the zero skip.

A framework that cuts each rank's batch into micro-batches itself (verl's
``prepare_micro_batches``) leaves two decisions: in which order the
micro-batches run, and which of them need no forward or backward at all.
No framework import here, so it is testable on its own.

- ``microbatch_bucket``: a micro-batch runs under the bucket of its most
  exposed sample (a lossier variant never sees a sample it was not planned for).
- ``schedule_slots``: least exposed first (a stable sort, so equal buckets keep
  the framework's order), and which slots are skipped: a slot is skipped only
  where its micro-batch has zero exposure on every data-parallel rank (one
  all_reduce MIN of a per-slot flag), so every rank runs the same number of
  forward and backward passes and FSDP's collectives pair up. The last slot is
  never skipped: it synchronises gradients across ranks and makes sure every
  parameter has a gradient before the optimizer step (an optimizer that sees no
  gradient at all skips the parameter, where a zero gradient would still decay
  Adam's moments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..vocabulary import ZERO_BUCKET


@dataclass(frozen=True, slots=True)
class SlotSchedule:
    """Which micro-batch runs in which slot, and which slots every rank skips."""

    #: Slot k holds micro-batch ``order[k]`` (indices into the framework's list).
    order: tuple[int, ...]
    #: Per slot: skipped by every rank (zero exposure everywhere, not the last slot).
    skip: tuple[bool, ...]

    @property
    def run(self) -> tuple[int, ...]:
        """Micro-batch indices that run, in the order they run."""
        return tuple(i for i, s in zip(self.order, self.skip) if not s)

    @property
    def skipped(self) -> tuple[int, ...]:
        """Micro-batch indices that neither forward nor backward."""
        return tuple(i for i, s in zip(self.order, self.skip) if s)


def microbatch_bucket(names: Sequence[str], bucket_order: Sequence[str]) -> str:
    """The bucket of a micro-batch whose samples fall in ``names``: the most exposed one's."""
    if not names:
        raise ValueError("a micro-batch without samples has no bucket")
    rank = {name: i for i, name in enumerate(bucket_order)}
    return max(names, key=rank.__getitem__)


def schedule_slots(
    buckets: Sequence[str],
    bucket_order: Sequence[str],
    *,
    sort: bool = True,
    skip_zero: bool = True,
    group: Any = None,
    device: torch.device | str = "cpu",
) -> SlotSchedule:
    """Order this rank's micro-batches (``buckets``: one name each) and agree on skipped slots.

    ``sort``: least exposed first, ties in the given order; False keeps the
    given order. ``skip_zero``: skip slots whose micro-batch is ``"zero"``
    on every rank of ``group`` (the default group when None; no collective
    without torch.distributed). Every rank must pass the same number of
    micro-batches (verl: ``same_micro_num_in_dp=True``) and the same flags.
    ``device``: where the flag tensor lives for the collective (CPU for gloo).
    """
    if not buckets:
        raise ValueError("schedule_slots needs at least one micro-batch")
    rank = {name: i for i, name in enumerate(bucket_order)}
    order = sorted(range(len(buckets)), key=lambda i: (rank[buckets[i]], i)) if sort else list(range(len(buckets)))
    zero = [buckets[i] == ZERO_BUCKET for i in order]
    skip = on_every_rank(zero, group, device) if skip_zero else [False] * len(order)
    skip[-1] = False  # the gradient-synchronising slot: see the module docstring
    return SlotSchedule(order=tuple(order), skip=tuple(skip))


def on_every_rank(flags: Sequence[bool], group: Any = None, device: torch.device | str = "cpu") -> list[bool]:
    """Per position: whether ``flags`` holds there on every rank of ``group`` (all_reduce MIN)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in t.tolist()]


def most_on_any_rank(count: int, group: Any = None, device: torch.device | str = "cpu") -> int:
    """The largest ``count`` over the ranks of ``group`` (all_reduce MAX): the micro-batches every rank runs."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return count
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
