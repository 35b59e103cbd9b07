"""verl's FSDP2 engines on the CPU, built as verl's worker builds them: for tests and ``--verl-zero``.

- ``cpu_platform``: verl's platform for a gloo process group on the CPU;
- ``save_tiny_qwen2``: a small Qwen2 with random weights, saved where verl
  loads it from (nothing is downloaded);
- ``build_engine``: verl's ``FSDPEngineWithLMHead`` or ``HiLoReFSDPEngine``
  (fp32, ``use_remove_padding``), optimizer and micro-batch size given.

Needs the ``verl`` extra; imported only by what runs verl.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def cpu_platform() -> Any:
    """verl's platform for a CPU process group: device "cpu", backend "gloo"."""
    from verl.plugin.platform import PlatformBase

    class CPUPlatform(PlatformBase):
        device_name, vendor_name, device_module = "cpu", "cpu", torch.cpu

        def is_available(self): return True
        def current_device(self): return "cpu"  # verl moves batches with .to(current_device())
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def get_device_capability(self, device_index=0): return (None, None)
        def cudart(self): return None
        def is_ipc_supported(self): return False
        def nvtx_range(self, msg): return contextlib.nullcontext()
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_noset_envvars(self): return []
        def ray_resource_name(self): return "CPU"

    return CPUPlatform()


def save_tiny_qwen2(path: str, *, hidden: int = 64, layers: int = 2, vocab: int = 128,
                    max_positions: int = 64, seed: int = 0) -> None:
    """A Qwen2 of ``layers`` blocks of width ``hidden`` with random weights, saved at ``path``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)


def build_engine(path: str, hilore: dict | None, *, micro_batch_size: int, optimizer: str = "SGD",
                 lr: float = 0.5, initialize: bool = True, registered: bool = False,
                 engine_fields: dict | None = None, **model_fields: Any) -> Any:
    """verl's engine (``hilore=None``) or the hilore one, built directly as verl's worker builds it.

    ``registered``: the class the registry now holds (``HiLoReFSDPEngine``)
    even without hilore, as the reference model gets it. ``engine_fields``:
    more ``HiLoReFSDPEngineConfig`` fields (``hilore_drop_zero``, ...).
    ``model_fields``: ``HFModelConfig`` fields; gradient checkpointing is
    off unless given.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from ..integrations.verl import HiLoReFSDPEngine, HiLoReFSDPEngineConfig

    fields = {"enable_gradient_checkpointing": False, **model_fields}
    model = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                          **fields)
    common = dict(strategy="fsdp2", use_torch_compile=False, use_dynamic_bsz=False,
                  micro_batch_size_per_gpu=micro_batch_size,
                  mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    if hilore is None:
        cls = HiLoReFSDPEngine if registered else FSDPEngineWithLMHead
        engine_config = FSDPEngineConfig(**common)
    else:
        engine_config = HiLoReFSDPEngineConfig(**common, hilore=hilore, **(engine_fields or {}))
        cls = HiLoReFSDPEngine
    optim = FSDPOptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=0.0, clip_grad=1e9)
    engine = cls(model_config=model, engine_config=engine_config, optimizer_config=optim,
                 checkpoint_config=CheckpointConfig())
    if initialize:
        engine.initialize()
    return engine


def full_parameters(engine: Any) -> dict:
    """Unsharded parameters as numpy arrays: pickled by value, so they outlive this process."""
    return {n: p.full_tensor().detach().numpy().copy() for n, p in engine.module.named_parameters()}


__all__ = ["build_engine", "cpu_platform", "full_parameters", "save_tiny_qwen2"]
