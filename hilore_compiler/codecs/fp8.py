"""``fp8``: float8_e4m3fn with one fp32 scale per row (absmax -> 448).

Encoding (row = last dimension, computed in fp32)::

    scale = max(absmax(row) / 448, SCALE_MIN)            # fp32, shape (..., 1)
    y     = e4m3fn(clamp(x / scale, -448, 448))          # shape (..., N)

448 is e4m3fn's largest finite value; the cast rounds to nearest even.
Stored bytes: ``numel + 4 * rows``. Inputs: fp32, fp16, bf16. Only where the
platform has it: :meth:`Fp8Codec.available` checks that torch has
``float8_e4m3fn`` and that casting to it works and rounds correctly on the
device (on CUDA also compute capability >= 8.9, where Triton casts to e4m3
natively).

e4m3fn has 3 mantissa bits, exponent bias 7: normal magnitudes
[2**-6, 448], subnormals k * 2**-9 (k = 1..7). In units of the scale
(``y = x / scale``) the cast is off by at most

- ``2**-4 * |y|`` for ``|y| >= 2**-6`` (half an ulp, relative), and
- ``2**-10`` (half the subnormal step) for ``|y| < 2**-6``;
  ``|y| <= 2**-10`` becomes 0 (underflow).

So, per element of a finite row decoded to ``x.dtype``::

    |x - x_hat| <= max(2**-4 * |x|, 2**-10 * scale)
                   + 4 * 2**-24 * absmax + r_out(|x| + that)

with the fp32 slack and ``r_out`` (final cast) as in ``int8``. In terms of
the row: relative error <= 2**-4 for ``|x| >= 2**-6 * absmax / 448``
(~3.5e-5 * absmax); absolute error <= 2**-10 * absmax / 448 below that; and
``|x| <= 2**-10 * absmax / 448`` (~2.2e-6 * absmax) decodes to 0. A 1e30 in
a row therefore zeroes the row's ordinary values, and only that row's.

All-zero and empty rows: ``scale = SCALE_MIN`` (2**-126), zeros decode to
exact zeros. Subnormal inputs: a row with absmax below ``448 * SCALE_MIN``
uses the step ``SCALE_MIN``; fp32 subnormals then land in e4m3's own
subnormal range and decode to a nearby fp32 subnormal (1e-40 -> 2**-133,
~9.18e-41), within the bound above.

Non-finite input: eager :meth:`encode` raises ``NonFiniteError`` ("store this
unit instead") and the tracer marks ``fp8`` unusable for the unit. In the
graph (run time, where raising is impossible) a row holding inf or nan is
stored as payload 0 with scale NaN, so the whole row decodes to NaN.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from ._rowwise import RowwiseCodec
from .base import register_codec

#: e4m3fn, or None on a torch without it (the codec is then unavailable).
E4M3 = getattr(torch, "float8_e4m3fn", None)

#: e4m3fn's subnormal range ends here; below it the error is absolute.
E4M3_MIN_NORMAL = 2.0**-6
#: Half of e4m3's ulp, relative to the value (3 mantissa bits).
E4M3_HALF_ULP_REL = 2.0**-4
#: Half of e4m3's subnormal step 2**-9.
E4M3_HALF_SUBNORMAL = 2.0**-10

#: Probe for :func:`_cast_works`: exact values and two round-half-even ties
#: (1 + 2**-4 -> 1.0, 1.125 + 2**-4 -> 1.25), which a truncating or
#: saturating-wrong cast gets wrong.
_PROBE_IN = (0.5, -448.0, 2.0**-9, 1.0 + 2.0**-4, 1.125 + 2.0**-4)
_PROBE_OUT = (0.5, -448.0, 2.0**-9, 1.0, 1.25)

#: Triton casts fp32 to e4m3 natively from this CUDA compute capability.
_MIN_CUDA_CAPABILITY = (8, 9)


class Fp8Codec(RowwiseCodec):
    """Row-scaled float8_e4m3fn (see the module docstring for the error bound)."""

    name: ClassVar[str] = "fp8"
    #: e4m3fn's largest finite magnitude.
    qmax: ClassVar[float] = 448.0
    payload_dtype: ClassVar[torch.dtype] = E4M3 if E4M3 is not None else torch.uint8

    def available(self, device: torch.device | str = "cpu") -> bool:
        """True when torch has e4m3fn and casting to it is correct on ``device``.

        ``meta`` counts as available when the dtype exists: nothing runs
        there, it only plans shapes.
        """
        return _cast_works(str(torch.device(device)))

    def _grid_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        return torch.clamp_min(y_abs * E4M3_HALF_ULP_REL, E4M3_HALF_SUBNORMAL)


@functools.lru_cache(maxsize=None)
def _cast_works(device: str) -> bool:
    """Whether fp32 -> e4m3fn -> fp32 round-trips ``_PROBE_IN`` on ``device``."""
    if E4M3 is None:
        return False
    dev = torch.device(device)
    if dev.type == "meta":
        return True
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if torch.cuda.get_device_capability(dev) < _MIN_CUDA_CAPABILITY:
            return False
    try:
        probe = torch.tensor(_PROBE_IN, dtype=torch.float32, device=dev)
        back = probe.to(E4M3).to(torch.float32).cpu()
    except (RuntimeError, TypeError, AssertionError, NotImplementedError):
        # No such device in this build, or no e4m3 kernels on it.
        return False
    return back.tolist() == list(_PROBE_OUT)


FP8 = register_codec(Fp8Codec())
