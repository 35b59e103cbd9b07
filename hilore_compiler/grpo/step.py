"""The whole actor step as one compiled graph: forward, token log-probs, GRPO loss.

``compiled_step(model, config)`` returns ``step(input_ids, old_logprobs,
advantages, mask) -> loss``, ``torch.compile``d as one graph. Compiling the
policy alone stops at the logits, and the loss side then runs eagerly where
no planner sees it: the lm_head matmul, the (B, T-1, V) fp32 logits kept for
logsumexp's backward and their gradients, which with a 128k vocabulary and
long responses hold most of a step's memory. Inside one graph the hilore
backend plans them as recovery units like any other (``lm_head.mm`` and the
log-softmax statistics under the root module, the loss's pointwise ops).

``chunk_tokens=N`` computes the log-probs ``N`` tokens at a time under
``torch.utils.checkpoint`` (``models.logprobs.chunked_token_logprobs``), so
the full logits tensor is never alive at once; with ``checkpoint_chunks=False``
the planner decides per chunk instead, and ``chunks.choose_chunk_tokens``
chooses the chunk size itself (priced by the memory model, timed).

The model must expose its final hidden state and output projection for the
chunked path: the built-in models have ``hidden_states(input_ids)`` and
``lm_head``; a Hugging Face ``*ForCausalLM`` has ``base_model(...)
.last_hidden_state`` and ``get_output_embeddings()``. Models that change the
logits after the projection (a bias, Gemma-2's soft-capping, a logit scale)
are not supported by the chunked path.

torch before 2.13 (2.10, 2.11 and 2.12 checked) miscompiles checkpointed
chunks on the CPU: plain Inductor, with or without hilore, returns the
gradients of a Llama-style step (RMSNorm weight before the head, GRPO loss)
about 40% off, where eager and ``aot_eager`` are exact; the chunks without
checkpoint are exact. ``compiled_step`` warns about it there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..backend.report import HiLoReWarning
from ..models.logprobs import chunked_token_logprobs, token_logprobs
from ..passes.capture import fresh_code
from .config import GRPOConfig
from .loss import grpo_loss

__all__ = ["compiled_step", "hidden_states", "output_weight", "step_fn"]

#: ``step(input_ids (B, T), old_logprobs (B, T-1), advantages (B,), mask (B, T-1)) -> loss ()``.
StepFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def hidden_states(model: nn.Module, input_ids: Tensor) -> Tensor:
    """The final hidden state (B, T, C) that ``output_weight(model)`` projects to logits."""
    if hasattr(model, "hidden_states"):  # the built-in models
        return model.hidden_states(input_ids)
    base = getattr(model, "base_model", None)  # Hugging Face: the decoder without its head
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} exposes no final hidden state: give it "
                        "hidden_states(input_ids), or use a Hugging Face *ForCausalLM")
    return base(input_ids=input_ids).last_hidden_state


def output_weight(model: nn.Module) -> Tensor:
    """The (V, C) lm_head weight; raises when the head is not a plain bias-free projection."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise TypeError(f"chunked log-probs need a bias-free nn.Linear lm_head, got {head!r}")
    return head.weight


def _logits(model: nn.Module, input_ids: Tensor) -> Tensor:
    out = model(input_ids)
    return out if isinstance(out, Tensor) else out.logits  # Hugging Face returns an output record


def step_fn(model: nn.Module, config: GRPOConfig, *, chunk_tokens: int | None = None,
            checkpoint_chunks: bool = True) -> StepFn:
    """The uncompiled actor step: the eager reference of ``compiled_step``."""

    def step(input_ids: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        if chunk_tokens is None:
            logprobs = token_logprobs(_logits(model, input_ids), input_ids)  # (B, T-1) fp32
        else:
            logprobs = chunked_token_logprobs(hidden_states(model, input_ids), output_weight(model),
                                              input_ids, chunk_tokens,
                                              checkpoint_chunks=checkpoint_chunks)  # (B, T-1) fp32
        return grpo_loss(logprobs, old_logprobs, advantages, mask, config)

    return step


def checkpointed_chunks_miscompiled(torch_version: str, device_type: str) -> bool:
    """Whether this torch's Inductor computes wrong gradients for checkpointed log-prob chunks.

    Seen on the CPU with torch 2.10, 2.11 and 2.12 (a pre-release of 2.13
    counts as before it); 2.13 is exact. CUDA is not known to be affected.
    """
    return device_type == "cpu" and torch.torch_version.TorchVersion(torch_version) < "2.13"


def compiled_step(
    model: nn.Module,
    config: GRPOConfig,
    *,
    backend: str | Callable[..., Any] = "hilore",
    options: Mapping[str, Any] | None = None,
    chunk_tokens: int | None = None,
    checkpoint_chunks: bool = True,
    dynamic: bool | None = None,
) -> StepFn:
    """``torch.compile`` of the whole actor step (forward, fp32 token log-probs, GRPO loss) as one graph.

    Args:
        model: the policy; its parameters get the gradients of ``loss.backward()``.
        config: the GRPO loss options.
        backend: a ``torch.compile`` backend name or object (a ``HiLoReBackend``
            keeps its plans and partition records for inspection).
        options: the backend's options (``{"memory_budget": "1.0x-gc"}``).
        chunk_tokens: compute log-probs this many tokens at a time under
            checkpoint (see the module docstring); None: all at once.
        checkpoint_chunks: False computes the chunks without checkpoint, so
            that the hilore backend plans each chunk's logits (store,
            compress or recompute) instead of always recomputing them.
        dynamic: ``torch.compile``'s. The hilore backend plans dynamic graphs
            over the lengths they meet (unchunked steps of changing length
            stay one graph); with ``chunk_tokens`` the number of chunks
            follows the length, so dynamo compiles a graph per chunk count.
            Pass False where one process compiles steps of several chunk
            sizes, or dynamo turns the chunk size into a symbol.

    Returns:
        ``step(input_ids (B, T), old_logprobs (B, T-1), advantages (B,) or (B, T-1),
        mask (B, T-1)) -> loss``, a scalar to call ``backward()`` on. The loss is
        normalised over this call's batch (``grpo_loss`` without totals).
    """
    if chunk_tokens is not None and checkpoint_chunks:
        device = next(model.parameters()).device.type
        if checkpointed_chunks_miscompiled(torch.__version__, device):
            warnings.warn(
                f"torch {torch.__version__}'s Inductor computes wrong gradients for checkpointed log-prob "
                f"chunks on the {device} (about 40% off on a Llama-style step): use torch >= 2.13, or "
                "compiled_step(..., checkpoint_chunks=False)", HiLoReWarning, stacklevel=2)
    kwargs: dict[str, Any] = {"backend": backend, "dynamic": dynamic}
    if options is not None:
        kwargs["options"] = dict(options)
    # A code object per compiled step: dynamo caches compiled frames per code
    # object, and every step_fn closure shares one (see passes.capture.fresh_code).
    step = fresh_code(step_fn(model, config, chunk_tokens=chunk_tokens, checkpoint_chunks=checkpoint_chunks))
    return torch.compile(step, **kwargs)
