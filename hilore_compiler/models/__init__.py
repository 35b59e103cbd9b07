"""Built-in policy models used by the demo, the benchmarks and the tests.

Modules:
    llama     Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)
    gpt       GPT-2 style decoder (LayerNorm, learned positions, GELU, tied embeddings)
    logprobs  per-token log-probabilities with the standard causal shift
    hf        tiny Hugging Face causal LMs for tests and examples
    hf_config Hugging Face causal LMs from a config alone (``--model hf:...``), LoRA by PEFT
    hf_policy such a model as a policy (logits from token ids, ``layers``, its own GC) for the benchmarks

Every model maps ``input_ids (B, T)`` to ``logits (B, T, V)``, keeps its
config in ``.config`` and names its layer stack ``layers`` (an
``nn.ModuleList``), so module fqns read ``layers.<i>.mlp...``. The logits are
``model.lm_head(model.hidden_states(input_ids))`` (``lm_head`` has no bias),
so a loss can apply the output projection itself, chunk by chunk
(``chunked_token_logprobs``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hilore_compiler.models.gpt import GPTConfig, GPTModel
from hilore_compiler.models.llama import LlamaConfig, LlamaModel
from hilore_compiler.models.logprobs import chunked_token_logprobs, response_logprobs, token_logprobs

#: Parameter dtypes a built-in policy is built in (names of ``torch`` dtypes),
#: for ``--dtype`` options.
DTYPES = ("float32", "bfloat16")

__all__ = [
    "GPTConfig",
    "GPTModel",
    "LlamaConfig",
    "LlamaModel",
    "MODEL_CONFIGS",
    "ModelConfig",
    "DTYPES",
    "build_model",
    "chunked_token_logprobs",
    "hidden_size",
    "model_names",
    "model_slug",
    "response_logprobs",
    "token_logprobs",
]

ModelConfig = LlamaConfig | GPTConfig

_TINY = LlamaConfig(
    vocab_size=256, hidden=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=128, max_seq_len=256
)

MODEL_CONFIGS: dict[str, ModelConfig] = {
    # Tests: compiles and runs in seconds; 2 kv heads keep the GQA path exercised.
    "tiny": _TINY,
    # Demo and bench: a real-looking stack (3.95M parameters) that a 2-core
    # CPU trains at response length 2048. Measured one eager fwd+bwd step
    # (with token_logprobs) at T=2048, fp32, torch 2.13 CPU, 2 threads:
    # B=1 ~1.05 s, B=2 ~2.1 s (median after warm-up; up to 1.5 s under load).
    "small": LlamaConfig(
        vocab_size=2048, hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, intermediate=688,
        max_seq_len=4096,
    ),
    # small with Llama-3's vocabulary (68.6M parameters, 65.7M of them in embedding
    # and lm_head): the loss side (logits, their fp32 copy, their gradients)
    # holds most of a step's memory. On CPU meant for seq_len <= 512.
    "small-v128k": LlamaConfig(
        vocab_size=128256, hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, intermediate=688,
        max_seq_len=4096,
    ),
    # Llama-3-8B shapes: only ever built on the meta device (about 8.0e9 parameters).
    "llama-8b": LlamaConfig(
        vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate=14336,
        max_seq_len=8192, rope_theta=500000.0,
    ),
    # TinyLlama-1.1B's shapes cut to 8 layers (0.48e9 parameters): the
    # GPU bench policy, e.g. ``hilore bench --device cuda --dtype bfloat16
    # --model tinyllama-8l --batch 8 --seq-len 2048``; real kernel sizes
    # (hidden 2048, GQA 32/4, SwiGLU 5632) at a depth one GPU holds with
    # store-all. Far too slow for CPUs: CPU tests only build it on meta.
    "tinyllama-8l": LlamaConfig(
        vocab_size=32000, hidden=2048, n_layers=8, n_heads=32, n_kv_heads=4, intermediate=5632,
        max_seq_len=4096, rope_theta=10000.0,
    ),
    # The second architecture at tiny size: catches passes that assume Llama.
    "gpt-tiny": GPTConfig(
        vocab_size=256, hidden=64, n_layers=2, n_heads=4, intermediate=256, max_seq_len=256
    ),
    # tiny with random ops, to test that recompute keeps dropout's seeds.
    "llama-tiny-dropout": dataclasses.replace(_TINY, dropout=0.1),
}


def model_names() -> list[str]:
    """Names accepted by ``build_model``, in registry order."""
    return list(MODEL_CONFIGS)


def model_slug(name: str) -> str:
    """``name`` as result files name it: a built-in name as it is, a Hugging Face
    reference shortened (``hf-qwen25-3b-l4-lora16``)."""
    if name.startswith("hf:"):
        from .hf_config import parse_model_ref

        return parse_model_ref(name).slug()
    return name


def hidden_size(name: str) -> int:
    """The width of model ``name``'s hidden states (reads a Hugging Face config, builds nothing)."""
    if name.startswith("hf:"):
        from .hf_config import load_config, parse_model_ref

        return int(load_config(parse_model_ref(name)).hidden_size)
    return MODEL_CONFIGS[name].hidden


def _model_class(config: ModelConfig) -> type[nn.Module]:
    if isinstance(config, LlamaConfig):
        return LlamaModel
    if isinstance(config, GPTConfig):
        return GPTModel
    raise TypeError(f"no model class for config type {type(config).__name__}")


def build_model(
    name: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    **overrides: object,
) -> nn.Module:
    """Build the registered model ``name``, its weights fixed by ``seed``.

    Args:
        name: a key of ``MODEL_CONFIGS``, or a Hugging Face model reference
            (``hf:PATH?layers=4&lora=16``, ``HFModelSpec.ref``), built from its
            config alone as an ``hf_policy.HFPolicy`` (takes no ``overrides``).
        device: where parameters are created (``"meta"`` allocates nothing);
            None means the current default device.
        dtype: parameter dtype; None keeps fp32.
        seed: weights are a function of (name, overrides, seed); the global
            RNG state is restored afterwards, so building does not perturb it.
        **overrides: config fields to replace, e.g. ``n_layers=1``.

    Raises:
        ValueError: unknown name or unknown config field.
    """
    if name.startswith("hf:"):
        from .hf_config import parse_model_ref
        from .hf_policy import build_hf_policy

        if overrides:
            raise ValueError(f"{name}: a Hugging Face model takes no config overrides ({sorted(overrides)}); "
                             "edit its config file, or cut its depth with layers=N in the reference")
        return build_hf_policy(parse_model_ref(name), device=device or torch.get_default_device(), dtype=dtype,
                               seed=seed)
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(model_names())}, "
                         "or hf:NAME_OR_PATH for a Hugging Face config")
    config = MODEL_CONFIGS[name]
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown config fields for {name!r}: {unknown}; fields: {sorted(fields)}")
    config = dataclasses.replace(config, **overrides)
    device = torch.device(device) if device is not None else torch.get_default_device()
    # Fork the RNG of the device we initialise on so the caller's stream is untouched.
    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices), device:
        torch.manual_seed(seed)
        model = _model_class(config)(config)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model
