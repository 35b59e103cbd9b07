"""Risk: a plan's predicted contribution to the relative error of the whole update's gradient.

Sensitivity. ``s(u, codec)`` is the relative gradient error of an update all
of whose coefficient mass goes through unit ``u`` compressed with ``codec``
(every other unit exact): ``|g~ - g| / |g|`` on a calibration batch
(``passes/calibration.py``). On-policy the gradient is ``sum_t c_t d logp_t``,
linear in the coefficients, so scaling every c_t scales error and gradient
alike: s is a property of (unit, codec), not of the advantages' size.

Samples add in quadrature. The update's gradient is a sum over samples,
``g = sum_i g_i``, and so is its error. Different samples' gradients are
nearly orthogonal in a space of millions of parameters, and so are the
errors that compressing one unit leaves in them (measured on the actor
bench's GRPO batch, 28 microbatches of ``small``: ``|sum_i g_i|`` equals
``sqrt(sum_i |g_i|^2)`` within 0.1%, and an int4 unit's ``|sum_i e_i|`` its
quadrature sum within 1%). Compressing ``u`` for one bucket's samples only
therefore leaves the error ``s(u) x sqrt(q_b) x |g|``, where ``q_b`` is the
bucket's share of ``sum_i |g_i|^2``. A sample's gradient grows with its
coefficient mass, its exposure ``x_i``, so ``q_b = sum_{i in b} x_i^2 /
sum_i x_i^2`` (its *error share*, ``mix.bucket_shares``): compressing half of
the microbatches measured ``0.70 s``, ``sqrt(1/2) s`` as this rule says, where
the bucket's mass share ``m_b`` itself (an error linear in ``m_b``) would
have said ``0.5 s``. The square weights exposure steeply: a bucket of many
low-exposure samples holds a small error share, so it can afford lossy
options that a bucket of a few high-exposure samples cannot.

Many units. Quantisation errors of different tensors are independent and
zero-mean, so their gradient errors are nearly orthogonal too: squared norms
add (quadrature), not norms (the triangle inequality, which overstates the
error of n equal units by sqrt(n)); five int4 units of one layer measured
0.077 against 0.080 in quadrature. The whole update's predicted relative
error is therefore

    err^2 = sum_b q_b x sum_{u compressed in b} s(u, codec_b(u))^2,

and ``risk(b) = q_b x sum_u s^2`` is linear in the plan's decisions, so one
budget on ``err^2`` shared by every bucket is one linear ILP constraint.
``tests/test_calibration.py`` checks the rule on a measured multi-unit plan.

From a cosine target to a budget. For ``g~ = g + e`` with ``|e| = err |g|``
and err < 1, the angle between g~ and g is at most ``arcsin(err)`` whatever
e's direction, so ``cos(g~, g) >= sqrt(1 - err^2)``. Hence

    cos >= c   is guaranteed by   err^2 <= 1 - c^2

(``1 - 0.999^2 = 1.999e-3``, err <= 0.0447; the usual approximation
``err <= sqrt(2 (1 - c))`` is the same to first order). Budgets are given as
``"cos>=0.9999"``, as ``"l2<=0.0447"`` (err itself), or as a number (the bound
on err^2, which the ILP constrains). Messages state err, the relative L2
error, never err^2 (``format_error``), so that one measure is read everywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..planfile import BucketSpec
from ..tracefile import RecoveryUnit
from ..vocabulary import ZERO_BUCKET, bucket_name, codec_of

if TYPE_CHECKING:  # memory.py imports this module
    from .memory import CostModel

#: Target gradient cosine of the whole update against the exact one.
DEFAULT_TARGET_COSINE = 0.999
#: The default risk budget, as ``parse_risk_budget`` reads it.
DEFAULT_RISK_BUDGET = f"cos>={DEFAULT_TARGET_COSINE}"

#: Proxy sensitivity per unit of activation rel_l2 error, for traces without
#: calibration: s = gain(kind) x rel_l2 x sqrt(PROXY_LAYERS / L) for a model of
#: L layers. The gains are measured on the ``small`` policy (4 layers,
#: sequence 2048), twice, and each kind keeps the larger, so that the proxy
#: errs high: in fp32, ``traces/small-cpu-T2048.json``, where per kind the
#: ratio s / rel_l2 is the same for bf16, int8 and fp8 within 20% (the median
#: is kept); and in bf16 with int4, unit by unit, the largest over the
#: layers (``hilore trace --model small --dtype bfloat16 --codecs int8,int4
#: -o T``, ``hilore calibrate --model small --dtype bfloat16 --trace T
#: --codecs int8,int4 --per-unit -o T``; int8's ratios there sit on bf16's
#: own rounding, a relative gradient error of 2-5e-3 whatever is compressed,
#: and are not used). The bf16 graph saves kinds the fp32 one does not (a
#: norm's bf16 output ``*.mul``, attention's cast ``self_attn.to``), and a
#: kind's ratio differs across layers (layer 0's ``input_layernorm.mul``
#: 0.33, layer 3's 0.015). With the fp32 gains alone a zero-config bf16 plan
#: with int4 measured a squared error of 3.6e-3 where it predicted 6.2e-4
#: (cos 0.9987, target 0.999); its units' measured errors in quadrature
#: make 3.7e-3, so it is the gains that were off, not the quadrature sum.
#: The gains span 0.0065 (o_proj input) to 1.5 (attention: its saved
#: log-sum-exp enters the backward through an exponential), so one factor for
#: all kinds would be 25x off for attention. sqrt(PROXY_LAYERS / L): a unit's
#: activation error reaches mainly the weight gradients of its own layer,
#: which hold about 1/L of the gradient's squared norm. Kinds not measured
#: take PROXY_FACTOR, the median over the fp32 (kind, codec) pairs.
PROXY_GAIN: dict[str, float] = {
    "embed_tokens.embedding": 0.043, "input_layernorm.rsqrt": 0.065, "input_layernorm.mul": 0.33,
    "self_attn.q_proj.linear": 0.024, "self_attn.add": 0.019, "self_attn.to": 0.060,
    "self_attn.repeat_interleave": 0.046, "self_attn.sdpa": 1.5, "self_attn.o_proj.linear": 0.018,
    "post_attention_layernorm.rsqrt": 0.42, "post_attention_layernorm.mul": 0.21,
    "mlp.gate_proj.linear": 0.30, "mlp.up_proj.linear": 0.26, "mlp.mul": 0.15, "mlp.down_proj.linear": 0.079,
    "add": 0.11, "norm.rsqrt": 1.1, "norm.mul": 0.30, "lm_head.linear": 0.3,
}
PROXY_FACTOR = 0.058
PROXY_LAYERS = 4

#: Buckets when none are given.
DEFAULT_NUM_BUCKETS = 3


def cosine_to_error2(cosine: float) -> float:
    """The budget on err^2 that guarantees ``cos >= cosine`` (module docstring)."""
    if not 0.0 < cosine < 1.0:
        raise ValueError(f"target cosine must be in (0, 1), got {cosine}")
    return 1.0 - cosine * cosine


def error2_to_cosine(error2: float) -> float:
    """The cosine an err^2 guarantees: ``sqrt(1 - err^2)`` (0 when err >= 1)."""
    return math.sqrt(max(0.0, 1.0 - error2))


_COSINE = re.compile(r"^\s*cos\s*>=\s*(0?\.\d+|0|1(?:\.0*)?)\s*$", re.IGNORECASE)
_L2 = re.compile(r"^\s*l2\s*<=\s*(\d*\.?\d+(?:e-?\d+)?)\s*$", re.IGNORECASE)


def format_error(error2: float, *, cosine: bool = True) -> str:
    """A squared relative error as people read it: ``rel. L2 0.0447 (cos >= 0.999)``,
    without the cosine it guarantees when ``cosine`` is False."""
    text = f"rel. L2 {math.sqrt(max(error2, 0.0)):.3g}"
    return f"{text} ({format_cosine(error2_to_cosine(error2))})" if cosine else text


def format_cosine(cos: float) -> str:
    """``cos >= 0.999902``; past six nines as ``cos >= 1 - 5e-09`` (never a bound of 1 that is not one)."""
    if cos >= 1.0:
        return "cos = 1"
    text = f"{cos:.6g}"
    return f"cos >= 1 - {1.0 - cos:.2g}" if float(text) >= 1.0 else f"cos >= {text}"


def parse_risk_budget(budget: float | int | str | None) -> float:
    """The budget on the whole update's err^2: a number, or ``"cos>=c"``; None: the default."""
    if budget is None:
        budget = DEFAULT_RISK_BUDGET
    if isinstance(budget, str):
        match = _COSINE.match(budget)
        if match:
            return cosine_to_error2(float(match[1]))
        match = _L2.match(budget)
        if match:
            return float(match[1]) ** 2
        try:
            budget = float(budget)
        except ValueError:
            raise ValueError(f"risk budget {budget!r}: expected 'cos>=0.999', 'l2<=0.045' (the "
                             "update's relative L2 gradient error) or a number (that error squared)") from None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (
            math.isfinite(budget) and budget >= 0):
        raise ValueError(f"risk budget must be a finite number >= 0, 'cos>=c' or 'l2<=e', got {budget!r}")
    return float(budget)


def sensitivity(unit: RecoveryUnit, codec: str, layers: int = PROXY_LAYERS) -> tuple[float, bool]:
    """(sensitivity of ``unit`` under ``codec``, whether it is the proxy) in a model of ``layers``."""
    if codec in unit.sensitivity:
        return float(unit.sensitivity[codec]), False
    return proxy(unit.kind, float(unit.codecs[codec].rel_l2), layers), True


def proxy(kind: str, rel_l2: float, layers: int) -> float:
    """The proxy sensitivity of a ``kind`` unit whose activation error is ``rel_l2`` (PROXY_GAIN)."""
    return PROXY_GAIN.get(kind, PROXY_FACTOR) * rel_l2 * math.sqrt(PROXY_LAYERS / max(layers, 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketShare:
    """A bucket's weight in the joint problem: its share of a batch's samples, mass and error."""

    spec: BucketSpec
    #: Fraction of a batch's samples in this bucket: weighs its backward time.
    samples: float
    #: Fraction of the batch's coefficient mass (sum of exposures): reported.
    mass: float
    #: Fraction of the batch's squared exposure, ``sum x_i^2``: the bucket's
    #: share of the update's squared gradient norm, which its squared
    #: gradient error scales with (module docstring).
    error: float


def default_buckets(n: int, exposures: Sequence[float] | None = None) -> tuple[BucketSpec, ...]:
    """``n`` buckets ``b0..b{n-1}`` covering (0, inf) (the zero bucket is added apart).

    Edges are the 1/n, ..., (n-1)/n quantiles of the nonzero plan exposures of
    ``exposures`` (default: ``mix.default_exposure_mix()``), so each bucket holds
    about the same number of samples; each is planned at its upper edge (the
    top bucket at the largest exposure seen).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of buckets must be a positive integer, got {n!r}")
    if exposures is None:
        from .mix import default_exposure_mix

        exposures = default_exposure_mix()
    nonzero = sorted(x for x in exposures if x > 0)
    if not nonzero:
        raise ValueError("an exposure mix needs at least one nonzero exposure")
    inner = [nonzero[min(len(nonzero) - 1, math.ceil(len(nonzero) * i / n) - 1)] for i in range(1, n)]
    edges = [0.0, *inner, math.inf]
    for i in range(1, len(edges)):  # repeated quantiles (discrete exposures): keep ranges non-empty
        edges[i] = max(edges[i], math.nextafter(edges[i - 1], math.inf))
    levels = [*inner, nonzero[-1]]
    return tuple(BucketSpec(bucket_name(i), edges[i], edges[i + 1], max(levels[i], edges[i]))
                 for i in range(n))


def bucket_specs(buckets: int | Sequence[BucketSpec | tuple],
                 exposures: Sequence[float] | None = None) -> tuple[BucketSpec, ...]:
    """Normalise ``buckets`` (a count or explicit specs) and check they make sense."""
    if isinstance(buckets, int) and not isinstance(buckets, bool):
        return default_buckets(buckets, exposures)
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
            raise ValueError(f"buckets {a.name} and {b.name} overlap: ({a.lo}, {a.hi}] and ({b.lo}, {b.hi}]")


def zero_bucket() -> BucketSpec:
    """Exposure exactly 0: no gradient flows, the plan is ``skip``."""
    return BucketSpec(ZERO_BUCKET, 0.0, 0.0, 0.0)


def plan_risk(model: CostModel, decisions: Mapping[str, str], error_share: float) -> float:
    """A bucket's share of the update's squared relative gradient error (``risk.py``):
    its error share x the sum over compressed units of sensitivity^2."""
    total = 0.0
    for u in model.units:
        codec = codec_of(decisions[u.key])
        if codec is not None:
            total += u.codecs[codec].sensitivity ** 2
    return error_share * total
