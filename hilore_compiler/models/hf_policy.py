"""A Hugging Face causal LM shaped like the built-in policies, so that the benchmarks run it.

The benchmarks and the evaluation take a model by name (``build_model``) and
rely on what every built-in policy has: ``policy(input_ids) -> logits``,
``.config.vocab_size``, ``.layers``, and ``hidden_states``/``lm_head`` for
chunked log-probs. ``as_policy`` gives a ``transformers`` causal LM those by
making it an instance of a subclass of its own class (``HFPolicy`` mixed in),
not by wrapping it: module paths, and so every unit key, stay the model's own
(``model.layers.3.mlp...``), whoever compiles, traces or calibrates it, and a
plan ``hilore trace --model hf:...`` made applies to what the bench compiles.

GC checkpoints the decoder layers the way TRL and verl do: through the
model's own gradient checkpointing (non-reentrant ``torch.utils.checkpoint``
inside each ``GradientCheckpointingLayer``), not by wrapping the layers,
whose call signature and attributes the model's forward relies on.

A benchmark names such a model by a *model reference*, one string that
crosses process boundaries: ``hf:PATH`` or, with options,
``hf:PATH?layers=4&lora=16`` (``HFModelSpec.ref``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .hf_config import HFModelSpec, build_from_config, load_config


class HFPolicy:
    """Mixed in before a ``*ForCausalLM`` class: ``forward(input_ids) -> logits (B, T, V)``."""

    #: What was built, for reports (``HFModelSpec.describe``).
    policy_name: str = ""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids).logits

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers."""
        return self.get_decoder().layers

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden state (B, T, C) that ``lm_head`` projects to logits."""
        return self.get_decoder()(input_ids=input_ids).last_hidden_state

    def checkpoint_layers(self, context_fn: Callable[[], Any] | None = None, every: int = 1) -> HFPolicy:
        """Turn on the model's own gradient checkpointing (non-reentrant) for every
        ``every``-th decoder layer, counting from 1 as ``checkpointing.wrap_layers`` does;
        ``context_fn`` goes to ``torch.utils.checkpoint`` (selective AC). Returns self.

        So that compiled GC is one graph, as strong as GC compiles: the hook
        transformers adds to make the embedding's output require grad (needed
        by reentrant checkpointing only; dynamo breaks the graph at its
        ``requires_grad_``) is taken off again, and dynamo is told not to replay
        side effects of a checkpointed forward in backward (transformers' layers
        write an output-recording context variable, which broke the graph at
        every layer: 5 graphs for 2 layers with transformers 5.25).
        """
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        # transformers 5.25 renamed gradient_checkpointing_enable (kept, deprecated).
        enable = getattr(self, "activation_checkpointing_enable", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.disable_input_require_grads()
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = (i + 1) % every == 0
        return self


#: One policy class per causal LM class, so that two policies of one model share a class.
_POLICY_CLASSES: dict[type, type] = {}


def as_policy(lm: nn.Module, name: str = "") -> nn.Module:
    """``lm`` (a ``*ForCausalLM``), in place, as an ``HFPolicy``: the same object and
    modules, its class a subclass of its own under the same name. Returns it."""
    cls = type(lm)
    if not isinstance(lm, HFPolicy):
        policy_cls = _POLICY_CLASSES.get(cls)
        if policy_cls is None:
            policy_cls = _POLICY_CLASSES[cls] = type(cls.__name__, (HFPolicy, cls),
                                                     {"__module__": __name__, "__qualname__": cls.__qualname__})
        lm.__class__ = policy_cls
    lm.policy_name = name
    return lm


def build_hf_policy(spec: HFModelSpec, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                    seed: int = 0) -> nn.Module:
    """The causal LM of ``spec`` as an ``HFPolicy``: built from its config alone (``hf_config``),
    random weights of ``seed``."""
    config = load_config(spec)
    lm = build_from_config(spec, config, device=device, dtype=dtype, seed=seed)
    return as_policy(lm, spec.describe(config.num_hidden_layers)).train()
