"""``bf16``: keep an fp32 activation as bfloat16 (one part, 2 bytes/element).

Inputs: fp32 only. bf16 input would save nothing; fp16 input would save
nothing either (both are 2 bytes) and lose 3 mantissa bits, so neither is
supported. Decode casts back to the requested dtype (bf16 -> fp32 is exact).

Error bound, per element (round to nearest even, 8 significant bits)::

    |x - x_hat| <= 2**-8 * |x| + 2**-134

i.e. relative error <= 2**-8 for normal values (|x| >= 2**-126); bf16 has
fp32's exponent range, so fp32 subnormals stay subnormal with absolute error
<= 2**-134 (half of bf16's subnormal step 2**-133): 1e-40 -> 2**-133
(~9.18e-41).
All-zero and empty tensors decode to exact zeros. Overflow: finite fp32
values of magnitude >= 2**128 * (1 - 2**-9) (~3.396e38, past bf16's largest
finite 3.390e38) round to inf; eager :meth:`encode` refuses them.

Non-finite input: eager :meth:`encode` raises ``NonFiniteError`` ("store this
unit instead") and the tracer marks ``bf16`` unusable for the unit. In the
graph (run time) inf and nan pass through the cast unchanged, elementwise:
they stay inf/nan after decode and never become finite.
"""

from __future__ import annotations

from typing import ClassVar

import sympy
import torch

from ._emit import Emitter, Value
from .base import Codec, Shape, convert, numel_expr, register_codec, rounding_bound


class Bf16Codec(Codec):
    """fp32 -> bfloat16 (see the module docstring for the error bound)."""

    name: ClassVar[str] = "bf16"
    input_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32})

    def _encode(self, e: Emitter, x: Value) -> tuple[Value]:
        return (convert(e, x, torch.bfloat16),)

    def _decode(self, e: Emitter, parts: tuple[Value, ...], dtype: torch.dtype) -> Value:
        (y,) = parts
        return convert(e, y, dtype)

    def encoded_nbytes_expr(self, shape: Shape, dtype: torch.dtype) -> sympy.Expr:
        """Two bytes per element."""
        self._check_dtype(dtype)
        return numel_expr(shape) * torch.bfloat16.itemsize

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """``2**-8 * |x| + 2**-134``: one bf16 rounding."""
        return rounding_bound(torch.bfloat16, x.detach().double().abs())


BF16 = register_codec(Bf16Codec())
