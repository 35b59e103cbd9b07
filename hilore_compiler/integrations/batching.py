"""Fixed shapes and exposure-ordered microbatches for a TRL generation batch.

Pure tensor code over TRL's batch dict (``prompt_ids``, ``completion_ids``,
masks, ``advantages``, per-token log-probs, ``num_items_in_batch``); no trl
import, so it is testable on its own.

- ``pad_batch``: pad prompts on the left and completions on the right to a
  multiple of ``pad_to_multiple_of``, so that dynamo sees few shapes and the
  backend's plans are reused. Padding carries mask 0: it adds no loss term.
- ``order_by_bucket``: a permutation that puts the samples of one bucket
  next to each other, least exposed first, and the bucket and skip flag of
  each microbatch once the permuted batch is cut into equal parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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
class MicrobatchOrder:
    """How one generation batch is cut into exposure-ordered microbatches."""

    #: (B,) row order: permuted row i is original row ``permutation[i]``.
    permutation: Tensor
    #: Bucket each microbatch runs under: that of its most exposed sample.
    buckets: tuple[str, ...]
    #: Microbatches whose every sample has zero exposure.
    all_zero: tuple[bool, ...]


def order_by_bucket(
    names: Sequence[str],
    exposures: Tensor,
    bucket_order: Sequence[str],
    n_microbatches: int,
    *,
    sort: bool = True,
) -> MicrobatchOrder:
    """Sort rows by (bucket, exposure), least exposed first, and cut into ``n_microbatches``.

    Least exposed first puts the zero bucket at the start and the most exposed
    samples in the last microbatch, which is the one that synchronises
    gradients across ranks and is therefore never skipped. ``sort=False``
    keeps the rows where they are (TRL's shuffled order) and only reports
    each microbatch's bucket and whether it is all zero.
    """
    b = len(names)
    if b % n_microbatches:
        raise ValueError(f"{b} samples do not split into {n_microbatches} equal microbatches")
    rank = {name: i for i, name in enumerate(bucket_order)}
    x = exposures.detach().to("cpu", torch.float64).tolist()
    perm = sorted(range(b), key=lambda i: (rank[names[i]], x[i], i)) if sort else list(range(b))
    size = b // n_microbatches
    chunks = [perm[k : k + size] for k in range(0, b, size)]
    buckets = tuple(max((names[i] for i in c), key=rank.__getitem__) for c in chunks)
    all_zero = tuple(all(x[i] == 0.0 for i in c) for c in chunks)
    return MicrobatchOrder(torch.tensor(perm, dtype=torch.long), buckets, all_zero)


def permute_rows(batch: Mapping[str, Any], permutation: Tensor) -> dict[str, Any]:
    """Every per-sample value of ``batch`` in ``permutation`` order; scalars and None as they are."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 1:
            out[key] = value[permutation.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in permutation.tolist()]
        else:
            out[key] = value
    return out
