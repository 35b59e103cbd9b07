"""The codecs and inputs the codec tests share (``test_codecs.py``, ``test_codec_graphs.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from hilore_compiler.codecs import Codec, codec_names, get_codec

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CODECS = [get_codec(name) for name in codec_names("cpu")]
ROWWISE = [c for c in CODECS if c.name in ("int8", "fp8", "int4")]
SHAPES = [(16, 64), (3, 5, 128), (1, 1), (7, 1000)]


def cases():
    """Every codec with every float dtype it supports, as (codec, dtype) parameters."""
    return [
        pytest.param(c, dt, id=f"{c.name}-{str(dt).removeprefix('torch.')}")
        for c in CODECS
        for dt in FLOATS
        if c.supports(dt)
    ]


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x), x.dtype)


def x_with_bad_rows(dtype: torch.dtype) -> torch.Tensor:
    """(5, 16) normal data; row 1 holds inf, row 3 nan and -inf."""
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(9)).to(dtype)
    x[1, 3], x[3, 0], x[3, 9] = math.inf, math.nan, -math.inf
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same bytes as an integer tensor, so NaNs and -0.0 compare exactly."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))
