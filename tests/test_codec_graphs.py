"""Codecs as fx graph builders: the ops they insert match eager bit for bit, alone, split
across forward and backward graphs, and compiled by Inductor."""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from hilore_compiler.codecs import BF16, CODEC_META_KEY, INT8, Codec

from codec_cases import CODECS, ROWWISE, assert_bitwise, cases, roundtrip, x_with_bad_rows


def _codec_graph(codec: Codec, val: torch.Tensor) -> torch.fx.GraphModule:
    """placeholder -> encode -> decode -> output (*parts, decoded)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = val
    parts = codec.graph_encode(graph, x)
    out = codec.graph_decode(graph, parts, val.dtype)
    graph.output((*parts, out))
    graph.lint()
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _inserted(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("codec,dtype", cases())
@pytest.mark.parametrize("shape", [(3, 5, 32), (4, 0), ()], ids=str)
def test_graph_matches_eager_bit_for_bit(codec, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 4).to(dtype)
    with FakeTensorMode() as mode:
        pass
    gm = _codec_graph(codec, mode.from_tensor(x))
    *parts, x_hat = gm(x)
    eager_parts = codec.encode(x)
    for got, want in zip(parts, eager_parts, strict=True):
        assert_bitwise(got, want)
    assert_bitwise(x_hat, codec.decode(eager_parts, dtype))
    # meta["val"] says what the nodes really produce.
    out_nodes = gm.graph.output_node().args[0]
    for node, real in zip(out_nodes, (*parts, x_hat), strict=True):
        val = node.meta["val"]
        assert isinstance(val, FakeTensor)
        assert (val.shape, val.dtype) == (real.shape, real.dtype)
        assert node.meta["tensor_meta"].dtype == real.dtype


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_graph_uses_only_decomposed_ops_and_tags_them(codec):
    gm = _codec_graph(codec, torch.empty(4, 8, device="meta"))  # meta vals work too
    nodes = _inserted(gm)
    assert nodes, "the codec inserted nothing"
    for node in nodes:
        assert isinstance(node.target, torch._ops.OpOverload)
        assert node.target.namespace in ("aten", "prims")
        assert node.target is not torch.ops.aten._to_copy.default
        assert node.meta[CODEC_META_KEY] in (f"{codec.name}.encode", f"{codec.name}.decode")
        assert node.meta["val"].device.type == "meta"


@pytest.mark.parametrize("codec,dtype", cases())
def test_graph_non_finite_rows_decode_to_nan(codec, dtype):
    x = x_with_bad_rows(dtype)
    *parts, x_hat = _codec_graph(codec, FakeTensorMode().from_tensor(x))(x)
    finite_rows = [0, 2, 4]
    assert_bitwise(x_hat[finite_rows], roundtrip(codec, x[finite_rows]))
    if codec in ROWWISE:
        assert bool(x_hat[[1, 3]].isnan().all())  # the whole row, never garbage
        *payload, scale = parts  # documented: the payload of 0s, scale NaN
        zero = codec.encode(torch.zeros(1, x.shape[-1], dtype=dtype))[:-1]
        assert all(torch.equal(p[[1, 3]], z.expand(2, -1)) for p, z in zip(payload, zero))
        assert bool(scale[[1, 3]].isnan().all()) and bool(scale[finite_rows].isfinite().all())
    else:  # bf16 keeps inf/nan elementwise and the rest of the row
        assert_bitwise(x_hat[[1, 3]], x[[1, 3]].to(torch.bfloat16).to(dtype))
        assert x_hat[1, 3] == math.inf and x_hat[3, 9] == -math.inf
        assert bool(x_hat[3, 0].isnan())


@pytest.mark.parametrize("same_block", [False, True], ids=["after+before", "after"])
def test_graph_builders_insert_at_the_callers_point(same_block):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.empty(4, 8))
        relu = graph.call_function(torch.ops.aten.relu.default, (x,))
        relu.meta["val"] = torch.ops.aten.relu.default(x.meta["val"])
    neg = graph.call_function(torch.ops.aten.neg.default, (relu,))
    graph.output((neg,))
    with graph.inserting_after(relu):
        parts = INT8.graph_encode(graph, relu)
        if same_block:  # the point moved past the encode nodes
            decoded = INT8.graph_decode(graph, parts, torch.float32)
    if not same_block:
        with graph.inserting_before(neg):
            decoded = INT8.graph_decode(graph, parts, torch.float32)
    neg.replace_input_with(relu, decoded)
    order = [n.name for n in graph.nodes]
    assert order[:2] == ["x", "relu_default"] and order[-2:] == ["neg_default", "output"]
    graph.lint()  # topological order holds
    t = torch.randn(4, 8)
    (got,) = torch.fx.GraphModule(torch.nn.Module(), graph)(t)
    assert_bitwise(got, -roundtrip(INT8, t.relu()))


def test_graph_encode_needs_meta_val_and_supported_dtype():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with pytest.raises(ValueError, match="meta\\['val'\\]"):
        INT8.graph_encode(graph, x)
    x.meta["val"] = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    with pytest.raises(TypeError):
        BF16.graph_encode(graph, x)


def _split_graphs(codec: Codec, val: torch.Tensor) -> tuple[torch.fx.GraphModule, ...]:
    """Encode and decode as separate graphs, as forward and backward are."""
    fw = torch.fx.Graph()
    x = fw.placeholder("x")
    x.meta["val"] = val
    fw.output(codec.graph_encode(fw, x))
    bw = torch.fx.Graph()
    saved = []
    for i, part in enumerate(fw.output_node().args[0]):
        saved.append(bw.placeholder(f"part{i}"))
        saved[-1].meta["val"] = part.meta["val"]
    bw.output((codec.graph_decode(bw, saved, val.dtype),))
    return tuple(torch.fx.GraphModule(torch.nn.Module(), g) for g in (fw, bw))


def _check_split(codec: Codec, fw, bw, x: torch.Tensor) -> None:
    parts = fw(x)
    (x_hat,) = bw(*parts)
    finite_rows = [0, 2, 4]
    for got, want in zip(parts, codec.encode(x[finite_rows]), strict=True):
        assert_bitwise(got[finite_rows], want)
    assert_bitwise(x_hat[finite_rows], roundtrip(codec, x[finite_rows]))
    nan_rows = x_hat[[1, 3]].isnan() if codec in ROWWISE else x_hat[[1, 3]].isfinite()
    assert int(nan_rows.sum()) == (32 if codec in ROWWISE else 29)


@pytest.mark.parametrize("codec,dtype", cases())
def test_graph_encode_and_decode_in_separate_graphs(codec, dtype):
    x = x_with_bad_rows(dtype)
    fw, bw = _split_graphs(codec, FakeTensorMode().from_tensor(x))
    _check_split(codec, fw, bw, x)


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_inductor_compiles_codec_graphs_bit_for_bit(codec):
    """Inductor lowers every inserted op and keeps the eager numbers.

    Encode and decode are compiled apart, as in the forward/backward split:
    fused into one kernel, Inductor would skip the fp32 -> bf16 -> fp32
    round trip (see ``emulate_precision_casts``), which the saved tensor
    between the two graphs prevents.
    """
    from torch._inductor.compile_fx import compile_fx

    x = x_with_bad_rows(torch.float32)
    fw, bw = _split_graphs(codec, FakeTensorMode().from_tensor(x))
    fw_c = compile_fx(fw, [x])
    bw_c = compile_fx(bw, list(fw(x)))
    _check_split(codec, lambda t: tuple(fw_c(t)), bw_c, x)
