"""Codecs: documented error bounds, fallbacks, sizes and registry (their fx builders: test_codec_graphs.py)."""

from __future__ import annotations

import math

import pytest
import sympy
import torch
import torch.fx

from hilore_compiler.codecs import (
    BF16,
    FP8,
    INT4,
    INT8,
    Codec,
    Int8Codec,
    NonFiniteError,
    codec_names,
    get_codec,
    register_codec,
)

from codec_cases import CODECS, FLOATS, ROWWISE, SHAPES, assert_bitwise, cases, roundtrip


def _check_bound(codec: Codec, x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Assert the codec's documented bound; return the worst err/bound ratio."""
    err = (x_hat.double() - x.double()).abs()
    bound = codec.error_bound(x)
    assert bound.shape == x.shape and bound.dtype == torch.float64
    bad = err > bound
    assert not bool(bad.any()), (
        f"{codec.name}: {int(bad.sum())} elements over the bound, "
        f"e.g. x={x[bad][0].item()!r} err={err[bad][0].item()!r} bound={bound[bad][0].item()!r}"
    )
    return float((err / bound).max()) if x.numel() else 0.0


# ---- error bounds ------------------------------------------------------------


@pytest.mark.parametrize("codec,dtype", cases())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_normal_within_bound_and_dtype_restored(codec, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x_hat = roundtrip(codec, x)
    assert x_hat.dtype == dtype and x_hat.shape == x.shape
    _check_bound(codec, x, x_hat)


@pytest.mark.parametrize("codec,dtype", cases())
def test_bound_is_tight_not_vacuous(codec, dtype):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    worst = _check_bound(codec, x, roundtrip(codec, x))
    # Many random values land near a rounding midpoint, so a bound that is
    # right (not 10x loose) is nearly reached.
    assert worst > 0.5


def test_int8_error_at_most_absmax_over_254():
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(2)) * 5
    err = (roundtrip(INT8, x) - x).abs()
    step_half = x.abs().amax(-1, keepdim=True) / 254
    assert bool((err <= step_half * (1 + 1e-5)).all())
    assert float((err / step_half).max()) > 0.99  # the half step is reached


def test_int4_error_at_most_absmax_over_14_and_about_18x_int8s():
    x = torch.randn(32, 511, generator=torch.Generator().manual_seed(2)) * 5  # odd rows: a tail nibble
    err = (roundtrip(INT4, x) - x).abs()
    step_half = x.abs().amax(-1, keepdim=True) / 14
    assert bool((err <= step_half * (1 + 1e-5)).all())
    assert float((err / step_half).max()) > 0.99
    rel = float(err.norm() / x.norm())
    rel8 = float((roundtrip(INT8, x) - x).norm() / x.norm())
    assert 12 < rel / rel8 < 24  # 127/7 = 18 times int8's step
    # Two values per byte, the odd row's last one in a byte of its own.
    assert INT4.encoded_nbytes(x.shape, x.dtype) == 32 * (255 + 1) + 32 * 4 == sum(
        p.numel() * p.element_size() for p in INT4.encode(x))


def test_int4_pairs_element_j_with_element_half_plus_j():
    """The documented layout: byte j holds nibble j low and nibble h + j high,
    so packing and unpacking read and write contiguous halves of a row."""
    x = torch.tensor([[7.0, -7.0, 0.0, 1.0, 2.0]])  # N = 5: h = 2, and a tail
    pairs, tail, scale = INT4.encode(x)
    q = [int(v) for v in torch.round(x[0] / scale[0, 0]) + 8]  # scale = 1: nibbles 15, 1, 8, 9, 10
    assert pairs.tolist() == [[q[0] + 16 * q[2], q[1] + 16 * q[3]]]
    assert tail.tolist() == [[q[4]]]
    assert torch.equal(INT4.decode((pairs, tail, scale), torch.float32), x)


def test_bf16_relative_error_at_most_2_pow_minus_8():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    rel = ((BF16.decode(BF16.encode(x), torch.float32) - x).abs() / x.abs()).max()
    assert 2**-9 < float(rel) <= 2**-8


@pytest.mark.skipif(not FP8.available("cpu"), reason="no float8_e4m3fn on this platform")
def test_fp8_relative_error_at_most_2_pow_minus_4_above_underflow():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    x_hat = roundtrip(FP8, x)
    normal = x.abs() >= 2**-6 * x.abs().amax(-1, keepdim=True) / 448
    rel = ((x_hat - x).abs() / x.abs())[normal].max()
    assert 2**-5 < float(rel) <= 2**-4 * (1 + 1e-6)


# ---- adversarial input -------------------------------------------------------


@pytest.mark.parametrize("codec,dtype", cases())
def test_zeros_decode_to_exact_zeros(codec, dtype):
    x = torch.zeros(4, 16, dtype=dtype)
    parts = codec.encode(x)
    assert all(bool(torch.isfinite(p.float()).all()) for p in parts)
    assert_bitwise(codec.decode(parts, dtype), x)


@pytest.mark.parametrize("codec,dtype", cases())
def test_one_huge_value_only_costs_its_row(codec, dtype):
    huge = 6e4 if dtype == torch.float16 else 1e30  # 1e30 is inf in fp16
    clean = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    x = clean.clone()
    x[2, 5] = huge
    x_hat = roundtrip(codec, x)
    _check_bound(codec, x, x_hat)
    others = [0, 1, 3]
    assert_bitwise(x_hat[others], roundtrip(codec, clean)[others])
    if codec in ROWWISE and huge == 1e30:
        # Ordinary values sit far below half a step of a 1e30-scaled row.
        assert bool((x_hat[2, :5] == 0).all()) and bool((x_hat[2, 6:] == 0).all())


@pytest.mark.parametrize("codec", [INT8, INT4], ids=lambda c: c.name)
def test_subnormals_int8_int4_decode_to_zero(codec):
    x = torch.full((3, 8), 1e-40) * torch.tensor([1.0, -1.0]).repeat(4)
    assert bool((x.abs() < torch.finfo(torch.float32).tiny).all())  # really subnormal
    x_hat = roundtrip(codec, x)
    assert_bitwise(x_hat, torch.zeros_like(x))  # integers have no -0: all +0.0
    _check_bound(codec, x, x_hat)


@pytest.mark.parametrize("codec", [c for c in CODECS if c not in (INT8, INT4)], ids=lambda c: c.name)
def test_subnormals_bf16_fp8_keep_a_subnormal(codec):
    x = torch.full((3, 8), 1e-40)
    x_hat = roundtrip(codec, x)
    _check_bound(codec, x, x_hat)
    # Both land on the same step, documented as 1e-40 -> 2**-133.
    assert bool((x_hat == 2.0**-133).all())


@pytest.mark.parametrize("codec,dtype", cases())
def test_subnormals_of_each_dtype_within_bound(codec, dtype):
    tiny = torch.finfo(dtype).tiny
    x = (torch.rand(4, 32, generator=torch.Generator().manual_seed(6)) - 0.5) * tiny
    x = x.to(dtype)
    _check_bound(codec, x, roundtrip(codec, x))


@pytest.mark.parametrize("codec,dtype", cases())
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), ()], ids=str)
def test_empty_and_scalar_tensors(codec, dtype, shape):
    x = torch.full(shape, 1.5, dtype=dtype) if shape == () else torch.empty(shape, dtype=dtype)
    parts = codec.encode(x)
    assert sum(p.nbytes for p in parts) == codec.encoded_nbytes(shape, dtype)
    x_hat = codec.decode(parts, dtype)
    assert x_hat.shape == x.shape and x_hat.dtype == dtype
    _check_bound(codec, x, x_hat)


# ---- non-finite input --------------------------------------------------------


@pytest.mark.parametrize("codec,dtype", cases())
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=str)
def test_eager_encode_refuses_non_finite(codec, dtype, bad):
    x = torch.randn(3, 8).to(dtype)
    x[1, 2] = bad
    with pytest.raises(NonFiniteError, match="store this unit instead") as info:
        codec.encode(x)
    assert info.value.codec == codec.name and repr(codec.name) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bf16_overflow_of_finite_fp32_is_refused():
    x = torch.tensor([[1.0, 3.4e38]])
    assert bool(torch.isfinite(x).all())
    with pytest.raises(NonFiniteError, match="overflow"):
        BF16.encode(x)
    BF16.encode(torch.tensor([[3.38e38]]))  # just under the limit: fine


# ---- sizes -------------------------------------------------------------------


@pytest.mark.parametrize("codec,dtype", cases())
@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 4, 5)], ids=str)
def test_encoded_nbytes_matches_parts(codec, dtype, shape):
    parts = codec.encode(torch.randn(shape).to(dtype))
    assert codec.encoded_nbytes(shape, dtype) == sum(p.nbytes for p in parts)


@pytest.mark.parametrize("codec,dtype", cases())
def test_encoded_nbytes_expr_is_symbolic(codec, dtype):
    B, S = sympy.symbols("B S", positive=True, integer=True)
    expr = codec.encoded_nbytes_expr((B, S, 64), dtype)
    assert expr.free_symbols == {B, S}
    for b, s in [(2, 3), (5, 17)]:
        assert int(expr.subs({B: b, S: s})) == codec.encoded_nbytes((b, s, 64), dtype)
    expected = {"bf16": 128 * B * S, "int8": 68 * B * S, "fp8": 68 * B * S, "int4": 36 * B * S}[codec.name]
    assert sympy.simplify(expr - expected) == 0
    with pytest.raises(ValueError, match="symbolic"):
        codec.encoded_nbytes((B, 64), dtype)


# ---- registry and dtypes -----------------------------------------------------


def test_registry_lookup_and_order():
    names = codec_names()
    assert names[:2] == ["bf16", "int8"]
    assert ("fp8" in names) == FP8.available("cpu")
    for name in names:
        assert get_codec(name).name == name
    assert get_codec("int8") is INT8


def test_unknown_codec_lists_known_ones():
    with pytest.raises(ValueError, match=r"unknown codec 'zstd'.*bf16, int8, fp8"):
        get_codec("zstd")


def test_register_codec_refuses_a_second_codec_under_a_name():
    assert register_codec(INT8) is INT8  # the same object again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_codec(Int8Codec())
    with pytest.raises(TypeError):
        register_codec("int8")  # type: ignore[arg-type]
    assert get_codec("int8") is INT8


def test_supports_and_dtype_errors():
    assert [BF16.supports(d) for d in FLOATS] == [True, False, False]  # nothing saved
    for codec in (INT8, FP8):
        assert all(codec.supports(d) for d in FLOATS)
        assert not codec.supports(torch.float64) and not codec.supports(torch.int32)
    with pytest.raises(TypeError, match="bf16"):
        BF16.encode(torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        INT8.encoded_nbytes((2, 2), torch.int64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_fp8_unavailable_on_missing_device():
    assert FP8.available("cuda") is False
    assert "fp8" not in codec_names("cuda")
