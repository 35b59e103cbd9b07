"""Update-conditioned approximation risk: sensitivity x exposure, and the buckets.

risk(plan, bucket) = sum over compressed units u of sensitivity(u, codec) x E,
where E is the bucket's representative exposure. Sensitivity is the relative
gradient error per unit of exposure when only u is compressed; summing it over
units is the triangle-inequality bound on the error of compressing them all,
so the risk constraint is conservative.

Exposure scale (see grpo.py): a sample's exposure is sum_t |c_t| with the
loss's length normalisation, so a sample with |advantage| = 1 and no clipping
has exposure about 1. Group-normalised advantages satisfy |A| <= sqrt(G - 1),
below 4 for groups of up to 16 samples: hence ``EXPOSURE_HIGH``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..planfile import ZERO_BUCKET, BucketSpec
from ..tracefile import RecoveryUnit

#: Proxy sensitivity per unit of activation rel_l2 error, used when the trace
#: has no calibrated sensitivity. One unit's activation error reaches mainly the
#: weight gradients of its own layer, about 1/32 of a 32-layer decoder's
#: gradient norm; 0.03 (a little above 1/32) also covers the error it passes
#: on to earlier layers through the backward chain.
PROXY_FACTOR = 0.03

#: Default risk budget (summed relative gradient error at the representative
#: exposure). On a 32-layer decoder trace (581 units, 516 compressible) at
#: EXPOSURE_HIGH, bf16 on every unit (rel_l2 ~1.1e-3) costs 0.07 with the
#: proxy, about a third of the budget, while int8 on every unit (rel_l2
#: 8e-3..1.2e-2) costs 0.53, two and a half times it: int8 is rejected
#: wholesale where exposure is high and admitted where it is low (at exposure
#: 1 all-int8 costs 0.13 and fits). fp8 (rel_l2 ~2.5e-2) fits everywhere only
#: in the lowest bucket. Calibrated sensitivities in the trace replace the
#: proxy; this number then bounds measured error. Additive risk means smaller
#: models (fewer units) admit more compression under the same budget.
DEFAULT_RISK_BUDGET = 0.2

#: Default exposure levels without GRPO data: representative exposures spaced
#: geometrically from EXPOSURE_LOW to EXPOSURE_HIGH, because exposure is a
#: magnitude whose spread over samples is multiplicative (advantage x ratio x
#: length normalisation).
EXPOSURE_LOW = 0.25
EXPOSURE_HIGH = 4.0
DEFAULT_NUM_BUCKETS = 3


def sensitivity(unit: RecoveryUnit, codec: str, proxy_factor: float = PROXY_FACTOR) -> tuple[float, bool]:
    """(sensitivity of ``unit`` under ``codec``, whether it is the rel_l2 proxy)."""
    if codec in unit.sensitivity:
        return float(unit.sensitivity[codec]), False
    return float(unit.codecs[codec].rel_l2) * proxy_factor, True


def default_buckets(n: int) -> tuple[BucketSpec, ...]:
    """``n`` buckets ``b0..b{n-1}`` covering (0, inf), plus nothing for zero.

    Representative exposures are geometric from EXPOSURE_LOW to EXPOSURE_HIGH
    (just EXPOSURE_HIGH when n == 1). Each bucket's range ends at its own
    representative, so the risk bound is the worst case inside it; the last
    bucket is unbounded and planned at EXPOSURE_HIGH, the largest exposure
    normalised GRPO advantages reach.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of buckets must be a positive integer, got {n!r}")
    if n == 1:
        levels = [EXPOSURE_HIGH]
    else:
        ratio = (EXPOSURE_HIGH / EXPOSURE_LOW) ** (1 / (n - 1))
        levels = [EXPOSURE_LOW * ratio**i for i in range(n)]
    edges = [0.0, *levels[:-1], math.inf]
    return tuple(BucketSpec(f"b{i}", edges[i], edges[i + 1], levels[i]) for i in range(n))


def bucket_specs(buckets: int | Sequence[BucketSpec | tuple]) -> tuple[BucketSpec, ...]:
    """Normalise ``buckets`` (a count or explicit specs) and check they make sense."""
    if isinstance(buckets, int) and not isinstance(buckets, bool):
        return default_buckets(buckets)
    specs = []
    for b in buckets:
        fields = (b.name, b.lo, b.hi, b.exposure) if isinstance(b, BucketSpec) else b
        if not (isinstance(fields, (tuple, list)) and len(fields) == 4):
            raise ValueError(f"bucket {b!r} is not BucketSpec(name, lo, hi, exposure) or a 4-tuple")
        try:
            specs.append(BucketSpec(str(fields[0]), float(fields[1]), float(fields[2]), float(fields[3])))
        except (TypeError, ValueError) as e:
            raise ValueError(f"bucket {b!r}: lo, hi and exposure must be numbers") from e
    if not specs:
        raise ValueError("at least one exposure bucket is needed besides 'zero'")
    _check_specs(specs)
    return tuple(specs)


def _check_specs(specs: list[BucketSpec]) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or ZERO_BUCKET in names:
        raise ValueError(f"bucket names {names} must be unique and not {ZERO_BUCKET!r} (reserved)")
    for s in specs:
        if not (0 <= s.lo < s.hi) or not (s.exposure > 0 and math.isfinite(s.exposure)):
            raise ValueError(f"bucket {s}: need 0 <= lo < hi and a positive finite exposure")
    ordered = sorted(specs, key=lambda s: s.lo)
    for a, b in zip(ordered, ordered[1:]):
        if b.lo < a.hi:
            raise ValueError(f"buckets {a.name} and {b.name} overlap: [{a.lo}, {a.hi}) and [{b.lo}, {b.hi})")


def zero_bucket() -> BucketSpec:
    """Exposure exactly 0: no gradient flows, the plan is ``skip``."""
    return BucketSpec(ZERO_BUCKET, 0.0, 0.0, 0.0)
