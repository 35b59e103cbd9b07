"""``int4``: row-wise absmax 4-bit integers, two per byte, one fp32 scale per row.

The lossy end of the codec range: half of int8's bytes at about 18 times
its error. Exposure conditioning exists for such an option: a low-exposure
bucket can afford it where the high-exposure ones cannot, so the shared error
budget binds and the buckets' plans differ.

Encoding (row = last dimension of length N, computed in fp32)::

    scale = max(absmax(row) / 7, SCALE_MIN)          # fp32, shape (..., 1)
    q     = clamp(round(x / scale), -7, 7) + 8       # 1..15, a nibble
    h     = N // 2
    pairs = uint8(q[..., :h] + 16 * q[..., h:2h])    # (..., h): nibble j with nibble h + j
    tail  = uint8(q[..., 2h:])                       # (..., N % 2): an odd row's last nibble

A byte pairs element j with element h + j, not with its neighbour, so both
halves are contiguous slices: encode packs and decode unpacks with
vectorized loads and stores. Interleaved pairs (j with j + 1) made Inductor's
CPU decode gather nibbles one element at a time, 60x slower than int8's.

Stored bytes: ``rows * (N // 2 + N % 2) + 4 * rows`` (about 1/8 of fp32).
The tail part's shape also tells decode whether N was odd. A 0-d tensor is
one row of one element.

Error bound, per element of a finite row decoded to ``x.dtype``: as int8's
with ``qmax`` 7, i.e. ``scale / 2 = absmax / 14`` plus the same fp32 slack
and output rounding (see :mod:`.int8`). Zero rows, subnormals and non-finite
rows behave as in int8: a row holding inf or nan decodes to NaN in the graph,
and eager :meth:`encode` refuses it.
"""

from __future__ import annotations

from typing import ClassVar

import sympy
import torch

from ._emit import Emitter, Value
from ._rowwise import SCALE_NBYTES, IntegerRowwiseCodec
from .base import convert, numel_expr, register_codec

aten = torch.ops.aten

#: Added to a quantized value in [-7, 7] to make it a nibble in [1, 15].
OFFSET = 8


class Int4Codec(IntegerRowwiseCodec):
    """Row-wise absmax int4, packed two per byte (see the module docstring)."""

    name: ClassVar[str] = "int4"
    qmax: ClassVar[float] = 7.0
    #: The row-wise step's output before packing (values -7..7).
    payload_dtype: ClassVar[torch.dtype] = torch.int8

    def _encode(self, e: Emitter, x: Value) -> tuple[Value, ...]:
        scalar = e.val(x).dim() == 0
        if scalar:
            x = e.op(aten.view.default, x, [1])
        x32 = convert(e, x, torch.float32)  # (..., N)
        row = self._row_scale(e, x32)
        n = e.val(x).shape[-1]
        half = n // 2

        def nibbles(start: int, end: int) -> Value:
            # Quantized straight from the slice, so one pointwise kernel
            # reads x and writes the packed bytes: packing an already
            # quantized (..., N) tensor made Inductor keep that tensor and
            # pack it in a kernel of its own, 3x int8's encode on CPU.
            values = e.op(aten.slice.Tensor, x32, -1, start, end)
            return e.op(aten.add.Tensor, self._quantize(e, values, row), OFFSET)  # fp32 1..15

        # Exact in fp32: every value is an integer up to 15 + 16 * 15 = 255.
        pairs = e.op(aten.add.Tensor, nibbles(0, half), e.op(aten.mul.Tensor, nibbles(half, 2 * half), 16))
        tail = nibbles(2 * half, n)
        scale = row.stored
        if scalar:
            scale = e.op(aten.view.default, scale, [])
        return convert(e, pairs, torch.uint8), convert(e, tail, torch.uint8), scale

    def _decode(self, e: Emitter, parts: tuple[Value, ...], dtype: torch.dtype) -> Value:
        pairs, tail, scale = parts
        scalar = e.val(scale).dim() == 0
        # Unpacked in fp32, where every step is exact for values below 256.
        p = convert(e, pairs, torch.float32)
        high = e.op(aten.floor.default, e.op(aten.mul.Tensor, p, 1.0 / 16))
        low = e.op(aten.sub.Tensor, p, e.op(aten.mul.Tensor, high, 16))
        q = e.op(aten.cat.default, [low, high, convert(e, tail, torch.float32)], -1)
        q = e.op(aten.sub.Tensor, q, OFFSET)
        if scalar:
            q = e.op(aten.view.default, q, [])
        return super()._decode(e, (q, scale), dtype)

    def encoded_nbytes_expr(self, shape, dtype: torch.dtype) -> sympy.Expr:
        """Packed pairs and an odd row's last byte, plus one fp32 scale per row."""
        self._check_dtype(dtype)
        shape = tuple(shape) or (1,)
        n = sympy.sympify(shape[-1])
        rows = numel_expr(shape[:-1])
        return rows * (sympy.floor(n / 2) + sympy.Mod(n, 2)) + rows * SCALE_NBYTES


INT4 = register_codec(Int4Codec())
