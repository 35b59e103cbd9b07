"""Drop, then pack: the one rule that cuts an update's samples into micro-batches.

Every trainer that hilore runs in (its own ``actor_update``, the TRL subclass,
verl's FSDP engine) cuts the same way, each with its own budget:

1. drop the zero-exposure samples where that is exact (all c_t = 0: their
   loss and gradient are exactly 0; the caller keeps them in its normalisers);
2. order the rest least exposed first (bucket, then exposure, then position,
   so ties keep the caller's order and no random number is drawn);
3. cut that order into contiguous micro-batches under a budget (tokens or
   samples per micro-batch): as few micro-batches as the budget allows, and
   among those the fewest that hold two buckets, so a micro-batch holds one
   bucket's samples wherever the counts allow (``mix=False``: never two);
4. where the ranks must run more micro-batches than this rank needs, split
   a two-bucket micro-batch where its buckets meet, then the largest ones.

Least exposed first leaves the most exposed samples in the last micro-batch,
the one that synchronises gradients across ranks. Pure Python over names and
numbers; no framework import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..vocabulary import ZERO_BUCKET


@dataclass(frozen=True, slots=True)
class Packing:
    """Micro-batches of one update, in run order, and the samples left out."""

    #: Sample positions of each micro-batch, least exposed micro-batch first.
    microbatches: tuple[tuple[int, ...], ...]
    #: Bucket each micro-batch runs under: that of its most exposed sample.
    buckets: tuple[str, ...]
    #: Zero-exposure samples that run no forward and no backward.
    dropped: tuple[int, ...]


def bucket_histograms(names: Sequence[str], microbatches: Sequence[Sequence[int]]) -> list[dict[str, int]]:
    """Samples per bucket in each micro-batch (``names``: one bucket per sample): how pure a packing is."""
    out = []
    for mb in microbatches:
        counts: dict[str, int] = {}
        for i in mb:
            counts[names[i]] = counts.get(names[i], 0) + 1
        out.append(counts)
    return out


def drop_then_pack(
    names: Sequence[str],
    exposures: Sequence[float],
    bucket_order: Sequence[str],
    *,
    budget: float,
    costs: Sequence[float] | None = None,
    drop: bool = True,
    mix: bool = True,
    at_least: int = 1,
) -> Packing:
    """Drop zero samples, order the rest least exposed first and cut it under ``budget``.

    ``names``/``exposures``: one bucket name and one exposure per sample.
    ``costs``: what each sample weighs against ``budget`` (tokens; None: 1
    each, so ``budget`` is samples per micro-batch); a sample over budget
    gets a micro-batch of its own. ``drop``: leave out the zero bucket
    (False keeps it, first). ``mix``: a micro-batch may hold two buckets
    where that saves one; False never. ``at_least``: split the largest
    micro-batches until there are that many (while one has two samples).
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    rank = {name: i for i, name in enumerate(bucket_order)}
    keep = [i for i, n in enumerate(names) if not (drop and n == ZERO_BUCKET)]
    keep.sort(key=lambda i: (rank[names[i]], float(exposures[i]), i))
    weights = [1.0 if costs is None else float(costs[i]) for i in keep]
    ordered = [names[i] for i in keep]
    cuts = _split_to(_cut(weights, ordered, budget, mix), ordered, at_least)
    microbatches = tuple(tuple(keep[a:b]) for a, b in cuts)
    buckets = tuple(max((names[i] for i in mb), key=rank.__getitem__) for mb in microbatches)
    dropped = tuple(i for i, n in enumerate(names) if drop and n == ZERO_BUCKET)
    return Packing(microbatches, buckets, dropped)


def _cut(weights: list[float], names: list[str], budget: float, mix: bool) -> list[tuple[int, int]]:
    """Contiguous [a, b) segments of the ordered samples: fewest segments, then fewest mixed ones.

    A dynamic programme over suffixes: ``best[i]`` is the cheapest cut of
    samples i.. as (segments, mixed segments, -length of the first segment);
    the last term fills micro-batches from the front, as a greedy cut would.
    """
    n = len(weights)
    best: list[tuple[int, int, int] | None] = [None] * (n + 1)
    nxt = [n] * (n + 1)
    best[n] = (0, 0, 0)
    for i in range(n - 1, -1, -1):
        total = 0.0
        for j in range(i + 1, n + 1):
            total += weights[j - 1]
            if total > budget and j > i + 1:
                break  # a segment is never longer than the budget, unless one sample alone is
            mixed = int(names[i] != names[j - 1])  # ordered by bucket: ends differ iff it mixes
            if (mixed and not mix) or best[j] is None:
                continue
            cost = (1 + best[j][0], mixed + best[j][1], -(j - i))
            if best[i] is None or cost < best[i]:
                best[i], nxt[i] = cost, j
    cuts, i = [], 0
    while i < n:
        cuts.append((i, nxt[i]))
        i = nxt[i]
    return cuts


def _split_to(cuts: list[tuple[int, int]], names: list[str], at_least: int) -> list[tuple[int, int]]:
    """Split segments until there are ``at_least`` (or every segment is one sample).

    A segment that holds two buckets is split where its buckets meet (both
    halves are then one bucket's); otherwise the longest one is halved.
    """
    cuts = list(cuts)
    while len(cuts) < at_least:
        mixed = [k for k, (a, b) in enumerate(cuts) if names[a] != names[b - 1]]
        if mixed:
            k = mixed[0]
            a, b = cuts[k]
            mid = next(m for m in range(a + 1, b) if names[m] != names[a])
        else:
            k = max(range(len(cuts)), key=lambda s: (cuts[s][1] - cuts[s][0], -s), default=None)
            if k is None or cuts[k][1] - cuts[k][0] < 2:
                break
            a, b = cuts[k]
            mid = a + (b - a) // 2
        cuts[k : k + 1] = [(a, mid), (mid, b)]
    return cuts


__all__ = ["Packing", "bucket_histograms", "drop_then_pack"]
