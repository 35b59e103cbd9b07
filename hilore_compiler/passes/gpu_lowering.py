"""Lower attention as a GPU does, where no GPU is there to choose.

``F.scaled_dot_product_attention`` picks its kernel at trace time through
``aten::_fused_sdp_choice``. On a CUDA device that is flash attention or
memory-efficient attention; on the meta device, and for fake CUDA tensors
on a CPU-only build of torch, the choice falls to the math path, which
decomposes attention into a dozen ops with other saved activations. A plan
made on such a graph names units a GPU never has. Inside ``lowered_as_gpu()``
the choice for those tensors is the GPU's (``gpu_sdp_backend``), so a
roofline trace on meta, or a fake-CUDA graph, saves what a GPU saves.

This stands in for the CUDA kernel's choice and cannot see its runtime
checks (compute capability, the cuDNN version, a user's ``sdpa_kernel``
context): ``bench/gpu_session.sh`` compares it with the real choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: ``torch.nn.attention.SDPBackend`` values as ``_fused_sdp_choice`` returns them.
MATH, FLASH, EFFICIENT = 0, 1, 2

#: Head sizes flash attention supports (multiples of 8 up to 256), and the
#: alignment memory-efficient attention needs of 16-bit and fp32 heads.
FLASH_MAX_HEAD_DIM = 256


def gpu_sdp_backend(query: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float) -> int:
    """The kernel an H100-class GPU picks for these inputs, in torch's default order:
    flash for 16-bit inputs without a mask, memory-efficient otherwise, math
    when neither takes the head size."""
    head_dim = query.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and attn_mask is None and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM:
        return FLASH
    if head_dim % (8 if half else 4) == 0:
        return EFFICIENT
    return MATH


#: Memory-efficient attention reads its bias in rows padded to this many
#: elements (``pad_bias`` in ATen's attention.cpp).
EFFICIENT_BIAS_ALIGNMENT = 16


def _lowered_here(query: torch.Tensor) -> bool:
    """Tensors whose sdpa choice would fall to math for want of a CUDA kernel:
    meta tensors, and fake CUDA tensors on a torch built without CUDA."""
    # A CUDA tensor in a build without CUDA can only be fake (it may come
    # wrapped, as AOTAutograd's functional tensors do).
    return query.device.type == "meta" or (query.device.type == "cuda" and not torch.backends.cuda.is_built())


def _efficient_bias(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The attention bias as ATen hands it to memory-efficient attention: a
    float bias in rows padded to the kernel's alignment, expanded to (B, H, L, S)."""
    strides = mask.stride()
    aligned = strides[-1] == 1 and all(st % EFFICIENT_BIAS_ALIGNMENT == 0 for st in strides[:-1])
    if not aligned:
        width = mask.shape[-1]
        pad = EFFICIENT_BIAS_ALIGNMENT - width % EFFICIENT_BIAS_ALIGNMENT
        mask = torch.nn.functional.pad(mask, (0, pad))[..., :width]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """``aten::scaled_dot_product_attention`` as ATen's CUDA path runs it, for tensors
    ``_lowered_here``; ATen's own composite for every other tensor."""
    def aten_composite(attn_mask):
        return torch.ops.aten.scaled_dot_product_attention.default._op_dk(
            torch._C.DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p, is_causal,
            scale=scale, enable_gqa=enable_gqa)

    if not _lowered_here(query):
        return aten_composite(attn_mask)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # ATen's convert_boolean_attn_mask, op for op, so the saved mask is the CPU graph's too.
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"),
                                torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device))
    choice = gpu_sdp_backend(query, attn_mask, dropout_p)
    if enable_gqa and query.shape[-3] != key.shape[-3] and choice != FLASH:
        choice = MATH  # of the fused kernels only flash takes grouped heads unexpanded
    if choice == FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if choice == EFFICIENT:
        bias = None if attn_mask is None else _efficient_bias(attn_mask, query, key)
        # ATen computes the log-sum-exp only when backward will need it.
        needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, needs_lse, dropout_p, is_causal, scale=scale)[0]
    return aten_composite(attn_mask)  # the math path, with the mask as converted above


@contextlib.contextmanager
def lowered_as_gpu() -> Iterator[None]:
    """Within this block, attention on meta and fake CUDA tensors lowers to the GPU's kernel.

    A Python kernel for sdpa's composite, which the Python dispatcher that
    AOTAutograd traces under runs in place of ATen's; it hands every other
    tensor to ATen's own composite, and is removed on exit.
    """
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    op = torch.ops.aten.scaled_dot_product_attention.default
    if key in op.py_kernels:
        yield  # already lowered by an enclosing block
        return
    op.py_impl(key)(_sdpa)
    try:
        yield
    finally:
        del op.py_kernels[key]
        op._dispatch_cache.clear()
