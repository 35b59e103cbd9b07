"""The project's shared words, in one torch-free module (DESIGN.md "Words").

Options, the codec meta key, bucket names, the bucket interval rule and the
exposure-unit conversion used to live twice (planfile and grpo, codecs and
passes); every module now imports them from here.

Bucket interval rule: the ``zero`` bucket is the single point exposure == 0;
bucket ``b{i}`` is the half-open range ``(lo, hi]`` (``hi`` may be infinite).
Closed at the top because a bucket is planned for the largest exposure it
holds, and open at the bottom so that ``b0 = (0, hi]`` never holds a zero.

Exposure units: a *plan* states a sample's exposure as if that sample were the
whole batch (|advantage| ~ 1 gives exposure ~ 1, whatever the batch size); a
*batch* exposure, ``sum_t |c_t|`` of one sample in a batch of N sequences,
carries the loss's 1/N normalisation. ``plan = batch x N``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Options of a recovery unit (DESIGN.md "option").
STORE = "store"
RECOMPUTE = "recompute"
COMPRESS_PREFIX = "compress:"
#: The zero bucket's plan: the runtime skips backward for it altogether.
SKIP = "skip"

#: A unit's ``read_until`` when forward reads it after the last unit is made.
READ_PAST_UNITS = "<after the last unit>"

#: ``node.meta`` key holding the codec a joint-graph node encodes or decodes.
CODEC_META_KEY = "hilore_codec"

#: Name of the bucket whose samples reach the update with zero weight.
ZERO_BUCKET = "zero"

#: How a plan's note starts when GC's predicted peak is store-all's: an
#: ``x-gc`` ceiling then does not ask for anything (``solver.planner``).
GC_SAVES_NOTHING = "GC saves nothing at this shape"

#: Codecs a plan may use unless told otherwise, in the backend, ``hilore trace``,
#: ``hilore plan`` and ``hilore demo`` alike, so that one budget gives one plan
#: everywhere. Others are opt-in by name (``codecs`` / ``--codecs``): int4
#: because its error must be calibrated unit by unit (docs/fidelity.md).
DEFAULT_CODECS = ("bf16", "int8")


def group_of(layer: int | None) -> str:
    """The backward segment of a layer's units and weights: ``layer <i>``, or
    ``outside`` for those outside the layer stack. The trace's ``param_bytes``
    and the memory model (``solver.memory``) key their segments by it."""
    return "outside" if layer is None else f"layer {layer}"



def compress(codec: str) -> str:
    """The option that keeps a unit compressed with ``codec``: ``compress:<codec>``."""
    return COMPRESS_PREFIX + codec


def check_codecs(names: Sequence[str], known: Sequence[str], source: str) -> tuple[str, ...]:
    """``names`` without repeats, after checking each is in ``known``; one wording for the
    backend's ``codecs`` option and ``hilore plan --codecs``. ``source`` says where
    ``known`` comes from (``"the trace of M measured"``, ``"hilore knows"``)."""
    unknown = [c for c in names if c not in known]
    if unknown:
        raise ValueError(f"unknown codec(s) {unknown}: {source} {list(known)}")
    return tuple(dict.fromkeys(names))


def codec_of(option: str) -> str | None:
    """The codec of a ``compress:<codec>`` option; None for store and recompute."""
    return option.removeprefix(COMPRESS_PREFIX) if option.startswith(COMPRESS_PREFIX) else None


def is_option(option: str) -> bool:
    """True for ``store``, ``recompute`` and ``compress:<codec>``."""
    return option in (STORE, RECOMPUTE) or (
        option.startswith(COMPRESS_PREFIX) and len(option) > len(COMPRESS_PREFIX)
    )


def bucket_name(i: int) -> str:
    """Name of the i-th nonzero bucket, lowest exposure first: ``b{i}``."""
    return f"b{i}"


def bucket_names(n_buckets: int) -> tuple[str, ...]:
    """``("zero", "b0", ..., "b{n-1}")``."""
    return (ZERO_BUCKET, *(bucket_name(i) for i in range(n_buckets)))


def in_bucket(exposure: float, lo: float, hi: float) -> bool:
    """The interval rule: ``lo < exposure <= hi`` (the module docstring says why)."""
    return lo < exposure <= hi


def bucket_index(exposure: float, inner_edges: list[float] | tuple[float, ...]) -> int:
    """Index i of the nonzero bucket ``(edge[i-1], edge[i]]`` holding ``exposure``.

    ``inner_edges``: the n - 1 ascending upper edges of b0 .. b{n-2}; anything
    above the last one is in the top bucket.
    """
    for i, edge in enumerate(inner_edges):
        if exposure <= edge:
            return i
    return len(inner_edges)


def to_plan_exposure(batch_exposure: float, num_sequences: int) -> float:
    """Batch exposure (with the loss's 1/N) -> plan exposure (per sample as a whole batch)."""
    return batch_exposure * num_sequences


def to_batch_exposure(plan_exposure: float, num_sequences: int) -> float:
    """Plan exposure -> the exposure the same sample has in a batch of ``num_sequences``."""
    return plan_exposure / num_sequences if math.isfinite(plan_exposure) else plan_exposure
