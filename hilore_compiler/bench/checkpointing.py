"""How the checkpointing methods wrap the decoder layers, and what each layer keeps.

- ``Checkpointed``/``wrap_layers``: non-reentrant ``torch.utils.checkpoint``
  around every layer (``gc``) or every n-th (``sac-layer2``: torchtitan's
  layer-level selective AC), under a ``context_fn`` for the selective ones:
  ``selective_context_fn`` saves matmul and attention outputs and
  recomputes the rest (``sac``); ``op_selective_context_fn`` is torchtitan's
  op-level policy as it is (``sac-op``): the same, except every second
  ``aten.mm`` of a layer is recomputed.
- ``KeptInputCheckpointed``: GC where each layer keeps for backward only its
  input hidden states, in a form of the subclass's choosing; its backward
  restores them, recomputes the layer and backpropagates through it.
  ``Int8Checkpointed``/``wrap_layers_int8`` keep them int8-encoded
  (``gc-int8``); ``offload.OffloadCheckpointed`` in pinned host memory
  (``gc-offload``).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..codecs import INT8


class Checkpointed(nn.Module):
    """Runs the wrapped decoder layer under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, layer: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.context_fn = context_fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.context_fn is None:
            # Not ``context_fn=noop_context_fn``: dynamo (torch 2.13) cannot
            # trace a plain function held by a module as ``context_fn``.
            return checkpoint(self.layer, *args, use_reentrant=False)
        return checkpoint(self.layer, *args, use_reentrant=False, context_fn=self.context_fn)


def _sac_save_ops() -> frozenset:
    """The ops whose outputs selective AC saves: matmuls and every attention kernel.

    Looked up by name because the set of SDPA kernels differs across builds.
    """
    aten = torch.ops.aten
    names = ("mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _sac_policy(save: frozenset, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # PREFER (not MUST) recompute: the partitioner may still save a value it
    # finds cheaper to keep, as torchtitan's policy allows.
    return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn() -> Callable[[], Any]:
    """``context_fn`` for ``checkpoint``: save matmul and attention outputs, recompute the rest."""
    policy = functools.partial(_sac_policy, _sac_save_ops())
    return functools.partial(create_selective_checkpoint_contexts, policy)


def wrap_layers(model: nn.Module, context_fn: Callable[[], Any] | None = None, every: int = 1) -> nn.Module:
    """Put every ``every``-th ``model.layers[i]`` under checkpoint, in place; parameter order is kept.

    Layers count from 1, as in torchtitan's layer-level selective AC: ``every=2``
    wraps layers 1, 3, ... (0-based). A Hugging Face policy
    (``models.hf_policy.HFPolicy``) checkpoints through its model's own
    gradient checkpointing instead, as TRL and verl run it.
    """
    if hasattr(model, "checkpoint_layers"):
        return model.checkpoint_layers(context_fn, every)
    return _wrap_layers(model, lambda layer: Checkpointed(layer, context_fn), every)


def _wrap_layers(model: nn.Module, wrap: Callable[[nn.Module], nn.Module], every: int = 1) -> nn.Module:
    """Replace every ``every``-th ``model.layers[i]`` (counting from 1) by ``wrap(layer)``, in place."""
    for i, layer in enumerate(model.layers):
        if (i + 1) % every == 0:
            model.layers[i] = wrap(layer)
    return model


#: The op whose outputs torchtitan's op-level policy saves only every other time.
MM = torch.ops.aten.mm.default


def op_sac_policy(save: frozenset, meta: dict[str, int], ctx: Any, op: Any, *args: Any,
                  **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's ``_get_custom_policy(meta)``: MUST_SAVE ``op``'s output if ``op`` is in
    ``save``, except every second ``aten.mm``; PREFER_RECOMPUTE the rest.

    ``meta`` counts the mms per pass (``ctx.is_recompute``: the forward and an
    eager recompute count apart, so both take the same decisions); one dict
    per checkpointed call. Under torch.compile the policy runs while
    AOTAutograd traces the layer (``is_recompute`` False) and the partitioner
    recomputes what it tagged.
    """
    key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
    if op == MM:
        meta[key] += 1
    to_save = op in save and not (op == MM and meta[key] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE


def _op_sac_contexts(save: frozenset) -> tuple[Any, Any]:
    # A fresh counter per call, as torchtitan's context_fn makes one per checkpointed
    # layer call; under torch.compile, every trace of a layer counts from 1.
    return create_selective_checkpoint_contexts(functools.partial(op_sac_policy, save, collections.defaultdict(int)))


def op_selective_context_fn() -> Callable[[], Any]:
    """``context_fn`` for ``checkpoint`` with torchtitan's op-level policy over ``_sac_save_ops``.

    A ``functools.partial`` of a module-level function: dynamo (torch 2.13)
    takes it as a constant and calls it when AOTAutograd traces each layer.
    """
    return functools.partial(_op_sac_contexts, _sac_save_ops())


class KeptInputCheckpointed(nn.Module):
    """Runs the wrapped decoder layer keeping for backward only its input hidden states,
    in the form a subclass's ``keep`` gives them (int8 codes, a host copy).

    The forward is exact (the layer runs on the input itself). Backward
    ``restore``s the input, recomputes the layer with grad enabled and
    backpropagates through it: parameters' gradients accumulate there, as in
    reentrant ``torch.utils.checkpoint``, and as there the step must call
    ``.backward()`` (not ``torch.autograd.grad``) and the hidden states must
    require grad. The RNG state is restored before the recompute, as there
    (compiled layers too draw the same dropout masks in the recompute: checked
    on ``llama-tiny-dropout``, where Inductor's graph without grad and its
    training graph gave equal logits and, with the codec an identity, equal
    gradients).
    The layer's other arguments (Llama's rotary cos/sin) are kept as they are.

    ``compiled``: the layer runs ``torch.compile``d (Inductor), so the layers'
    compute is as fast as the other methods'. ``forward`` itself stays out of
    dynamo: the autograd.Function's backward runs a nested
    ``torch.autograd.backward``, which dynamo cannot trace, so a compiled model
    breaks its graph around every layer and compiles the code between layers
    on its own.
    """

    def __init__(self, layer: nn.Module, compiled: bool = True) -> None:
        super().__init__()
        self.layer = layer
        # A plain attribute, not a submodule: the parameters stay listed once, under ``layer``.
        self.run = _compiled(layer.forward, compiled)

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What backward keeps of the layer input ``x``."""
        raise NotImplementedError

    def restore(self, kept: tuple[torch.Tensor, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The layer input again, from what ``keep`` gave."""
        raise NotImplementedError

    @torch.compiler.disable
    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        return _KeptInputCheckpoint.apply(self, x, *args)


def _compiled(fn: Callable[..., Any], compiled: bool) -> Callable[..., Any]:
    return torch.compile(fn) if compiled else fn


class Int8Checkpointed(KeptInputCheckpointed):
    """``KeptInputCheckpointed`` keeping the layer input int8-encoded (``codecs.INT8``:
    row-wise absmax, one fp32 scale per row); ``compiled`` compiles the encode and
    the decode too.

    Non-finite input takes the codec's in-graph fallback
    (``Codec.encode_unchecked``, no host sync per layer): its row decodes to
    NaN and so does the gradient, as store-all's would be.
    """

    def __init__(self, layer: nn.Module, compiled: bool = True) -> None:
        super().__init__(layer, compiled)
        self.encode = _compiled(INT8.encode_unchecked, compiled)
        self.decode = _compiled(INT8.decode, compiled)

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.encode(x)  # (B, T, C) int8, (B, T, 1) fp32

    def restore(self, kept: tuple[torch.Tensor, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.decode(kept, dtype)


class _KeptInputCheckpoint(torch.autograd.Function):
    """One layer under a reentrant-style checkpoint that keeps its input as ``owner.keep`` says."""

    @staticmethod
    def forward(ctx: Any, owner: KeptInputCheckpointed, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        # Autograd is off in a Function's forward: the layer keeps nothing for backward.
        ctx.owner, ctx.dtype, ctx.device, ctx.rng = owner, x.dtype, x.device, _rng_state(x.device)
        out = owner.run(x, *args)  # (B, T, C), exact
        kept = owner.keep(x)
        ctx.n_kept = len(kept)
        ctx.save_for_backward(*kept, *args)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        kept, args = saved[:ctx.n_kept], saved[ctx.n_kept:]
        # detach: ``restore`` may hand back a saved tensor itself (a host copy already on the
        # layer's device), which must not be the leaf whose grad this backward reads.
        x = ctx.owner.restore(kept, ctx.dtype, ctx.device).detach().requires_grad_(ctx.needs_input_grad[1])
        args = [a.detach().requires_grad_(need) for a, need in zip(args, ctx.needs_input_grad[2:])]
        cuda = [x.device] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), torch.enable_grad():
            _set_rng_state(ctx.rng, x.device)
            out = ctx.owner.run(x, *args)
        torch.autograd.backward(out, grad_out)
        return (None, x.grad, *(a.grad for a in args))


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, on CUDA, ``device``'s (no host sync)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _built_in_layers(model: nn.Module, method: str) -> None:
    if hasattr(model, "checkpoint_layers"):
        raise ValueError(f"{method} wraps the built-in policies' decoder layers; a Hugging Face model's layers "
                         "take keyword arguments it does not pass: leave it out of --methods")


def wrap_layers_int8(model: nn.Module, compiled: bool = True) -> nn.Module:
    """Put every ``model.layers[i]`` under ``Int8Checkpointed``, in place; parameter order is kept."""
    return wrap_layers_kept(model, Int8Checkpointed, compiled)


def wrap_layers_kept(model: nn.Module, kind: type[KeptInputCheckpointed], compiled: bool = True) -> nn.Module:
    """Put every ``model.layers[i]`` under ``kind`` (a ``KeptInputCheckpointed``), in place;
    parameter order is kept."""
    _built_in_layers(model, kind.__name__)
    return _wrap_layers(model, lambda layer: kind(layer, compiled))
