"""Hugging Face models in ``hilore bench``: one model reference through every worker, the
model's own gradient checkpointing, and the graph a trainer compiles, so that the
command line's plans apply. Configs are written here; nothing is downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hilore_compiler import cli
from hilore_compiler.models import build_model, model_slug
from hilore_compiler.models.hf_config import DEFAULT_LORA_TARGETS, parse_model_arg, parse_model_ref

pytest.importorskip("transformers")
pytest.importorskip("peft")

QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128,
         "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf-bench") / "qwen2-tiny.json"
    path.write_text(json.dumps(QWEN2))
    return path


def bench_args(*argv: str):
    return cli.build_parser().parse_args(["bench", *argv])


# ------------------------------------------------------------ references

def test_a_model_reference_carries_its_options_and_reads_back(qwen2):
    spec = parse_model_arg(f"hf:{qwen2}", layers=2, lora=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"))
    assert spec.ref() == f"hf:{qwen2}?layers=2&lora=8&alpha=16&targets=q_proj,v_proj"
    assert parse_model_ref(spec.ref()) == spec
    plain = parse_model_arg(f"hf:{qwen2}")
    assert plain.ref() == f"hf:{qwen2}" and parse_model_ref(plain.ref()) == plain
    assert parse_model_ref(f"hf:{qwen2}?lora=4").lora_targets == DEFAULT_LORA_TARGETS
    assert model_slug(spec.ref()) == "hf-qwen2tiny-l2-lora8" and model_slug("small") == "small"
    with pytest.raises(ValueError, match=r"unknown model option 'depth=2'.*layers=\.\.\."):
        parse_model_ref(f"hf:{qwen2}?depth=2")
    with pytest.raises(ValueError, match="--layers must be at least 1"):
        parse_model_ref(f"hf:{qwen2}?layers=0")


@pytest.mark.parametrize("name, widths", [
    ("qwen2.5-0.5b", (24, 896, 4864, 151936, True)), ("Qwen2.5-3B", (36, 2048, 11008, 151936, True)),
    ("llama-3.2-1b", (16, 2048, 8192, 128256, True))])
def test_bundled_configs_give_real_widths_without_a_download(name, widths):
    from hilore_compiler.models.hf_config import bundled_names, config_path, load_config

    assert name.lower() in bundled_names() and config_path(name).is_file()
    config = load_config(parse_model_arg(f"hf:{name}"))
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size,
            config.tie_word_embeddings) == widths
    assert config_path("Org/not-bundled") == Path("Org/not-bundled")  # a hub name stays one


def test_bench_folds_the_hf_options_into_the_model_it_hands_its_workers(qwen2):
    from hilore_compiler.commands.policy import model_ref

    assert model_ref(bench_args("--model", f"hf:{qwen2}", "--layers", "2", "--lora", "4")) \
        == f"hf:{qwen2}?layers=2&lora=4"
    assert model_ref(bench_args("--model", "tiny")) == "tiny"
    assert model_ref(bench_args()) is None  # the bench's own default model
    with pytest.raises(ValueError, match="--lora shape"):
        model_ref(bench_args("--model", "tiny", "--lora", "4"))
    with pytest.raises(ValueError, match="--layers shape"):
        model_ref(bench_args("--layers", "2"))


def test_bench_refuses_an_hf_option_on_a_built_in_model_in_one_line(capsys):
    assert cli.main(["bench", "--model", "tiny", "--lora", "4"]) == 2
    assert "--lora shape(s) an hf: model; tiny is built in" in capsys.readouterr().err


# ------------------------------------------------------------ the policy

def test_an_hf_policy_gives_the_lms_logits_and_checkpoints_through_its_own_gc(qwen2):
    """GC through the model's own gradient checkpointing: the gradients of the
    step without it, fewer bytes saved for backward (the layers' insides are recomputed)."""
    from transformers import Qwen2ForCausalLM

    policy = build_model(f"hf:{qwen2}", seed=3)
    ids = torch.randint(0, QWEN2["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(policy(ids), Qwen2ForCausalLM.forward(policy, input_ids=ids).logits)
    torch.testing.assert_close(policy.lm_head(policy.hidden_states(ids)), policy(ids))
    assert isinstance(policy, Qwen2ForCausalLM) and type(policy).__name__ == "Qwen2ForCausalLM"
    assert len(policy.layers) == 6 and policy.config.vocab_size == 128
    assert policy.policy_name == f"hf:{qwen2} (6 layers)"
    # Module paths are the model's own: what hilore trace --model hf:... keys its units by.
    assert "model.layers.0.mlp.up_proj.weight" in dict(policy.named_parameters())

    def step() -> tuple[list[torch.Tensor], int]:
        saved = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        policy.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = policy(ids).float().log_softmax(-1).pow(2).mean()
        loss.backward()
        return [p.grad.clone() for p in policy.parameters()], sum(saved)

    grads, stored = step()
    assert policy.checkpoint_layers(every=2) is policy
    assert [layer.gradient_checkpointing for layer in policy.layers] == [False, True] * 3
    policy.checkpoint_layers()
    assert all(layer.gradient_checkpointing for layer in policy.layers)
    gc_grads, gc_stored = step()
    for a, b in zip(gc_grads, grads):
        torch.testing.assert_close(a, b)
    assert gc_stored < 0.7 * stored


def test_gc_int8_says_it_wraps_built_in_layers_only(qwen2):
    from hilore_compiler.bench.checkpointing import wrap_layers_int8

    with pytest.raises(ValueError, match="Hugging Face model's layers.*leave it out of --methods"):
        wrap_layers_int8(build_model(f"hf:{qwen2}"))


def test_a_command_line_plan_applies_strictly_to_the_model_the_bench_compiles(qwen2, tmp_path):
    """``hilore trace/plan --model hf:...`` plan the Hugging Face model a trainer compiles;
    the bench compiles the same model (``as_policy`` keeps its module paths), so every unit
    matches, those of the layers the trace made from its first four (``passes/depth.py``) too."""
    from hilore_compiler.backend import HiLoReBackend
    from hilore_compiler.tracefile import load_trace

    trace, plan = tmp_path / "t.json", tmp_path / "p.json"
    model = ["--model", f"hf:{qwen2}", "--lora", "4"]
    assert cli.main(["trace", *model, "--batch", "2", "--seq-len", "32", "--repeats", "1", "-o", str(trace)]) == 0
    assert any("captured the first 4 of 6 layers" in n for n in load_trace(trace).notes)
    assert cli.main(["plan", str(trace), "--budget", "1.0x-gc", "-o", str(plan)]) == 0
    policy = build_model(f"hf:{qwen2}?lora=4")
    backend = HiLoReBackend({"plan": str(plan), "strict": True, "cache_dir": str(tmp_path / "cache"),
                             "verbose": False})
    ids = torch.randint(0, QWEN2["vocab_size"], (2, 32))
    torch.compile(policy, backend=backend, dynamic=False)(ids).float().log_softmax(-1).mean().backward()
    (graph,) = backend.graphs
    assert graph.plan is not None
    assert all(r.matched == r.units == len(load_trace(trace).units) for r in graph.records)
    # The 1.0x-gc plan keeps less than everything: it compresses or recomputes.
    assert all(r.counts.get("store", 0) < r.units for r in graph.records), [r.counts for r in graph.records]
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)  # base frozen


# ------------------------------------------------------------ whole runs

@pytest.mark.slow
def test_bench_runs_the_frontier_on_an_hf_lora_model(qwen2, tmp_path, capsys):
    out = tmp_path / "frontier.json"
    code = cli.main(["bench", "--model", f"hf:{qwen2}", "--layers", "2", "--lora", "4", "--seq-len", "64",
                     "--ceilings", "1.0", "--methods", "store-all,gc,hilore", "--repeats", "2",
                     "--steps-per-round", "1", "--warmup", "1", "--threads", "1", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["config"]["model"] == f"hf:{qwen2}?layers=2&lora=4"
    runs = report["runs"]
    assert set(runs) >= {"store-all", "gc"} and all(r["status"] == "ok" for r in runs.values()), runs
    for run in runs.values():  # the model's own GC compiles as one graph, as the others do
        assert run["info"]["dynamo_graphs"] == 1 and run["info"]["graph_breaks"] == 0, run["method"]
    assert runs["gc"]["cosine"] > 0.99999  # recomputation through HF's checkpointing is exact
    points = {p["method"]: p for p in report["points"]}
    assert set(points) == {"store-all", "gc", "hilore"} and points["gc"]["status"] == "measured"
    # Planned and measured (a 1 MB step's peak is mostly the allocator's granularity: whether it
    # fits is the real-width benchmarks' to say), its gradient within the default error budget.
    assert points["hilore"]["status"] in ("measured", "store-all")
    hilore = runs[points["hilore"]["run"]]
    assert hilore["cosine"] > 0.999 and hilore["info"]["graph_breaks"] == 0


@pytest.mark.slow
def test_compile_cost_compiles_the_hf_model_at_its_depth(qwen2, tmp_path, capsys):
    out = tmp_path / "cost.json"
    code = cli.main(["bench", "--compile-cost", "--model", f"hf:{qwen2}", "--lora", "4", "--batch", "1",
                     "--seq-len", "32", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["config"]["depths"] == [6] and report["config"]["model"] == f"hf:{qwen2}?lora=4"
    assert [(r["method"], r["caches"], r["status"]) for r in report["rows"]] == [
        (m, c, "ok") for m in ("inductor", "hilore", "hilore-roofline") for c in ("fresh", "warm")]
    assert re.search(r"6 layers, fresh caches: hilore/inductor first compile [\d.]+x", printed)
    rows = {(r["method"], r["caches"]): r for r in report["rows"]}
    # A second process with hilore's plan cached is served by Inductor's own caches as plain
    # Inductor's is (test_cache.py checks the hits themselves), and plans nothing.
    for method in ("hilore", "hilore-roofline"):
        assert rows[method, "warm"]["cache_hits"] == rows["inductor", "warm"]["cache_hits"], rows[method, "warm"]
        assert not any("profiling" in line for line in rows[method, "warm"]["breakdown"])
    assert any("profiling" in line for line in rows["hilore", "fresh"]["breakdown"])
