"""Codecs: lossy encodings of saved activations, one module per codec.

The option ``compress:<codec>`` names one of:

- ``bf16`` (:mod:`.bf16`): fp32 -> bfloat16; relative error <= 2**-8.
- ``int8`` (:mod:`.int8`): row-wise absmax int8 + fp32 scale per row;
  error <= absmax(row) / 254 per element.
- ``fp8`` (:mod:`.fp8`): float8_e4m3fn + fp32 scale per row (absmax -> 448);
  relative error <= 2**-4 above the underflow range; only where available.
- ``int4`` (:mod:`.int4`): row-wise absmax int4, two per byte, + fp32 scale
  per row; error <= absmax(row) / 14 per element: the lossy option that
  low-exposure buckets can afford.

Each codec has an eager reference (``encode``/``decode``, which raise
:class:`NonFiniteError` on inf/nan) and fx graph builders (``graph_encode``/
``graph_decode``) that insert the same decomposed aten/prims ops into an
AOTAutograd joint graph; see :mod:`.base` for the interface and the
registry. The shared machinery lives in ``_emit`` (eager/graph emitters) and
``_rowwise`` (absmax scaling for int8/fp8/int4).
"""

from ._emit import CODEC_META_KEY
from .base import Codec, NonFiniteError, codec_names, get_codec, register_codec, registered_codecs
# Importing a codec module registers it; this order is codec_names()' order.
from .bf16 import BF16, Bf16Codec  # isort: skip
from .int8 import INT8, Int8Codec  # isort: skip
from .fp8 import FP8, Fp8Codec  # isort: skip
from .int4 import INT4, Int4Codec  # isort: skip

__all__ = [
    "BF16",
    "CODEC_META_KEY",
    "Codec",
    "FP8",
    "INT4",
    "INT8",
    "Bf16Codec",
    "Fp8Codec",
    "Int4Codec",
    "Int8Codec",
    "NonFiniteError",
    "codec_names",
    "get_codec",
    "register_codec",
    "registered_codecs",
]
