"""Traces of deep Hugging Face models from their first four layers (``passes/depth.py``):
the same trace as capturing every layer. (That a plan from four measured layers
applies strictly to the whole model: ``tests/test_hf_bench.py``.)"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hilore_compiler import cli
from hilore_compiler.passes.depth import DepthError, DepthMap, extend_units, key_layer, stack_differs, with_layer
from hilore_compiler.tracefile import load_trace

pytest.importorskip("transformers")
pytest.importorskip("peft")

LAYERS = 6
QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": LAYERS,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128,
         "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """The LoRA model traced (roofline, fp32) from four layers and from all six."""
    root = tmp_path_factory.mktemp("depth")
    config = root / "qwen2.json"
    config.write_text(json.dumps(QWEN2))
    out = {"config": config}
    for name, options in {"auto": [], "all": ["--capture-layers", "all"], "cut": ["--layers", "4"]}.items():
        out[name] = root / f"{name}.json"
        assert cli.main(["trace", "--model", f"hf:{config}", "--lora", "4", "--dtype", "float32", "--batch", "2",
                         "--seq-len", "32", "--cost-model", "roofline:h100", *options, "-o", str(out[name])]) == 0
    return out


def test_four_captured_layers_give_the_trace_of_all_six(traces):
    cut, full = load_trace(traces["auto"]), load_trace(traces["all"])
    assert cut.num_layers == full.num_layers == LAYERS
    assert any("captured the first 4 of 6 layers" in n for n in cut.notes)
    # Unit for unit: keys, what each reads, bytes, costs; and every total.
    assert cut.units == full.units
    for name in ("gc_bytes", "store_bytes", "output_bytes", "param_bytes", "partial_grad_bytes", "block_classes",
                 "frozen_param_bytes", "model", "batch", "seq_len", "cost_source"):
        assert getattr(cut, name) == getattr(full, name), name
    # Every layer reads layer 0's attention mask, whatever layer it was made from.
    last_sdpa = next(u for u in cut.units if u.key == f"model.layers.{LAYERS - 1}.self_attn:sdpa:0")
    assert "model.layers.0.self_attn:where:0" in last_sdpa.recompute_from
    assert cut.fingerprint != full.fingerprint  # it names the extension


def test_mixed_or_odd_layers_are_captured_whole(traces):
    from hilore_compiler.models import build_model

    with torch.device("meta"):
        policy = build_model(f"hf:{traces['config']}")
    assert stack_differs(policy.layers) is None
    assert stack_differs(policy.layers, ["full_attention", "sliding_attention"] * 3) \
        == "its layer types differ (full_attention, sliding_attention)"
    assert stack_differs(policy.layers[:4]) == "4 layers: captured as they are"
    with torch.device("meta"):
        policy.layers[LAYERS - 1].mlp.up_proj = torch.nn.Linear(32, 96, bias=False)
    assert stack_differs(policy.layers) == f"layer {LAYERS - 1} is built unlike layer 1"


def test_the_command_line_says_why_it_captures_every_layer(traces, tmp_path, capsys):
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({**QWEN2, "layer_types": ["full_attention", "sliding_attention"] * 3,
                                 "use_sliding_window": True, "sliding_window": 16}))
    assert cli.main(["trace", "--model", f"hf:{mixed}", "--batch", "2", "--seq-len", "32",
                     "--cost-model", "roofline:h100", "-o", str(tmp_path / "t.json")]) == 0
    assert "capturing all 6 layers: its layer types differ" in capsys.readouterr().err
    assert not any("captured the first" in n for n in load_trace(tmp_path / "t.json").notes)


def test_keys_move_between_layers_and_unlike_middle_layers_are_refused(traces):
    assert key_layer("model.layers.12.mlp.up_proj:mm:0") == 12 and key_layer("model.norm:rsqrt:0") is None
    assert with_layer("model.layers.2:add:1", 30) == "model.layers.30:add:1"
    assert [DepthMap(8).template(i) for i in range(8)] == [0, 1, 2, 2, 2, 2, 2, 3]
    cut, full = load_trace(traces["cut"]), load_trace(traces["all"])
    assert extend_units(cut.units, DepthMap(LAYERS), cut.block_classes) == list(full.units)
    cut = cut.units
    with pytest.raises(DepthError, match="layers 1 and 2 are not one block class"):
        extend_units(cut, DepthMap(8), {"c0": (0,), "c1": (1,), "c2": (2, 3)})
    with pytest.raises(ValueError, match="extends 4 captured layers to more"):
        DepthMap(4)
    moved = [dataclasses.replace(u, recompute_from=("model.layers.2.nowhere:mm:0",)) if u.layer == 3 else u
             for u in cut]
    with pytest.raises(DepthError, match="which the full stack does not have"):
        extend_units(moved, DepthMap(8), {"c0": (0,), "c1": (1, 2), "c2": (3,)})
    far = [dataclasses.replace(u, recompute_from=("model.layers.2:add:1",)) if u.layer == 0 else u for u in cut]
    with pytest.raises(DepthError, match="names captured layer 2 from afar"):
        extend_units(far, DepthMap(8), {"c0": (0,), "c1": (1, 2), "c2": (3,)})
