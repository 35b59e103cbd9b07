"""The offloading peers, CUDA only: what backward keeps goes to pinned host memory.

- ``gc-offload``: GC whose checkpoints, each decoder layer's input hidden
  states, live in pinned host memory (``OffloadCheckpointed``). It is what
  Hugging Face's ``gradient_checkpointing_kwargs={"offload": True}`` does
  (transformers PR #48444: its checkpoint function wrapped in
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so the layer
  inputs the non-reentrant checkpoint saves go to the host; transformers
  5.10.4, installed here, predates it and passes ``gradient_checkpointing_kwargs``
  to ``torch.utils.checkpoint.checkpoint`` unchanged) and what Unsloth's
  offloaded gradient checkpointing does (``Unsloth_Offloaded_Gradient_Checkpointer``:
  an autograd.Function keeping ``hidden_states.to("cpu", non_blocking=True)``,
  recomputing the layer in backward). Built as Unsloth's is, on
  ``checkpointing.KeptInputCheckpointed``, because dynamo (torch 2.13) will
  not trace ``save_on_cpu``: a model compiled with Hugging Face's form falls
  back to eager whole, while here the layers run compiled as ``gc-int8``'s do.
- ``sac-offload``: torchtitan's op-level selective AC (``sac-op``) whose saved
  outputs are ``CheckpointPolicy.MUST_CPU_OFFLOAD`` instead of ``MUST_SAVE``.
  In torch 2.13 that policy alone offloads nothing: eager SAC treats it as a
  recompute (``_CachingTorchDispatchMode`` stores only ``*_SAVE`` outputs) and
  the partitioner reads it as no tag at all (pytorch PR #185015, open, would
  make the policy alone suffice). The offload itself is the partitioner's
  (``torch._functorch._activation_offloading``), switched on as torch's own
  test of it does (``enable_activation_offloading`` and a ``joint_custom_pass``
  setting ``should_offload``) and as torchtitan's graph trainer does beside
  SAC: ``offload_tagged`` turns every ``MUST_CPU_OFFLOAD`` node into a
  ``MUST_SAVE`` one marked ``should_offload``, which the partitioner then moves
  to the host after the forward's last use (``prims.device_put``) and back
  before the backward's first. Multi-output ops (attention) are not moved:
  torch's pass refuses ``getitem`` nodes, so their outputs stay saved on the GPU.

On a CPU both would copy host memory to host memory and free nothing, so
``prepare`` refuses a CPU device (``CUDA_ONLY`` says why).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config  # not imported by ``import torch``; holds the offloading switches
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .checkpointing import KeptInputCheckpointed, _sac_save_ops, op_sac_policy, wrap_layers, wrap_layers_kept

#: Why each offloading method refuses a CPU device.
CUDA_ONLY = {
    "gc-offload": "it keeps each layer's input in pinned host memory instead of GPU memory; on a CPU the "
                  "input is in host memory already, so offloading frees nothing",
    "sac-offload": "CheckpointPolicy.MUST_CPU_OFFLOAD moves saved activations from GPU memory to host "
                   "memory; on a CPU they are in host memory already, so offloading frees nothing",
}

#: The methods, in the order ``methods.METHODS`` lists them.
METHODS = tuple(CUDA_ONLY)

#: Labels for the report.
LABELS = {"gc-offload": "GC, checkpoints in host memory", "sac-offload": "selective AC (op), saved to host"}


class OffloadCheckpointed(KeptInputCheckpointed):
    """``KeptInputCheckpointed`` keeping the layer input in pinned host memory (``to_host``);
    backward copies it back to the layer's device before the recompute."""

    def keep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (to_host(x),)

    def restore(self, kept: tuple[torch.Tensor, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        (host,) = kept
        return host.to(device, non_blocking=host.is_pinned())


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x``, pinned where CUDA is, as ``save_on_cpu(pin_memory=True)`` packs it.

    The copy is asynchronous from a CUDA tensor: the caching allocator reuses
    ``x``'s memory only for kernels queued after it on the same stream, and the
    copy back is queued on that stream too.
    """
    pinned = x.is_cuda
    host = torch.empty(x.size(), dtype=x.dtype, layout=x.layout, pin_memory=pinned)
    host.copy_(x, non_blocking=pinned)
    return host


def op_offload_policy(save: frozenset, meta: dict[str, int], ctx: Any, op: Any, *args: Any,
                      **kwargs: Any) -> CheckpointPolicy:
    """``checkpointing.op_sac_policy`` (torchtitan's op-level policy) with what it saves
    ``MUST_CPU_OFFLOAD`` instead of ``MUST_SAVE``."""
    policy = op_sac_policy(save, meta, ctx, op, *args, **kwargs)
    return CheckpointPolicy.MUST_CPU_OFFLOAD if policy == CheckpointPolicy.MUST_SAVE else policy


def _op_offload_contexts(save: frozenset) -> tuple[Any, Any]:
    # A fresh counter per checkpointed call, as ``checkpointing._op_sac_contexts``.
    policy = functools.partial(op_offload_policy, save, collections.defaultdict(int))
    return create_selective_checkpoint_contexts(policy)


def op_offload_context_fn() -> Callable[[], Any]:
    """``context_fn`` for ``checkpoint`` with ``op_offload_policy`` over the saved ops of ``sac``."""
    return functools.partial(_op_offload_contexts, _sac_save_ops())


def offload_tagged(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """``torch._functorch.config.joint_custom_pass``: every node SAC tagged ``MUST_CPU_OFFLOAD``
    is saved (``MUST_SAVE``) and marked for the partitioner's offloading (``should_offload``)."""
    for node in gm.graph.nodes:
        if node.meta.get("recompute") == CheckpointPolicy.MUST_CPU_OFFLOAD:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            node.meta["should_offload"] = True
    return gm


def offload_compile_context() -> Callable[[], contextlib.AbstractContextManager]:
    """The config patch ``sac-offload`` compiles under: the partitioner's offloading on,
    ``offload_tagged`` run on the joint graph, AOTAutograd's cache off (PyTorch leaves
    ``joint_custom_pass`` out of its cache key, so a cached partition without it could be served)."""
    return functools.partial(torch._functorch.config.patch, enable_activation_offloading=True,
                             joint_custom_pass=offload_tagged, enable_autograd_cache=False)


def _missing_in_torch() -> str | None:
    """What ``sac-offload`` needs that this torch lacks, or None."""
    if not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        return "torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD"
    if not hasattr(torch._functorch.config, "enable_activation_offloading"):
        return "torch._functorch.config.enable_activation_offloading"
    return None


def prepare(name: str, model: nn.Module) -> tuple[nn.Module, Callable[[], contextlib.AbstractContextManager]]:
    """Wrap ``model``'s layers (in place) as method ``name`` runs them: the compiled policy and
    the config patch its first call compiles under.

    Raises:
        ValueError: ``model`` is not on a CUDA device, or this torch lacks what
            ``sac-offload`` needs.
    """
    if next(model.parameters()).device.type != "cuda":
        raise ValueError(f"{name} runs on CUDA only: {CUDA_ONLY[name]}")
    if name == "gc-offload":
        return torch.compile(wrap_layers_kept(model, OffloadCheckpointed)), contextlib.nullcontext
    missing = _missing_in_torch()
    if missing is not None:
        raise ValueError(f"{name} needs {missing}, which torch {torch.__version__} lacks")
    return torch.compile(wrap_layers(model, op_offload_context_fn())), offload_compile_context()

