"""The paper's runtime on a model: a ``LayerBundle`` per decoder layer per step, and the L
threshold scaled to the model's layers.

``PaperRecovery`` installs the recovery of ``recovery`` on every decoder layer, found as
``checkpointing.wrap_layers`` finds them (``model.layers``, which Hugging Face policies provide
too). ``decoder_layer_saved_bytes`` and ``L_THRESHOLD_SHARE`` carry the reference's 32 MiB L
threshold at Qwen2.5-3B over to any model as a share of its layers' saved bytes.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .recovery import AFTER_CAPTURE, LayerBundle, storage_key

#: The reference's L threshold (``minimum_compressed_tensor_bytes``) at Qwen2.5-3B, bf16.
REFERENCE_L_THRESHOLD_BYTES = 32 << 20


def decoder_layer_saved_bytes(tokens: int, hidden: int, intermediate: int, heads: int) -> int:
    """Bytes a Llama/Qwen2 decoder layer saves for backward (``LayerBundle.activation_bytes``)
    at ``tokens`` tokens, in bf16 (or fp16), every weight trainable, flash attention:

        24 N h + 8 N I + 4 N H + 8 N

    for N tokens, h hidden, I intermediate, H heads. Per RMSNorm: its fp32 input (4Nh), the
    rsqrt (4N), the input cast back (2Nh) and the weighted output (2Nh). Attention: q, k and v,
    k and v repeated to all H heads (HF's ``repeat_kv``, our Llama's ``repeat_interleave``: the
    KV heads do not enter), and its output, already laid out for ``o_proj`` (4 x 2Nh), and the
    fp32 log-sum-exp (4NH). SwiGLU: the gate and up outputs, the SiLU output and the product
    (4 x 2NI). Rotary embedding saves only cos and sin, which are layer inputs.
    ``tests/test_paper_method.py`` counts it on the built-in Llama layer.
    """
    norms = 2 * (4 * tokens * hidden + 4 * tokens + 2 * 2 * tokens * hidden)
    attention = 4 * 2 * tokens * hidden + 4 * tokens * heads
    mlp = 4 * 2 * tokens * intermediate
    return norms + attention + mlp


#: The L threshold's share of a layer's saved bytes at the reference's setting: Qwen2.5-3B
#: (hidden 2048, intermediate 11008, 16 heads, 2 KV heads), a 4096-token microbatch, bf16:
#: 32 MiB of 562,331,648 bytes, 5.97%. A model's threshold is this share of its own layers'.
L_THRESHOLD_SHARE = REFERENCE_L_THRESHOLD_BYTES / decoder_layer_saved_bytes(4096, 2048, 11008, 16)


class PaperRecovery:
    """The paper's runtime installed on ``model.layers``: one ``LayerBundle`` per layer per step.

    Each layer's ``forward`` is replaced on the instance, not wrapped in a module: Hugging Face
    decoders read attributes of their layers, and fqns stay the model's own. ``gc`` runs every
    layer under non-reentrant ``torch.utils.checkpoint`` instead (GC's peak, measured when the
    bench gave none). ``close`` puts the model back.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers: list[nn.Module] = list(model.layers)
        count = len(self.layers)
        self.captures: list[str] = ["R"] * count
        self.thresholds: list[int] = [0] * count
        self.bundles: dict[int, LayerBundle] = {}
        self.gc = False
        self.measure_error = False
        self._capturing: LayerBundle | None = None
        self._parameters = [frozenset(storage_key(p) for p in layer.parameters()) for layer in self.layers]
        self._handles = []
        for i, layer in enumerate(self.layers):
            layer.forward = types.MethodType(self._forward_of(i, layer.forward), layer)
            mlp = getattr(layer, "mlp", None)
            if mlp is not None:  # a layer without ``mlp`` never has an L tensor
                self._handles += [mlp.register_forward_pre_hook(lambda m, a: self._in_mlp(+1)),
                                  mlp.register_forward_hook(lambda m, a, o: self._in_mlp(-1), always_call=True)]

    def _in_mlp(self, step: int) -> None:
        if self._capturing is not None:  # not during a replay, whose selection is made
            self._capturing.mlp_depth += step

    def _forward_of(self, index: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or not layer.training:
                return original(*args, **kwargs)
            if self.gc:
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
            bundle = LayerBundle(original, args, kwargs, capture=self.captures[index],
                                 threshold_bytes=self.thresholds[index], parameters=self._parameters[index],
                                 measure_error=self.measure_error)
            self.bundles[index] = bundle
            self._capturing = bundle
            try:
                return bundle.run(args, kwargs)
            finally:
                self._capturing = None
        return forward

    def begin(self, captures: Sequence[str]) -> None:
        """Start a step: every layer's capture for the coming forward."""
        if len(captures) != len(self.layers) or any(c not in AFTER_CAPTURE for c in captures):
            raise ValueError(f"one capture of {', '.join(AFTER_CAPTURE)} per layer, got {list(captures)}")
        self.captures, self.bundles = list(captures), {}

    def select(self, actions: Sequence[str]) -> list[str]:
        """Every captured layer's action for this step's backward; returns what each took."""
        if len(actions) != len(self.bundles):
            raise ValueError(f"{len(self.bundles)} layers captured, {len(actions)} actions given")
        return [self.bundles[i].select(a) for i, a in enumerate(actions)]

    def close(self) -> None:
        """Give the layers their own ``forward`` back and remove the MLP hooks."""
        for layer in self.layers:
            del layer.forward
        for handle in self._handles:
            handle.remove()
