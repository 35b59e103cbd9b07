"""Hugging Face causal LMs from tiny configs, with random weights (nothing downloaded).

For tests and examples that check the backend on the models users bring:
Llama, Qwen2, Mistral, Gemma and GPT-2, sdpa attention, dropout off so that
gradients compare exactly. Needs ``transformers`` (the ``test`` extra).
"""

from __future__ import annotations

import torch

#: Architectures ``build_hf_model`` knows.
HF_ARCHS = ("llama", "qwen2", "mistral", "gemma", "gpt2")


def build_hf_model(arch: str, *, vocab_size: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, intermediate: int = 64, max_positions: int = 64,
                   use_cache: bool = True, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``<Arch>ForCausalLM`` (``GPT2LMHeadModel``) of this size."""
    import transformers

    if arch not in HF_ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(HF_ARCHS)}")
    torch.manual_seed(seed)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                                         n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, attn_implementation="sdpa", use_cache=use_cache,
                                         # GPT-2's own 50256 lies outside a tiny vocabulary.
                                         bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
        return transformers.GPT2LMHeadModel(config)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    }[arch]
    # Gemma's head_dim is its own field (256 by default); keep it hidden / heads.
    extra = {"head_dim": hidden // heads} if arch == "gemma" else {}
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        max_position_embeddings=max_positions, attn_implementation="sdpa",
                        use_cache=use_cache, **extra)
    return model_cls(config)
