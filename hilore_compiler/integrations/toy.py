"""A tiny random policy, a local tokenizer and a verifiable toy task for TRL.

Everything is made in code, nothing is downloaded: the example
(``examples/trl_grpo.py``) and the tests train on it in minutes on a CPU.

The task is the one ``hilore eval`` uses, in text: a prompt is ``n`` random
digits and ``=`` (``"3917="``), and the reward is 1 when the completion starts
with the prompt's largest digit (``"9..."``), else 0. A random policy gets
about a tenth right, so at the start most groups have equal rewards (zero
advantage, zero exposure): what the exposure buckets are for.
"""

from __future__ import annotations

import random
from typing import Any

#: The tokenizer's characters: digits, the separator, a space; ids follow the
#: four special tokens.
CHARS = "0123456789= "
SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>")


def char_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` with one token per character of ``CHARS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL, *CHARS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters: the WordLevel model then maps each one.
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        unk_token="<unk>",
    )
    tok.padding_side = "left"  # TRL pads prompts on the left for generation
    return tok


def tiny_qwen2(tokenizer: Any, *, hidden: int = 32, layers: int = 2, seed: int = 0) -> Any:
    """A random ``Qwen2ForCausalLM`` over ``tokenizer``'s vocabulary (fp32, eager attention).

    The config keeps ``use_cache=True`` as a downloaded model has it: TRL's
    training forward passes ``use_cache=False`` itself, and generation (which
    builds the KV cache) is not compiled.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def digit_prompts(n: int, digits: int = 4, seed: int = 0) -> list[str]:
    """``n`` prompts of ``digits`` random digits and ``=``."""
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789") for _ in range(digits)) + "=" for _ in range(n)]


def digit_dataset(n: int, digits: int = 4, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` with a ``prompt`` column (TRL's standard text format)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": digit_prompts(n, digits, seed)})


def largest_digit_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """1.0 where the completion starts with the prompt's largest digit, else 0.0 (TRL reward signature)."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        target = max(c for c in prompt if c.isdigit())
        rewards.append(1.0 if completion.strip()[:1] == target else 0.0)
    return rewards
