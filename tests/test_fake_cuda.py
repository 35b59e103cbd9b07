"""The CUDA path without a GPU: plans made anywhere fit the joint graph a GPU compiles.

One subprocess (``fake_cuda_worker.py``, which must load the fake CUDA
device guard before torch) compiles the built-in ``tiny`` and a Hugging
Face Llama from a config (bf16, sdpa, with and without attention dropout)
on fake CUDA tensors up to the end of Inductor's partitioner, with plans
from a measured CPU trace, a roofline trace on the meta device and a
roofline trace of the fake-CUDA graph, each applied strictly, and
zero-config with ``cost_model="roofline:h100"``; and a Qwen2 from a config
file (with PEFT LoRA and without) and a Llama with LoRA, with the plan the command line makes for
it (``hilore trace --model hf:CONFIG.json``, ``hilore plan``). What stands
in for the GPU, and what that cannot show, is in ``hilore_compiler/fakecuda.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("fake_cuda_worker.py")

pytestmark = [
    pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build of torch compiles real CUDA graphs "
                       "(bench/gpu_session.sh); the fake device guard is for CPU-only builds"),
    pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                       reason="the fake CUDA device guard is built with a C++ compiler ($CXX or g++)"),
]

SOURCES = ("plan from cpu", "plan from meta", "plan from fake-cuda", "zero-config roofline:h100")
#: CUDA's fused attention saves an RNG seed (2 x int64) and offset (int64)
#: beside what the CPU's saves: 24 bytes per layer that a CPU trace's plan
#: does not predict (``matching.ATTENTION_SIZE_SLACK``).
PHILOX_BYTES_PER_LAYER = 24
LAYERS = 2


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fake-cuda") / "results.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True, text=True,
                            timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def _run(compiled: dict, model: str, source: str) -> dict:
    run = compiled[model]
    assert "error" not in run, run.get("error")
    assert "error" not in run[source], f"{model}, {source}:\n{run[source]['error']}"
    return run[source]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "hf-llama", "hf-llama-dropout"])
@pytest.mark.parametrize("source", SOURCES[1:])
def test_gpu_plans_apply_strictly_and_save_what_they_predict(compiled, model, source):
    run = _run(compiled, model, source)
    assert run["device"] == "cuda:0"
    assert run["units"] >= 25 and run["matched"] == run["units"]
    assert run["saved_bytes"] == run["predicted_bytes"]
    assert run["saved_bytes"] < run["default_saved_bytes"]  # the 1.0x-gc plan saves less than Inductor's own
    assert run["backward_flops"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "hf-llama"])
def test_a_cpu_traces_plan_applies_strictly_to_the_cuda_graph(compiled, model):
    """The CPU's flash attention and CUDA's flash or memory-efficient kernels
    are one unit (``sdpa``); CUDA's adds its RNG seed and offset."""
    run = _run(compiled, model, "plan from cpu")
    assert run["units"] >= 25 and run["matched"] == run["units"]
    assert 0 <= run["saved_bytes"] - run["predicted_bytes"] <= PHILOX_BYTES_PER_LAYER * LAYERS
    assert run["saved_bytes"] < run["default_saved_bytes"]


@pytest.mark.slow
def test_a_cpu_trace_with_attention_dropout_differs_only_inside_attention(compiled):
    """The CPU has no fused attention with dropout: its trace holds the math
    path's units (probabilities, the dropout mask), a GPU's graph flash
    attention's. Strict matching refuses the plan; every unit named
    outside attention matches (non-strict, the backend lets Inductor decide
    attention's units and applies the rest)."""
    run = compiled["hf-llama-dropout"]["plan from cpu"]
    assert "PlanMismatchError" in run.get("error", "")
    message = run["error"].split("PlanMismatchError:")[-1]
    named = [part.split("'")[0] for part in message.split("['")[1:]]
    assert named and all(".self_attn:" in key for key in named), message


@pytest.mark.slow
@pytest.mark.parametrize(("model", "codec"), [("tiny", "int8"), ("tiny", "fp8"), ("tiny-fp32", "bf16"),
                                             ("tiny-fp32", "int8"), ("tiny-fp32", "fp8"), ("hf-llama", "int8"),
                                             ("hf-llama", "fp8")])
def test_every_unit_compressed_keeps_exactly_what_the_plan_predicts(compiled, model, codec):
    """Each codec on every unit it encodes, attention's output and log-sum-exp
    included (its RNG seed and offset kept as they are): the CUDA graph keeps
    the plan's bytes to the byte."""
    run = _run(compiled, model, f"uniform {codec} from meta")
    assert run["matched"] == run["units"] and run["counts"]["compress"] >= 10, run["counts"]
    assert run["saved_bytes"] == run["predicted_bytes"]
    assert run["saved_bytes"] < run["default_saved_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf-qwen2", "hf-qwen2-lora", "hf-llama-lora"])
def test_command_line_plans_for_a_hf_model_apply_strictly_and_save_what_they_predict(compiled, model):
    """``hilore trace --model hf:CONFIG.json [--lora 4] --cost-model roofline:h100`` (on
    meta) and ``hilore plan --budget 1.0x-gc``: the plan file decides every unit of the
    model's CUDA graph (bf16 base, LoRA's adapters float32) and it keeps the predicted bytes.
    (With LoRA, the frozen o_proj keeps the attention output only through a no-op alias,
    which the meta trace lost until its backend removed no-op ops as Inductor does.)"""
    run = _run(compiled, model, "plan from hilore plan")
    assert run["device"] == "cuda:0"
    assert run["units"] >= 25 and run["matched"] == run["units"] == run["plan_units"]
    assert run["saved_bytes"] == run["predicted_bytes"]
    assert run["counts"]["recompute"] + run["counts"]["compress"] > 0, run["counts"]
    assert run["saved_bytes"] < run["default_saved_bytes"]


def test_lowering_leaves_real_cpu_tensors_to_their_device():
    """``lowered_as_gpu`` stands in only where no kernel choice exists: real
    CPU tensors still lower to the CPU's own kernels, never to CUDA's."""
    from hilore_compiler.passes.gpu_lowering import lowered_as_gpu

    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with lowered_as_gpu():
        graph = torch.fx.experimental.proxy_tensor.make_fx(
            lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q))(q)
    ops = {str(n.target) for n in graph.graph.nodes}
    assert not any("efficient" in op or op.endswith("_flash_attention.default") for op in ops), ops
