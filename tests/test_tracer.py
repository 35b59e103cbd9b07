"""The tracer: recovery units cover what min-cut saves, keys are stable, sizes are symbolic."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import sympy
import torch

from hilore_compiler.jsonio import FormatError
from hilore_compiler.models import build_model, token_logprobs
from hilore_compiler.passes.annotate import annotate_units, is_activation
from hilore_compiler.passes.capture import capture_joint_graphs
from hilore_compiler.tracefile import eval_size, load_trace
from hilore_compiler.passes.tracer import TraceConfig, trace

CONFIG = TraceConfig(model_name="tiny", repeats=1, warmup=0, verbose=False)


def _loss(ids):
    return lambda logits: -token_logprobs(logits, ids).mean()


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_trace():
    model = build_model("tiny")
    ids = _ids(2, 32)
    return trace(model, [ids], _loss(ids), config=CONFIG)


@pytest.fixture(scope="module")
def tiny_trace_other_shape():
    """A batch-1 example: traced at batch 2 so that sizes keep the symbol B."""
    model = build_model("tiny")
    ids = _ids(1, 20)
    return trace(model, [ids], _loss(ids), config=CONFIG)


def test_units_cover_every_saved_activation_byte():
    model = build_model("tiny")
    ids = _ids(2, 32)
    (capture,) = capture_joint_graphs(model, [ids], _loss(ids))
    nodes = {n.name: n for n in capture.joint.graph.nodes}
    saved = [nodes[name] for name in capture.saved_names if is_activation(nodes[name])]
    expected = sum(capture.values[n.name].numel() * capture.values[n.name].element_size() for n in saved)
    units = annotate_units(capture.joint, capture.saved_names)
    covered = {n.name for u in units for n in u.saved}
    assert covered == {n.name for n in saved}
    unit_bytes = sum(capture.values[n.name].nbytes for u in units for n in u.saved)
    assert expected > 0 and unit_bytes == expected


def test_trace_bytes_match_real_tensors(tiny_trace):
    assert tiny_trace.batch == 2 and tiny_trace.seq_len == 32
    assert len(tiny_trace.units) > 10
    for unit in tiny_trace.units:
        assert eval_size(unit.bytes, 2, 32) == unit.bytes_at_trace > 0
        assert unit.recompute_time_s >= 0
        assert set(unit.recompute_from) <= {u.key for u in tiny_trace.units}


def test_sympy_bytes_evaluate_to_sizes_at_a_second_shape(tiny_trace, tiny_trace_other_shape):
    other = {u.key: u for u in tiny_trace_other_shape.units}
    assert set(other) == {u.key for u in tiny_trace.units}
    for unit in tiny_trace.units:
        assert eval_size(unit.bytes, 2, 20) == other[unit.key].bytes_at_trace, unit.key
    assert tiny_trace.fingerprint == tiny_trace_other_shape.fingerprint


def test_batch_one_trace_keeps_the_batch_symbol(tiny_trace_other_shape):
    t = tiny_trace_other_shape
    assert t.batch == 2 and any("batch 2 from a batch-1" in n for n in t.notes)
    sdpa = next(u for u in t.units if "sdpa" in u.kind)
    assert "B" in sdpa.bytes and eval_size(sdpa.bytes, 4, 20) == 2 * eval_size(sdpa.bytes, 2, 20)


def test_trace_records_outputs_and_parameter_bytes(tiny_trace):
    """The step terms of the memory model: logits bytes as an expression, weights by segment."""
    model = build_model("tiny")
    vocab = model.config.vocab_size
    assert eval_size(tiny_trace.output_bytes, 5, 7) == 5 * 7 * vocab * 4  # (B, S, V) fp32 logits
    assert sum(tiny_trace.param_bytes.values()) == sum(p.numel() * 4 for p in model.parameters())
    # The embedding, read before the layers, is ``inputs``: backward makes its gradient last.
    assert set(tiny_trace.param_bytes) == {"inputs", "outside", "layer 0", "layer 1"}
    assert tiny_trace.param_bytes["inputs"] == model.embed_tokens.weight.numel() * 4
    per_layer = sum(p.numel() * 4 for p in model.layers[0].parameters())
    assert tiny_trace.param_bytes["layer 0"] == per_layer


def test_layers_kinds_and_codecs(tiny_trace):
    layers = {u.layer for u in tiny_trace.units}
    assert {0, 1} <= layers and None in layers
    assert any("mlp" in u.kind for u in tiny_trace.units)
    int8 = [u.codecs["int8"] for u in tiny_trace.units if "int8" in u.codecs and u.codecs["int8"].usable]
    # Row-wise absmax int8 on activations: about 0.5% relative error, worse
    # only for rows with outliers.
    errors = sorted(c.rel_l2 for c in int8)
    assert int8 and 0 < errors[len(errors) // 2] < 0.02 and errors[-1] < 0.2
    assert all(c.source == "measured" for c in int8)
    assert eval_size(tiny_trace.gc_bytes, 2, 32) < eval_size(tiny_trace.store_bytes, 2, 32)


@pytest.mark.slow
def test_codec_time_is_its_compiled_round_trip_per_row_length():
    """A codec is priced at its Inductor-compiled encode + decode, timed once per
    (codec, dtype, row length) and scaled to each encoded tensor's bytes
    (passes/codec_timing.py)."""
    from hilore_compiler.codecs import get_codec
    from hilore_compiler.passes.codec_timing import codec_seconds_per_byte
    from hilore_compiler.passes.profile import ProfileConfig, _codec_measured_seconds

    cpu = torch.device("cpu")
    tensors = [torch.randn(2, 512, 32), torch.randn(2, 512, 48)]  # 128 KB and 192 KB: priced compiled
    rates = [codec_seconds_per_byte("int8", torch.float32, row, cpu) for row in (32, 48)]
    assert all(rate is not None and rate > 0 for rate in rates)
    hits = codec_seconds_per_byte.cache_info().hits
    seconds = _codec_measured_seconds(get_codec("int8"), tensors, sympy.Integer(0), ProfileConfig())
    assert codec_seconds_per_byte.cache_info().hits == hits + 2  # both rows reused, nothing re-timed
    assert seconds == pytest.approx(sum(r * t.numel() * 4 for r, t in zip(rates, tensors)), rel=1e-12)


def test_small_units_are_priced_by_traffic_without_a_compile(monkeypatch):
    from hilore_compiler.codecs import get_codec
    from hilore_compiler.passes import codec_timing, profile

    def must_not_compile(*args):
        raise AssertionError("compiled a codec for a unit under COMPILED_CODEC_MIN_BYTES")

    monkeypatch.setattr(profile, "codec_seconds_per_byte", must_not_compile)
    tensors, payload = [torch.randn(2, 32, 64)], sympy.Integer(2 * 32 * 64 + 2 * 32 * 4)  # 16 KB
    config = profile.ProfileConfig(batch=2, seq_len=32)
    assert profile._codec_measured_seconds(get_codec("int8"), tensors, payload, config) == \
        profile._codec_traffic_seconds(tensors, payload, config)


def test_codec_that_cannot_compile_is_priced_by_traffic_and_said_once(monkeypatch, caplog):
    from hilore_compiler.codecs import get_codec
    from hilore_compiler.passes import codec_timing
    from hilore_compiler.passes.profile import ProfileConfig, _codec_measured_seconds, _codec_traffic_seconds

    def no_compiler(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(codec_timing, "_measure", no_compiler)
    codec_timing.codec_seconds_per_byte.cache_clear()
    codec_timing._warn_once.cache_clear()
    try:
        tensors, payload = [torch.randn(2, 512, 40)], sympy.Integer(2 * 512 * 40 + 2 * 512 * 4)
        config = ProfileConfig(batch=2, seq_len=512)
        with caplog.at_level("WARNING", logger=codec_timing.__name__):
            for _ in range(2):
                seconds = _codec_measured_seconds(get_codec("int8"), tensors, payload, config)
        assert seconds == _codec_traffic_seconds(tensors, payload, config) > 0
        warnings = [r.getMessage() for r in caplog.records if "could not compile codec int8" in r.getMessage()]
        assert len(warnings) == 1 and "no C++ compiler" in warnings[0] and "memory traffic" in warnings[0]
    finally:
        codec_timing.codec_seconds_per_byte.cache_clear()  # later tests time the real kernels


_KEYS_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from hilore_compiler.models import build_model
    from hilore_compiler.passes.annotate import annotate_units
    from hilore_compiler.passes.capture import capture_joint_graphs
    b, s = int(sys.argv[1]), int(sys.argv[2])
    ids = torch.randint(0, 256, (b, s))
    (c,) = capture_joint_graphs(build_model("tiny"), [ids], lambda o: o.float().pow(2).mean(), record_values=False)
    print(json.dumps(sorted(u.key for u in annotate_units(c.joint, c.saved_names))))
""")


@pytest.mark.slow
def test_unit_keys_identical_across_processes_and_shapes(tiny_trace):
    keys = []
    for batch, seq in ((2, 32), (1, 48)):
        out = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT, str(batch), str(seq)],
                             capture_output=True, text=True, check=True)
        keys.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert keys[0] == keys[1] == sorted(u.key for u in tiny_trace.units)


def test_trace_round_trips_through_json(tiny_trace, tmp_path):
    path = tiny_trace.save(tmp_path / "t.json")
    assert load_trace(path) == tiny_trace


def test_bad_trace_files_name_the_problem(tiny_trace, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_trace(bad)
    payload = tiny_trace.to_json()
    bad.write_text(json.dumps({**payload, "schema": "hilore.trace/v0"}))
    with pytest.raises(FormatError, match="expected 'hilore.trace/v1'"):
        load_trace(bad)
    del payload["units"][0]["bytes"]
    bad.write_text(json.dumps(payload))
    with pytest.raises(FormatError, match=r"units\[0\].*missing field 'bytes'"):
        load_trace(bad)


def test_model_without_grad_is_refused():
    model = build_model("tiny").requires_grad_(False)
    ids = _ids(1, 8)
    with pytest.raises(ValueError, match="nothing in the model requires grad"):
        trace(model, [ids], config=CONFIG)


def test_no_grad_mode_is_refused():
    model = build_model("tiny")
    ids = _ids(1, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode is off"):
        trace(model, [ids], config=CONFIG)


class _Breaking(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def forward(self, ids):
        x = torch.tanh(self.layers[0](self.embed(ids)))
        torch._dynamo.graph_break()
        return torch.tanh(self.layers[1](x))


def test_graph_breaks_are_traced_and_reported():
    ids = torch.randint(0, 16, (2, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trace(_Breaking(), [ids], config=CONFIG)
    assert any("graph breaks" in str(w.message) for w in caught)
    assert result.graph_breaks
    # Both graphs contribute units; layer 0 saves only a view of the
    # embedding's output, which is the embedding's unit (one memory, one unit).
    assert any(u.key.startswith("g1/") for u in result.units)
    assert any(not u.key.startswith("g1/") for u in result.units)
    # Layer 1 (graph 1) saves only a view of its graph's input, graph 0's tanh
    # output, whose memory graph 0's unit already holds: no unit of its own,
    # but its weights are attributed to it.
    assert 1 not in {u.layer for u in result.units}
    assert result.param_bytes["layer 1"] == (8 * 8 + 8) * 4


@pytest.mark.slow
def test_trace_command_profiles_the_policy_in_the_dtype_asked(tmp_path, capsys):
    """``hilore trace --dtype bfloat16`` measures a bf16 policy: its units are
    bf16, which the bf16 codec cannot shrink, and the notes say how it was made."""
    from hilore_compiler import cli

    out = tmp_path / "t.json"
    assert cli.main(["trace", "--model", "tiny", "--dtype", "bfloat16", "--batch", "2", "--seq-len", "32",
                     "--codecs", "bf16,int8", "--repeats", "1", "-o", str(out)]) == 0
    result = load_trace(out)
    halves = [u for u in result.units if u.dtype == "bfloat16"]
    assert len(halves) > len(result.units) / 2
    assert not any(u.codecs["bf16"].usable for u in halves)
    assert all(u.codecs["int8"].usable for u in halves)
    # Its kinds (a norm's bf16 output, attention's cast) are not the fp32 graph's:
    # the proxy sensitivity has a measured gain for each, not the fallback.
    from hilore_compiler.solver.risk import PROXY_GAIN
    assert {u.kind for u in halves} <= set(PROXY_GAIN)
    assert any("--dtype bfloat16" in note for note in result.notes)
    # Calibrating it on an fp32 policy would look for units its graph does not have.
    assert cli.main(["calibrate", "--model", "tiny", "--trace", str(out), "-o", str(tmp_path / "c.json")]) != 0
    assert "traced from a bfloat16 policy and --dtype is float32" in capsys.readouterr().err


def test_measured_times_are_summarised_in_every_trace(tiny_trace):
    """``hilore trace`` writes what the backend plans from: medians rounded to the
    resolution ``solver.rounding`` states, so two traces of one graph plan alike."""
    from hilore_compiler.solver.rounding import round_seconds

    times = [u.recompute_time_s for u in tiny_trace.units if u.recompute_source == "measured"]
    times += [c.time_s for u in tiny_trace.units for c in u.codecs.values() if c.source == "measured"]
    assert len(times) > 10
    assert all(t == round_seconds(t) for t in times)


def test_codec_errors_of_large_activations_come_from_a_sample_of_whole_rows():
    """A real-width activation's round-trip error is measured on spread rows, not
    every element, and agrees with the whole tensor's (``profile.error_sample``)."""
    from hilore_compiler import codecs
    from hilore_compiler.passes.profile import ERROR_SAMPLE_ELEMENTS, _codec_error, error_sample

    t = torch.randn(2, 2048, 1024, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 1024)
    sample = error_sample(t)
    assert sample.shape[1] == 1024 and sample.numel() <= ERROR_SAMPLE_ELEMENTS < t.numel()
    assert error_sample(t[0, :16]).shape == (16, 1024)  # small: whole
    for name in ("int8", "int4"):
        codec = codecs.get_codec(name)
        whole = float((codec.decode(codec.encode(t), t.dtype) - t).norm() / t.norm())
        assert _codec_error(codec, [t])[0] == pytest.approx(whole, rel=0.02)


@pytest.mark.slow
def test_one_codec_compile_serves_every_row_length_its_guards_admit():
    """Codecs are compiled with symbolic sizes (passes/codec_timing.py): one
    compile serves rows of any length its guards admit, computes what the
    eager codec does, and a shape it does not admit (int4's odd row, whose
    last nibble is a part of its own) gets a compile of its own."""
    from hilore_compiler.codecs import get_codec
    from hilore_compiler.passes import codec_timing

    int4 = get_codec("int4")
    key = ("int4", "encode", torch.float32)
    codec_timing._COMPILES.pop(key, None)
    for row in (32, 48, 33):
        x = torch.randn(64, row)
        encode = codec_timing._compiled(key, lambda t: int4.encode_unchecked(t), x)
        got, want = encode(x), int4.encode_unchecked(x)
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want)), row
    assert len(codec_timing._COMPILES[key]) == 2  # 32 and 48 share one; 33 needs its own
