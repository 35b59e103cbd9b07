"""The exposure mix a plan is solved for: how a batch's samples and coefficient mass spread over buckets.

A mix is a list of per-sample exposures in plan units (``vocabulary``: as if
each sample were the whole batch), e.g. those of a real GRPO batch
(``hilore plan --exposure-mix FILE``, file format ``hilore.exposure-mix/v1``:
``{"schema": ..., "exposures": [...]}``). From it the solver takes, per bucket,
the share of samples (which weighs that bucket's backward time), the share of
coefficient mass, and the share of squared exposure (which scales its squared
gradient error, ``risk.py``).

The default mix is GRPO's own batch shape, computed in closed form: groups of
``G = 8`` with binary rewards, each prompt solved with a probability drawn
uniformly from [0, 1] (a 50% solve rate on average, prompts of every
difficulty). Under that prior the number of solved samples k of a group is
uniform on 0..G (beta-binomial with a = b = 1), so the mix is one group per k:
k samples with advantage (1 - k/G) / sd and G - k with (k/G) / sd, sd the
group's unbiased reward std plus TRL's 1e-4. Groups with k = 0 or G (2 of 9)
have zero advantage and zero exposure. On-policy with the ``grpo`` loss a
sample's plan exposure is its |advantage|.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from ..jsonio import FormatError, read_json, write_json_atomic
from ..planfile import BucketSpec
from ..vocabulary import in_bucket
from .risk import BucketShare

MIX_SCHEMA = "hilore.exposure-mix/v1"
#: GRPO group size of the default mix (TRL's and DAPO's common choice).
GROUP_SIZE = 8
#: TRL's epsilon on the group std.
ADV_EPS = 1e-4


def default_exposure_mix(group_size: int = GROUP_SIZE) -> tuple[float, ...]:
    """Plan exposures of a GRPO batch at a 50% mean solve rate (module docstring)."""
    out: list[float] = []
    g = group_size
    for k in range(g + 1):
        if k in (0, g):
            out += [0.0] * g  # equal rewards: zero advantage, zero exposure
            continue
        mean = k / g
        sd = math.sqrt((k * (1 - mean) ** 2 + (g - k) * mean**2) / (g - 1)) + ADV_EPS
        out += [(1 - mean) / sd] * k + [mean / sd] * (g - k)
    return tuple(out)


def load_exposure_mix(path: str | os.PathLike) -> tuple[float, ...]:
    """Read a ``hilore.exposure-mix/v1`` file: nonnegative plan exposures."""
    payload = read_json(path, MIX_SCHEMA)  # checks the schema
    values = payload.get("exposures")
    if not isinstance(values, list) or not values or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v)
            for v in values):
        raise FormatError(f"{path}.exposures: expected a non-empty list of finite numbers >= 0")
    return tuple(float(v) for v in values)


def save_exposure_mix(exposures: Sequence[float], path: str | os.PathLike) -> Path:
    """Write plan exposures as a ``hilore.exposure-mix/v1`` file."""
    return write_json_atomic(path, {"schema": MIX_SCHEMA, "exposures": [float(x) for x in exposures]})


def bucket_shares(specs: Sequence[BucketSpec], exposures: Sequence[float],
                  gradient_exposures: Sequence[float] | None = None) -> tuple[BucketShare, ...]:
    """Each bucket's share of the mix's samples (zero samples count), of its
    mass (sum of exposures) and of its squared exposure (``risk.py``).

    A nonzero exposure above every range counts in the top bucket, as the
    runtime sends it there. ``gradient_exposures``: when ``exposures`` are
    the safe bounds that pick each sample's bucket (off-policy), the exposure
    each sample's gradient is expected to have (on-policy, ratio 1); they
    weigh the mass and error shares. A bound overstates the high buckets'
    share of the gradient (clipped tokens carry none), which would make the
    low buckets' lossy plans look cheaper than they are.
    """
    if not exposures:
        raise ValueError("the exposure mix is empty")
    weights = exposures if gradient_exposures is None else gradient_exposures
    if len(weights) != len(exposures) or any(not (w >= 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"gradient_exposures must be {len(exposures)} finite numbers >= 0, one per sample "
                         "of the exposure mix")
    top = max(specs, key=lambda s: s.hi)
    count = {s.name: 0 for s in specs}
    mass = {s.name: 0.0 for s in specs}
    square = {s.name: 0.0 for s in specs}
    for x, w in zip(exposures, weights):
        if x == 0:
            continue
        spec = next((s for s in specs if in_bucket(x, s.lo, s.hi)), top)
        count[spec.name] += 1
        mass[spec.name] += w
        square[spec.name] += w * w
    total, total_square = sum(mass.values()), sum(square.values())
    if total <= 0:
        raise ValueError("the exposure mix has no nonzero exposure: nothing reaches the update")
    return tuple(BucketShare(spec=s, samples=count[s.name] / len(exposures), mass=mass[s.name] / total,
                             error=square[s.name] / total_square) for s in specs)


def zero_share(exposures: Sequence[float]) -> float:
    """Fraction of the mix's samples with exposure exactly 0 (their backward is skipped)."""
    return sum(1 for x in exposures if x == 0) / len(exposures)
