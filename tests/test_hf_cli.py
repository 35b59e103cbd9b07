"""``--model hf:CONFIG`` for ``hilore trace`` and ``hilore calibrate``, whether a plan fits
its card, and ``hilore show PLAN --plot``: configs written here as local JSON, nothing downloaded."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hilore_compiler import cli
from hilore_compiler.devices import DEVICES, GiB
from hilore_compiler.planload import load_plan
from hilore_compiler.solver import fixed_plan, format_bytes, parse_budget, solve, uniform_codec
from hilore_compiler.solver.devicefit import device_fits, fit_lines, training_state
from hilore_compiler.solver.memory import simulate
from hilore_compiler.solver.planner import prepare
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace
from hilore_compiler.solver.timeline import memory_timeline, plan_series
from hilore_compiler.tracefile import load_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
SMALL = SyntheticConfig(num_layers=3, hidden=64, intermediate=172, heads=4, kv_heads=2, vocab=128,
                        batch=2, seq_len=16)

#: Tiny configs of the two families the paper's runs use.
QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128,
         "tie_word_embeddings": True}
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
#: Qwen2.5-3B-Instruct's config.json, the fields that shape the model.
QWEN25_3B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 36,
             "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16, "num_key_value_heads": 2,
             "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768,
             "rope_theta": 1000000.0, "rms_norm_eps": 1e-06}


def said(plan) -> str:
    """``fit_lines`` as one line, its wrapping undone."""
    return " ".join(" ".join(fit_lines(plan)).split())


def config_file(root: Path, fields: dict) -> Path:
    """``fields`` as a local ``.json`` config file."""
    path = root / f"{fields['model_type']}-{fields['num_hidden_layers']}.json"
    path.write_text(json.dumps(fields))
    return path


def config_dir(root: Path, fields: dict) -> Path:
    """``fields`` as a folder with ``config.json``, as a downloaded model has."""
    folder = root / f"{fields['model_type']}-{fields['num_hidden_layers']}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


# --------------------------------------------------------------- building
def test_parse_model_arg_names_what_is_built():
    from hilore_compiler.models.hf_config import DEFAULT_LORA_TARGETS, parse_model_arg

    spec = parse_model_arg("hf:Qwen/Qwen2.5-3B-Instruct", lora=16)
    assert (spec.name_or_path, spec.lora, spec.alpha, spec.lora_targets) == (
        "Qwen/Qwen2.5-3B-Instruct", 16, 32.0, DEFAULT_LORA_TARGETS)
    assert spec.describe(36) == "hf:Qwen/Qwen2.5-3B-Instruct (36 layers, LoRA r=16 on q,k,v,o,gate,up,down)"
    assert parse_model_arg("hf:x").describe(2) == "hf:x (2 layers)"
    for bad in (dict(text="small"), dict(text="hf:"), dict(text="hf:x", lora=0), dict(text="hf:x", layers=0)):
        with pytest.raises(ValueError):
            parse_model_arg(**bad)


def test_config_is_cut_to_layers_with_cache_and_dropout_off(tmp_path):
    pytest.importorskip("transformers")
    from hilore_compiler.models.hf_config import load_config, parse_model_arg

    path = config_file(tmp_path, {**QWEN2, "num_hidden_layers": 6, "attention_dropout": 0.1})
    config = load_config(parse_model_arg(f"hf:{path}", layers=3))
    assert config.num_hidden_layers == 3 and len(config.layer_types) == 3  # qwen2 keeps layer_types
    assert config.use_cache is False and config.attention_dropout == 0.0
    with pytest.raises(ValueError, match="more than the config's 6 layers"):
        load_config(parse_model_arg(f"hf:{path}", layers=7))
    (tmp_path / "no-type.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type"):
        load_config(parse_model_arg(f"hf:{tmp_path / 'no-type.json'}"))


def test_lora_adapters_initialise_on_meta_and_alone_are_trained(tmp_path):
    """PEFT builds the adapters on the device of the layer they wrap: on meta, nothing is allocated."""
    pytest.importorskip("peft")
    import torch

    from hilore_compiler.models.hf_config import build_from_config, load_config, parse_model_arg
    from hilore_compiler.passes.tracer import frozen_parameter_bytes

    spec = parse_model_arg(f"hf:{config_dir(tmp_path, QWEN2)}", lora=4)
    model = build_from_config(spec, load_config(spec), device="meta", dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert {p.device.type for p in params.values()} == {"meta"}
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # r x (in + out) per wrapped projection, 7 per layer, float32 (PEFT's adapter dtype)
    h, i, kv = QWEN2["hidden_size"], QWEN2["intermediate_size"], QWEN2["hidden_size"] // 2
    per_layer = 4 * ((h + h) * 2 + (h + kv) * 2 + (h + i) * 3)
    assert sum(params[n].numel() for n in trained) == 2 * per_layer
    assert frozen_parameter_bytes(model) == 2 * sum(p.numel() for p in params.values() if not p.requires_grad)


def test_built_in_models_take_no_hf_options(tmp_path, capsys):
    out = str(tmp_path / "t.json")
    assert cli.main(["trace", "--model", "tiny", "--lora", "4", "-o", out]) == 2
    assert "--lora shape(s) an hf: model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["trace", "--model", "tinyy", "-o", out])
    assert "invalid choice: 'tinyy'" in capsys.readouterr().err


# ---------------------------------------------------- timeline and device fit
@pytest.fixture(scope="module")
def planned():
    """A 3-layer synthetic trace priced for an L40S, with trained and frozen parameter bytes, and its plan."""
    trace = dataclasses.replace(synthetic_trace(SMALL), cost_source="roofline:l40s",
                                param_bytes={"layer 0": 4096, "layer 1": 4096, "layer 2": 4096, "outside": 8192},
                                frozen_param_bytes=1 << 20)
    return trace, solve(trace, "1.05x-gc", buckets=2)


def test_timeline_peaks_at_each_prediction(planned, tmp_path):
    trace, plan = planned
    _, model = prepare(trace, codecs=plan.codecs, batch=plan.batch, seq_len=plan.seq_len)
    saved = load_plan(plan.save(tmp_path / "plan.json"))
    timeline = saved.timeline
    assert timeline.phases[0].startswith("forward of") and "loss" in timeline.phases
    assert timeline.phases[-1] == "end of backward"
    assert [p for p in timeline.phases if p.startswith("backward of layer")] == [
        "backward of layer 2", "backward of layer 1", "backward of layer 0"]
    assert max(timeline.bytes["gc"]) == saved.gc_bytes
    assert max(timeline.bytes["store-all"]) == saved.store_bytes
    for b in saved.buckets:
        if not b.skip:
            predicted = simulate(model, dict(b.decisions)).memory_bytes
            assert max(timeline.bytes[b.bucket.name]) == b.memory_bytes == predicted
    # forward rises layer by layer; the loss holds every kept byte
    forward = timeline.bytes["store-all"][:timeline.phases.index("loss")]
    assert list(forward) == sorted(forward) and forward[-1] > forward[0]
    # and for any decisions, not only solved ones
    int8 = {u.key: uniform_codec("int8")(u) for u in model.units}
    assert max(b for _, b in plan_series(model, int8)) == simulate(model, int8).memory_bytes
    assert memory_timeline(trace, model, {}).bytes.keys() == {"gc", "store-all"}


def test_a_plan_whose_timeline_disagrees_is_never_written(planned, tmp_path):
    from hilore_compiler.jsonio import FormatError

    _, plan = planned
    bad = dataclasses.replace(plan, timeline=dataclasses.replace(
        plan.timeline, bytes={**plan.timeline.bytes, "gc": tuple(b + 1 for b in plan.timeline.bytes["gc"])}))
    with pytest.raises(FormatError, match="timeline.bytes.gc: peaks at"):
        bad.save(tmp_path / "bad.json")


def test_show_plot_draws_the_memory_over_the_step(planned, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _, plan = planned
    path = plan.save(tmp_path / "plan.json")
    png = tmp_path / "memory.png"
    assert cli.main(["show", str(path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out
    from hilore_compiler.commands.memplot import ceilings, drawn_series

    lines = drawn_series(load_plan(path))
    assert {"GC", "store-all"} < set(lines) and any(k.startswith("HiLoRe b") for k in lines)
    assert all(max(v) == load_plan(path).bucket(k.split()[1].rstrip(",")).memory_bytes
               for k, v in lines.items() if k.startswith("HiLoRe"))
    assert any("L40S" in k for k in ceilings(load_plan(path)))
    trace_path = tmp_path / "trace.json"
    planned[0].save(trace_path)
    assert cli.main(["show", str(trace_path), "--plot", str(png)]) == 2  # a trace has no timeline


def test_fit_adds_weights_and_adamw_state_once(planned):
    _, plan = planned
    state = training_state(plan)
    trained = 4096 * 3 + 8192
    assert (state.trained_bytes, state.frozen_bytes) == (trained, 1 << 20)
    assert state.total_bytes == (1 << 20) + 3 * trained  # weights + exp_avg + exp_avg_sq; gradients are in the peak
    (names, fit), *_ = device_fits(plan)
    assert fit.fits and fit.device is DEVICES["l40s"] and fit.total_bytes == fit.peak_bytes + state.total_bytes
    assert "fits an L40S (48.00 GiB): peak" in said(plan)


def test_a_plan_too_big_for_its_card_says_by_how_much_and_the_budget_that_would_fit(planned):
    _, plan = planned
    peak = max(b.memory_bytes for b in plan.buckets)
    trained = training_state(plan).trained_bytes
    # the state leaves the step half its predicted peak
    big = dataclasses.replace(plan, frozen_param_bytes=48 * GiB - 3 * trained - peak // 2)
    text = said(big)
    assert f"does not fit an L40S (48.00 GiB) by {format_bytes(peak - peak // 2)}" in text
    budget = parse_budget(text.split("--budget ")[1].split()[0]).bytes_at(gc_bytes=0, store_bytes=0)
    assert 0.99 * (peak // 2) <= budget <= peak // 2
    worse = dataclasses.replace(plan, frozen_param_bytes=48 * GiB)
    assert "the training state alone does not fit" in said(worse)
    measured = dataclasses.replace(plan, cost_source="measured")
    assert fit_lines(measured) == []


def test_plan_takes_a_byte_budget_and_prints_the_fit(planned, tmp_path, capsys):
    trace, _ = planned
    trace_path = trace.save(tmp_path / "trace.json")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", str(trace_path), "--budget", "40GiB", "--buckets", "2", "-o", str(out)]) == 0
    plan = load_plan(out)
    assert plan.budget == "40GiB" and plan.budget_bytes == 40 * GiB
    assert all(b.memory_bytes <= plan.budget_bytes for b in plan.buckets)
    assert "fits an L40S (48.00 GiB)" in capsys.readouterr().out
    assert cli.main(["show", str(out)]) == 0
    assert "fits an L40S (48.00 GiB): peak" in capsys.readouterr().out


def test_traces_without_frozen_bytes_still_load_and_plan():
    trace = load_trace(TRACES / "small-cpu-T2048.json")
    assert trace.frozen_param_bytes is None
    plan = fixed_plan(trace, uniform_codec("int8"), buckets=1)  # no ILP: the records alone
    assert plan.frozen_param_bytes is None and plan.trained_param_bytes == sum(trace.param_bytes.values())
    assert fit_lines(plan) == []  # measured on a CPU: no card to fit


# ------------------------------------------------------------ the CLI end to end
#: (config, as a file or folder, cost model, LoRA rank): each family on meta and on the CPU, full and LoRA.
RUNS = [(QWEN2, "dir", "roofline:l40s", 4), (QWEN2, "file", "measured", None),
        (LLAMA, "file", "roofline:l40s", None), (LLAMA, "dir", "measured", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("fields,form,cost,lora", RUNS,
                         ids=["qwen2-meta-lora", "qwen2-cpu-full", "llama-meta-full", "llama-cpu-lora"])
def test_trace_plan_show_of_an_hf_config(tmp_path, capsys, fields, form, cost, lora):
    pytest.importorskip("peft")
    config = (config_dir if form == "dir" else config_file)(tmp_path, fields)
    trace_path, plan_path = tmp_path / "t.json", tmp_path / "p.json"
    args = ["trace", "--model", f"hf:{config}", "--seq-len", "32", "--repeats", "1", "--cost-model", cost,
            "-o", str(trace_path)]
    assert cli.main(args + (["--lora", str(lora)] if lora else [])) == 0
    trace = load_trace(trace_path)
    lora_text = f", LoRA r={lora} on q,k,v,o,gate,up,down" if lora else ""
    assert trace.model == f"hf:{config} (2 layers{lora_text})"
    assert trace.num_layers == 2 and trace.cost_source == cost and trace.frozen_param_bytes is not None
    assert (trace.frozen_param_bytes > 0) == bool(lora)
    assert any(f"{fields['model_type'].capitalize()}" in n and "built from its config alone" in n for n in trace.notes)
    assert cli.main(["plan", str(trace_path), "--buckets", "2", "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert cli.main(["show", str(trace_path)]) == 0
    shown = capsys.readouterr().out
    assert f"== trace: hf:{config} (2 layers{lora_text})" in shown
    assert f"device {cost.partition(':')[2] or 'cpu'}; costs: {cost}" in shown
    assert cli.main(["show", str(plan_path)]) == 0
    shown = capsys.readouterr().out
    assert (lora_text in shown) and (("fits an L40S" in shown) == (cost != "measured"))


@pytest.mark.slow
def test_calibrate_an_hf_lora_model(tmp_path):
    pytest.importorskip("peft")
    config = config_file(tmp_path, QWEN2)
    out = tmp_path / "c.json"
    assert cli.main(["calibrate", "--model", f"hf:{config}", "--lora", "4", "--seq-len", "16",
                     "--codecs", "int8", "-o", str(out)]) == 0
    trace = load_trace(out)
    assert trace.model == f"hf:{config} (2 layers, LoRA r=4 on q,k,v,o,gate,up,down)"
    assert sum(bool(u.sensitivity) for u in trace.units) > len(trace.units) // 2


@pytest.mark.slow
def test_the_papers_setting_qwen25_3b_lora_on_an_l40s(tmp_path):
    """Qwen2.5-3B, LoRA r=16, bf16, 2 x 3072 tokens, priced for an L40S: the three commands
    as a user runs them, each timed (printed with -s)."""
    pytest.importorskip("peft")
    folder = config_dir(tmp_path, QWEN25_3B)
    trace_path, plan_path = tmp_path / "t.json", tmp_path / "p.json"
    commands = {
        "trace": ["trace", "--model", f"hf:{folder}", "--lora", "16", "--dtype", "bfloat16", "--batch", "2",
                  "--seq-len", "3072", "--cost-model", "roofline:l40s", "-o", str(trace_path)],
        "plan": ["plan", str(trace_path), "--budget", "1.10x-gc", "-o", str(plan_path)],
        "show": ["show", str(plan_path), "--plot", str(tmp_path / "memory.png")],
    }
    outputs = {}
    for name, args in commands.items():
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "hilore_compiler", *args], capture_output=True, text=True)
        print(f"hilore {name}: {time.perf_counter() - start:.1f} s wall")
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[name] = done.stdout
    trace = load_trace(trace_path)
    assert trace.num_layers == 36 and trace.frozen_param_bytes is not None
    # 3.09e9 bf16 base weights (tied embedding once); 29.9e6 float32 adapters
    assert math.isclose(trace.frozen_param_bytes, 2 * 3.086e9, rel_tol=0.01)
    assert math.isclose(sum(trace.param_bytes.values()), 4 * 36 * 831_488, rel_tol=1e-6)
    shown = outputs["show"]
    assert "hf:" in shown and "(36 layers, LoRA r=16 on q,k,v,o,gate,up,down)" in shown
    assert "costs: roofline:l40s" in shown and "an L40S (48.00 GiB)" in shown
    assert ("fits an L40S" in shown) != ("does not fit an L40S" in shown)
