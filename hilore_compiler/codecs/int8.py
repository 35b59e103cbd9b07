"""``int8``: row-wise absmax int8 with one fp32 scale per row.

Encoding (row = last dimension, computed in fp32)::

    scale = max(absmax(row) / 127, SCALE_MIN)       # fp32, shape (..., 1)
    q     = int8(clamp(round(x / scale), -127, 127)) # shape (..., N)

``round`` is round-half-to-even; -128 is never used, so the grid is
symmetric. Stored bytes: ``numel + 4 * rows`` (about 1/4 of fp32, 1/2 of
bf16/fp16). Inputs: fp32, fp16, bf16; decode restores any of them.

Error bound, per element of a finite row decoded to ``x.dtype``::

    |x - x_hat| <= scale / 2 + 4 * 2**-24 * absmax + r_out(|x| + that)

``scale / 2`` (= absmax / 254 for ordinary rows) is half a quantization step.
The fp32 slack covers one rounding each of the scale, of ``x / scale`` and of
the decode product. ``r_out(m) = m * eps/2 + tiny * eps/2`` of the output
dtype is the final cast (2**-24 / 2**-11 / 2**-8 relative for fp32 / fp16 /
bf16). So ``|x| < scale / 2`` decodes to 0: a row's small values vanish next
to a huge one (a 1e30 in a row zeroes every ordinary value in that row, and
only that row).

All-zero and empty rows: absmax 0 gives ``scale = SCALE_MIN`` (2**-126, no
division by zero) and zeros decode to exact zeros.

Subnormal inputs: a row whose absmax is below ``127 * SCALE_MIN`` (~1.5e-36)
is quantized with the step ``SCALE_MIN``; values below ``SCALE_MIN / 2``
(every fp32 subnormal, e.g. 1e-40) decode to exactly 0, within the bound.

Non-finite input: eager :meth:`encode` raises ``NonFiniteError`` ("store this
unit instead"); the tracer then marks ``int8`` unusable for the unit. In the
graph (run time, where raising is impossible) a row holding inf or nan is
stored as payload 0 with scale NaN, so the *whole row* decodes to NaN: the
non-finite value propagates and never turns into finite garbage.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ._rowwise import IntegerRowwiseCodec
from .base import register_codec


class Int8Codec(IntegerRowwiseCodec):
    """Row-wise absmax int8 (see the module docstring for the error bound)."""

    name: ClassVar[str] = "int8"
    #: Largest magnitude of the symmetric int8 grid.
    qmax: ClassVar[float] = 127.0
    payload_dtype: ClassVar[torch.dtype] = torch.int8


INT8 = register_codec(Int8Codec())
