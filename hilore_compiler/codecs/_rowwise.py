"""Row-wise absmax scaling shared by the ``int8`` and ``fp8`` codecs.

A row is the last dimension. Encode computes, in fp32::

    absmax = amax(|x|, -1)                          # (..., 1)
    scale  = max(absmax / qmax, SCALE_MIN)          # (..., 1) fp32, kept
    q      = payload(clamp(grid(x / scale), -qmax, qmax))   # (..., N), kept

and decode ``q * scale`` converted back to the requested dtype. Each subclass
chooses ``qmax``, the payload dtype and ``grid`` (the rounding before the
cast). Non-finite rows are poisoned rather than raised on (see
:meth:`RowwiseCodec._encode`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ._emit import Emitter, Value
from .base import Codec, Shape, convert, numel_expr, rounding_bound

aten = torch.ops.aten

#: Smallest scale: fp32's smallest *normal* number (2**-126). It keeps an
#: all-zero row from dividing by zero, and is normal because devices that
#: flush subnormals to zero (FTZ/DAZ) would turn a subnormal scale into 0.
#: Rows with absmax < qmax * SCALE_MIN are quantized with this step.
SCALE_MIN = torch.finfo(torch.float32).tiny

#: Bytes of one fp32 scale per row.
SCALE_NBYTES = 4

#: fp32 arithmetic slack, relative to the row's absmax: the scale, the
#: division x/scale and the decode product each round once (2**-24 each);
#: one more unit covers the clamp at +-qmax. Derivation in the int8/fp8 docs.
FP32_SLACK = 4 * 2.0**-24


@dataclass(frozen=True, slots=True)
class RowScale:
    """One row-wise scaling: the scale to divide by, whether each row is finite,
    and the scale to keep (NaN for a non-finite row). Each (..., 1)."""

    scale: Value
    finite: Value
    stored: Value


class RowwiseCodec(Codec):
    """Row-wise absmax-scaled quantization to a narrow payload dtype."""

    #: |x| == absmax maps to this payload value.
    qmax: ClassVar[float]
    #: Dtype of the quantized payload.
    payload_dtype: ClassVar[torch.dtype]

    def _grid(self, e: Emitter, y: Value) -> Value:
        """Round ``y = x / scale`` onto the payload grid before the cast."""
        return y

    def _grid_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        """Bound on |y - payload(y)| for |y| <= qmax, in units of the scale."""
        raise NotImplementedError

    def _encode(self, e: Emitter, x: Value) -> tuple[Value, Value]:
        """Quantize ``x``; a row holding inf/nan gets payload 0 and scale NaN.

        The NaN scale makes every element of that row decode to NaN, so a
        non-finite value propagates instead of turning into finite garbage
        (the graph cannot raise at run time).
        """
        x32 = convert(e, x, torch.float32)  # (..., N)
        row = self._row_scale(e, x32)
        return convert(e, self._quantize(e, x32, row), self.payload_dtype), row.stored

    def _row_scale(self, e: Emitter, x32: Value) -> RowScale:
        """Each row's scale of ``x32`` (..., N) and whether the row is finite."""
        absmax = e.op(_row_reduction(e.val(x32)), e.op(aten.abs.default, x32), [-1], True)  # (..., 1)
        # False for a row with inf (absmax inf) or nan (amax propagates nan).
        finite = e.op(aten.lt.Scalar, absmax, math.inf)  # (..., 1) bool
        scale = e.op(aten.clamp_min.default, e.op(aten.div.Tensor, absmax, self.qmax), SCALE_MIN)
        device = e.val(x32).device
        nan = e.op(aten.scalar_tensor.default, math.nan, dtype=torch.float32, device=device)
        # Set NaN explicitly rather than trust clamp_min to keep a NaN absmax
        # (an fmax-style lowering would turn it into SCALE_MIN, and the row
        # would decode to silent zeros); an inf scale becomes NaN too.
        return RowScale(scale=scale, finite=finite, stored=e.op(aten.where.self, finite, scale, nan))

    def _quantize(self, e: Emitter, x32: Value, row: RowScale) -> Value:
        """Grid values (fp32, in [-qmax, qmax]) of ``x32``, elements of rows scaled by ``row``;
        0 in non-finite rows. Pointwise, so it fuses into whatever packs it."""
        y = self._grid(e, e.op(aten.div.Tensor, x32, row.scale))  # (..., N)
        # absmax / fl(absmax / qmax) may exceed qmax by an ulp.
        # clamp_min/clamp_max, not clamp: Inductor lowers only the former
        # (aten.clamp is decomposed before lowering, and these nodes are
        # inserted after decomposition).
        y = e.op(aten.clamp_max.default, e.op(aten.clamp_min.default, y, -self.qmax), self.qmax)
        zero = e.op(aten.scalar_tensor.default, 0.0, dtype=torch.float32, device=e.val(x32).device)
        # Casting nan to int8 is undefined behaviour: store 0 in poisoned rows.
        return e.op(aten.where.self, row.finite, y, zero)

    def _decode(self, e: Emitter, parts: tuple[Value, ...], dtype: torch.dtype) -> Value:
        q, scale = parts
        x32 = e.op(aten.mul.Tensor, convert(e, q, torch.float32), scale)  # (..., N)
        return convert(e, x32, dtype)

    def encoded_nbytes_expr(self, shape: Shape, dtype: torch.dtype) -> sympy.Expr:
        """Payload (``numel`` x payload itemsize) plus one fp32 scale per row."""
        self._check_dtype(dtype)
        payload = numel_expr(shape) * self.payload_dtype.itemsize
        return payload + numel_expr(tuple(shape)[:-1]) * SCALE_NBYTES

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """``grid_error(|x|/scale) * scale + FP32_SLACK * absmax`` + output rounding."""
        ax = x.detach().double().abs()
        if ax.numel() == 0:
            return ax
        absmax = ax.amax(-1, keepdim=True) if ax.dim() else ax
        scale = (absmax / self.qmax).clamp_min(SCALE_MIN)
        inner = self._grid_error(ax / scale) * scale + FP32_SLACK * absmax
        return inner + rounding_bound(x.dtype, ax + inner)


class IntegerRowwiseCodec(RowwiseCodec):
    """Row-wise scaling onto a symmetric integer grid (int8, int4): round to nearest."""

    def _grid(self, e: Emitter, y: Value) -> Value:
        return e.op(aten.round.default, y)

    def _grid_error(self, y_abs: torch.Tensor) -> torch.Tensor:
        # Rounding to the nearest integer is off by at most one half.
        return torch.full_like(y_abs, 0.5)


def _row_reduction(x: torch.Tensor):
    """``amax`` over the row, or ``sum`` when rows are statically empty.

    ``amax`` refuses an empty reduction; the sum of nothing is the 0 an empty
    row's absmax should be. Symbolic row lengths count as non-empty.
    """
    if x.dim() and statically_known_true(x.shape[-1] == 0):
        return aten.sum.dim_IntList
    return aten.amax.default
