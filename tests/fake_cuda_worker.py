"""Run in a fresh process by tests/test_fake_cuda.py: CUDA joint graphs on fake tensors.

``python tests/fake_cuda_worker.py OUT.json`` loads the fake CUDA device
guard before torch (``hilore_compiler.fakecuda``), then for each model makes
plans from three traces (a measured CPU trace, a roofline trace on the meta
device, a roofline trace of the fake-CUDA graph), applies each strictly to
the fake-CUDA graph, and plans that graph zero-config with
``cost_model="roofline:h100"``. The ``CLI_MODELS`` (a Qwen2 from a config
file, with PEFT LoRA and without, and a Llama with LoRA) are planned by the command line instead
(``hilore trace --model hf:CONFIG.json --cost-model roofline:h100``, then
``hilore plan``) and compiled with its plan file. Compiles stop after
Inductor's partitioner. It writes what each compile did as JSON; the tests read it.

``--real-cuda OUT.json`` (``bench/gpu_session.sh``, on a GPU) checks the
stand-ins instead: each model's unit keys and attention kernel on real CUDA
against those of its meta trace, lowered by ``passes.gpu_lowering``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
import traceback

from hilore_compiler import fakecuda

REAL_CUDA = "--real-cuda" in sys.argv
if not REAL_CUDA:
    fakecuda.load_guard()  # before torch: ATen caches its CUDA hooks on first use

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

# Each model's forward compiles once per plan here, more often than dynamo's
# per-frame recompile limit (8) allows before it runs the frame eagerly.
torch._dynamo.config.recompile_limit = 64

from hilore_compiler.backend import HiLoReBackend  # noqa: E402
from hilore_compiler.models import build_model, token_logprobs  # noqa: E402
from hilore_compiler.passes.tracer import TraceConfig, trace  # noqa: E402
from hilore_compiler.solver import solve  # noqa: E402

BATCH, SEQ, VOCAB = 2, 32, 64
BUDGET = "1.0x-gc"
#: Codecs of the traces and plans; bf16 does not encode bf16 activations.
CODECS = ("int8",)


def hf_llama(dropout: float) -> torch.nn.Module:
    """A Hugging Face Llama from a config (sdpa, bf16), attention dropout ``dropout``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa", use_cache=False, attention_dropout=dropout)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()


#: Tiny configs of the paper's two families, as ``--model hf:CONFIG.json`` takes them.
CONFIGS = {
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
              "max_position_embeddings": 64},
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
              "max_position_embeddings": 64},
}
#: Models the command line plans (``hilore trace`` on meta, roofline:h100, then ``hilore plan``):
#: their config and LoRA rank (None: full fine-tuning).
CLI_MODELS = {"hf-qwen2-lora": ("qwen2", 4), "hf-qwen2": ("qwen2", None), "hf-llama-lora": ("llama", 4)}


@functools.cache
def config_file(family: str) -> str:
    """``CONFIGS[family]`` as a local ``.json`` config file (written once per process)."""
    path = os.path.join(tempfile.mkdtemp(), f"{family}.json")
    with open(path, "w") as f:
        json.dump(CONFIGS[family], f)
    return path


def hf_cli_model(family: str, lora: int | None) -> torch.nn.Module:
    """The model the command line builds for ``--model hf:CONFIG --lora LORA --dtype bfloat16``,
    with random weights on the CPU (PEFT's adapters float32 under the bf16 base)."""
    from hilore_compiler.models.hf_config import build_from_config, load_config, parse_model_arg

    spec = parse_model_arg(f"hf:{config_file(family)}", lora=lora)
    return build_from_config(spec, load_config(spec), device="cpu", dtype=torch.bfloat16, seed=0)


MODELS = {
    "tiny": lambda: build_model("tiny", dtype=torch.bfloat16, vocab_size=VOCAB).train(),
    # fp32 activations: the one model whose units the bf16 codec encodes.
    "tiny-fp32": lambda: build_model("tiny", vocab_size=VOCAB).train(),
    "hf-llama": lambda: hf_llama(0.0),
    "hf-llama-dropout": lambda: hf_llama(0.1),
    **{name: functools.partial(hf_cli_model, family, lora) for name, (family, lora) in CLI_MODELS.items()},
}


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def loss_of(out, ids: torch.Tensor) -> torch.Tensor:
    return -token_logprobs(logits_of(out), ids).mean()


SECONDS: dict[str, float] = {}


def traced(model: torch.nn.Module, ids: torch.Tensor, cost_model: str):
    # Static: the graph the fake-CUDA compile makes at its first call, and faster to trace.
    config = TraceConfig(cost_model=cost_model, codecs=CODECS, repeats=1, warmup=0, verbose=False, dynamic=False)
    start = time.perf_counter()
    result = trace(model, [ids], lambda out: loss_of(out, ids), config=config)
    label = f"trace {ids.device.type} {cost_model}"
    SECONDS[label] = SECONDS.get(label, 0.0) + time.perf_counter() - start
    return result


def compile_on_fake_cuda(build, options: dict) -> dict:
    """Compile ``build()`` on fake CUDA with the hilore backend (strict); what it did."""
    model = build()
    with fakecuda.fake_cuda_mode(), fakecuda.partition_only():
        model = model.to("cuda")
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
        backend = HiLoReBackend({"strict": True, "verbose": False, "cache_dir": tempfile.mkdtemp(), **options})
        loss_of(torch.compile(model, backend=backend)(ids), ids).backward()
    graph = backend.graphs[0]
    record = next(r for r in graph.records if r.bucket == graph.variant_of.get(graph.default_bucket,
                                                                                 graph.default_bucket))
    return {"units": record.units, "matched": record.matched, "counts": record.counts,
            "saved_bytes": record.saved_bytes, "predicted_bytes": graph.predicted_saved_bytes(graph.default_bucket),
            "default_saved_bytes": record.default_saved_bytes, "backward_flops": record.backward_flops,
            "device": str(ids.device), "bucket": graph.default_bucket}


def plans_for(name: str) -> dict:
    """Plans from a CPU, a meta and a fake-CUDA trace of model ``name``."""
    build = MODELS[name]
    cpu = traced(build(), torch.randint(0, VOCAB, (BATCH, SEQ)), "measured")
    with torch.device("meta"):
        meta_model = build()
    meta = traced(meta_model, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"), "roofline:h100")
    model = build()
    with fakecuda.fake_cuda_mode():
        model = model.to("cuda")
        fake = traced(model, torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda"), "roofline:h100")
    return {source: solve(t, BUDGET, buckets=1, codecs=list(CODECS), batch=BATCH, seq_len=SEQ)
            for source, t in (("cpu", cpu), ("meta", meta), ("fake-cuda", fake))}


def cli_plan(name: str) -> str:
    """The plan file ``hilore trace`` (roofline:h100, on meta) and ``hilore plan`` make for
    CLI model ``name``, run in this process through the command line's ``main``."""
    from hilore_compiler import cli

    folder = tempfile.mkdtemp()
    trace_path, plan_path = os.path.join(folder, "trace.json"), os.path.join(folder, "plan.json")
    family, lora = CLI_MODELS[name]
    argv = ["trace", "--model", f"hf:{config_file(family)}", *(["--lora", str(lora)] if lora else []),
            "--dtype", "bfloat16", "--batch", str(BATCH), "--seq-len", str(SEQ), "--cost-model", "roofline:h100",
            "--codecs", ",".join(CODECS), "-o", trace_path]
    start = time.perf_counter()
    if cli.main(argv) != 0:
        raise RuntimeError(f"hilore {' '.join(argv)} failed")
    SECONDS["hilore trace roofline:h100"] = SECONDS.get("hilore trace roofline:h100", 0.0) + \
        time.perf_counter() - start
    argv = ["plan", trace_path, "--budget", BUDGET, "--buckets", "1", "--codecs", ",".join(CODECS), "-o", plan_path]
    if cli.main(argv) != 0:
        raise RuntimeError(f"hilore {' '.join(argv)} failed")
    return plan_path


#: Codecs each model's every unit is compressed with, where it applies (``uniform_plans``).
UNIFORM_CODECS = {"tiny": ("int8", "fp8"), "tiny-fp32": ("bf16", "int8", "fp8"), "hf-llama": ("int8", "fp8")}


def uniform_plans(name: str) -> dict:
    """Plans from a meta trace that compress every unit a codec can encode (attention
    included), one per codec: the tightest test of predicted compressed bytes."""
    from hilore_compiler.solver import fixed_plan, uniform_codec

    codecs = UNIFORM_CODECS.get(name, ())
    if not codecs:
        return {}
    with torch.device("meta"):
        meta_model = MODELS[name]()
    config = TraceConfig(cost_model="roofline:h100", codecs=codecs, repeats=1, warmup=0, verbose=False,
                         dynamic=False)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    meta = trace(meta_model, [ids], lambda out: loss_of(out, ids), config=config)
    return {f"uniform {c} from meta": fixed_plan(meta, uniform_codec(c), buckets=1, codecs=[c], batch=BATCH,
                                                 seq_len=SEQ) for c in codecs}


def run_model(name: str) -> dict:
    results: dict = {}
    try:
        if name in CLI_MODELS:
            plans, uniform = {"hilore plan": cli_plan(name)}, {}
        else:
            plans = {} if name == "tiny-fp32" else plans_for(name)
            uniform = uniform_plans(name)
    except Exception:
        return {"error": traceback.format_exc()}
    runs = {f"plan from {s}": {"plan": p} for s, p in plans.items()}
    runs.update({label: {"plan": p} for label, p in uniform.items()})
    if plans and name not in CLI_MODELS:
        runs["zero-config roofline:h100"] = {"cost_model": "roofline:h100", "memory_budget": BUDGET,
                                             "codecs": list(CODECS), "buckets": 1}
    for label, options in runs.items():
        start = time.perf_counter()
        try:
            results[label] = compile_on_fake_cuda(MODELS[name], options)
            if isinstance(options.get("plan"), str):  # a plan file: how many units it decides
                with open(options["plan"]) as f:
                    results[label]["plan_units"] = len(json.load(f)["units"])
        except Exception:
            results[label] = {"error": traceback.format_exc()}
        results[label]["seconds"] = time.perf_counter() - start
    return results


def real_cuda_check(name: str) -> dict:
    """Unit keys and attention ops of ``name`` on real CUDA against its meta trace's."""
    build = MODELS[name]
    with torch.device("meta"):
        meta_model = build()
    meta = traced(meta_model, torch.empty(BATCH, SEQ, dtype=torch.long, device="meta"), "roofline:h100")
    real = traced(build().cuda(), torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda"), "roofline:h100")
    ops = lambda t: sorted({u.op for u in t.units if u.key.split(":")[-2] == "sdpa"})  # noqa: E731
    keys_meta, keys_real = {u.key for u in meta.units}, {u.key for u in real.units}
    return {"same_keys": keys_meta == keys_real, "only_meta": sorted(keys_meta - keys_real),
            "only_cuda": sorted(keys_real - keys_meta), "attention_meta": ops(meta), "attention_cuda": ops(real)}


def main(out_path: str, names: list[str]) -> None:
    if REAL_CUDA:
        with open(out_path, "w") as f:
            json.dump({name: real_cuda_check(name) for name in names or MODELS}, f, indent=1)
        return
    stand_ins = fakecuda.install_stand_ins()
    try:
        results = {name: run_model(name) for name in names or MODELS}
        results["seconds"] = SECONDS
    finally:
        stand_ins.close()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--real-cuda"]
    main(args[0], args[1:])
