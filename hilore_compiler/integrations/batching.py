"""Fixed shapes and exposure-ordered microbatches for a TRL generation batch.

Pure tensor code over TRL's batch dict (``prompt_ids``, ``completion_ids``,
masks, ``advantages``, per-token log-probs, ``num_items_in_batch``); no trl
import, so it is testable on its own.

- ``pad_batch``: pad prompts on the left and completions on the right to a
  multiple of ``pad_to_multiple_of``, so that dynamo sees few shapes and the
  backend's plans are reused. Padding carries mask 0: it adds no loss term.
- ``equal_slots`` / ``dropped_slots``: the ``steps_per_generation``
  microbatches of one optimizer step, cut by ``grpo.packing.drop_then_pack``
  (the rule ``actor_update`` and verl's engine use too) with TRL's budget of
  ``per_device_train_batch_size`` samples: equal ones for losses normalised
  per microbatch row, zero samples dropped for ``dapo``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..grpo.packing import Packing, drop_then_pack
from ..vocabulary import ZERO_BUCKET

#: Keys of per-completion-token tensors, (B, Tc): padded on the right.
COMPLETION_KEYS = (
    "completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
    "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask",
)
#: Keys of per-prompt-token tensors, (B, Tp): padded on the left (TRL's side).
PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad(x: Tensor, extra: int, value: float, left: bool) -> Tensor:
    """Pad the last dimension of (B, T) ``x`` by ``extra`` columns of ``value``."""
    pad = x.new_full((x.shape[0], extra), value)
    return torch.cat([pad, x] if left else [x, pad], dim=1)


def pad_batch(batch: Mapping[str, Any], pad_token_id: int, multiple: int) -> dict[str, Any]:
    """``batch`` with prompt and completion lengths rounded up to ``multiple``.

    Prompt padding goes on the left, as TRL pads prompts: with rotary position
    embeddings attention depends only on relative positions, so shifting a
    prompt right changes its log-probs by rounding only. Completion padding
    goes on the right, after every real token, so it changes nothing that a
    causal model computes for them.
    """
    out = dict(batch)
    for keys, left in ((PROMPT_KEYS, True), (COMPLETION_KEYS, False)):
        present = [k for k in keys if isinstance(out.get(k), Tensor) and out[k].dim() == 2]
        if not present:
            continue
        length = out[present[0]].shape[1]
        extra = _round_up(length, multiple) - length
        if extra == 0:
            continue
        for k in present:
            value = pad_token_id if k.endswith("_ids") else (1.0 if k == "importance_sampling_ratio" else 0)
            out[k] = _pad(out[k], extra, value, left)
    return out


@dataclass(frozen=True, slots=True)
class Slot:
    """One of the microbatches TRL runs per optimizer step (``steps_per_generation`` of them)."""

    #: Rows of the generation batch it holds, in run order.
    rows: tuple[int, ...]
    #: Bucket it runs under: that of its most exposed sample.
    bucket: str
    #: Every sample has zero exposure: forward and backward may be skipped.
    all_zero: bool
    #: Samples of the generation batch that no slot runs (dropped), counted on this slot.
    left_out: int = 0


def equal_slots(names: Sequence[str], exposures: Tensor, bucket_order: Sequence[str], n: int, *,
                sort: bool = True) -> list[Slot]:
    """The batch cut into ``n`` equal microbatches, least exposed first (``sort``) or in its order.

    For losses normalised per microbatch row count (``grpo``, ``dr_grpo``,
    ``bnpo``): nothing is dropped, an all-zero microbatch is skipped whole.
    Sorted, this is ``drop_then_pack`` keeping the zero bucket with a budget
    of B / n samples, whose fewest cut is ``n`` full microbatches.
    """
    b = len(names)
    if b % n:
        raise ValueError(f"{b} samples do not split into {n} equal microbatches")
    size = b // n
    x = exposures.detach().to("cpu", torch.float64).tolist()
    if sort:
        packed = drop_then_pack(names, x, bucket_order, budget=size, drop=False)
        chunks, buckets = packed.microbatches, packed.buckets
    else:
        rank = {name: i for i, name in enumerate(bucket_order)}
        chunks = tuple(tuple(range(k, k + size)) for k in range(0, b, size))
        buckets = tuple(max((names[i] for i in c), key=rank.__getitem__) for c in chunks)
    return [Slot(c, bk, all(x[i] == 0.0 for i in c)) for c, bk in zip(chunks, buckets)]


def dropped_slots(packing: Packing, n: int, runs: int) -> list[Slot]:
    """``n`` slots around a packing whose zero samples were dropped; ``runs`` slots run.

    ``runs``: micro-batches the busiest rank runs (every rank runs as many,
    so they skip the same slots). Skipped slots come first, then runs of one
    dropped sample each where this rank has fewer micro-batches (they add
    exactly 0), then the packing, least exposed first: the last slot, which
    synchronises gradients, holds the most exposed samples.
    """
    if not 1 <= runs <= n or len(packing.microbatches) > runs:
        raise ValueError(f"{len(packing.microbatches)} micro-batches do not fit {runs} runs of {n} slots")
    pads = runs - len(packing.microbatches)
    if pads > len(packing.dropped):
        raise ValueError(f"{pads} padding runs need as many dropped samples, found {len(packing.dropped)}")
    skipped = [Slot((), ZERO_BUCKET, True) for _ in range(n - runs)]
    padding = [Slot((i,), ZERO_BUCKET, True) for i in packing.dropped[:pads]]
    real = [Slot(rows, b, False) for rows, b in zip(packing.microbatches, packing.buckets)]
    slots = skipped + padding + real
    last = slots[-1]
    slots[-1] = Slot(last.rows, last.bucket, last.all_zero, len(packing.dropped) - pads)
    return slots


def take_rows(batch: Mapping[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """Every per-sample value of ``batch`` at ``rows``; scalars and None as they are."""
    index = torch.tensor(list(rows), dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 1:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in rows]
        else:
            out[key] = value
    return out
