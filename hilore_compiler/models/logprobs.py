"""Per-token log-probabilities of a sequence under the policy's logits.

Shift convention (the standard one for causal LMs): the logits at position t
predict the token at position t + 1, so

    logprobs[b, t] = log p(input_ids[b, t + 1] | input_ids[b, : t + 1])
                   = log_softmax(logits[b, t])[input_ids[b, t + 1]]

for t in 0 .. T-2. The output therefore has T - 1 columns; column t belongs to
token t + 1. The first token has no log-prob (nothing predicts it) and the
logits of the last position predict nothing inside the sequence.

``chunked_token_logprobs`` computes the same values from the final hidden
state and the lm_head weight, a chunk of tokens at a time: no (B, T, V)
logits tensor is alive at once in forward. Under ``torch.utils.checkpoint``
(the default) each chunk's logits are recomputed in backward, as fused
log-prob kernels do; without it, each chunk's logits are a recovery unit of
their own that a planner may store, compress or recompute.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_token_logprobs", "token_logprobs", "response_logprobs"]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t < T-1, in at least fp32.

    Args:
        logits: (B, T, V) policy output, any float dtype.
        input_ids: (B, T) the same tokens that produced ``logits``.

    Returns:
        (B, T-1) in fp32 (fp64 if ``logits`` is fp64); column t is the
        log-prob of token t + 1.

    Computed as ``gather(logits) - logsumexp(logits)`` rather than
    ``log_softmax(...).gather(...)``: the same value, but no (B, T-1, V)
    log-softmax tensor is materialised, nor kept alive for backward; only a
    (B, T-1) row statistic is. fp32 because bf16 logsumexp over a large vocab
    loses several bits of the result.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    # At least fp32: upcast bf16/fp16, but keep fp64 (gradcheck, references).
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    pred = logits[:, :-1].to(work_dtype)  # (B, T-1, V): position t predicts token t+1
    target = input_ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
    picked = pred.gather(-1, target).squeeze(-1)  # (B, T-1)
    return picked - torch.logsumexp(pred, dim=-1)  # (B, T-1)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``target`` (n,) under the logits ``hidden (n, C) @ weight.T``, at least fp32."""
    logits = hidden @ weight.t()  # (n, V), the model's dtype, as lm_head computes it
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (n, V)
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (n,)
    return picked - torch.logsumexp(logits, dim=-1)  # (n,)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    chunk_tokens: int,
    *,
    checkpoint_chunks: bool = True,
) -> torch.Tensor:
    """``token_logprobs(hidden @ lm_head_weight.T, input_ids)``, ``chunk_tokens`` tokens at a time.

    Args:
        hidden: (B, T, C) final hidden state (after the last norm).
        lm_head_weight: (V, C) output projection without bias (tied or not).
        input_ids: (B, T) the tokens that produced ``hidden``.
        chunk_tokens: tokens per chunk (of the B * (T - 1) predicting
            positions); the last chunk may be shorter.
        checkpoint_chunks: run each chunk under checkpoint (its logits always
            recomputed in backward). False leaves the chunks as plain ops, so
            that the hilore backend decides per chunk whether backward gets
            its logits stored, compressed or recomputed.

    Returns:
        (B, T-1) in at least fp32, equal to the unchunked log-probs up to
        matmul summation order; gradients likewise.

    Each chunk runs under non-reentrant ``torch.utils.checkpoint``: forward
    keeps only the chunk's hidden rows (its inputs), and backward recomputes
    the chunk's (chunk, V) logits, so the largest vocabulary-sized tensors
    alive are one chunk's logits and their gradient, not the (B, T-1, V) ones.
    Under ``torch.compile`` the chunks become checkpointed regions that the
    partitioner recomputes.
    """
    if hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match input_ids {tuple(input_ids.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    B, T, C = hidden.shape
    pred = hidden[:, :-1].reshape(B * (T - 1), C)  # (N, C): row b*(T-1)+t predicts token t+1 of b
    target = input_ids[:, 1:].reshape(B * (T - 1))  # (N,)
    chunks = zip(pred.split(chunk_tokens), target.split(chunk_tokens))
    if checkpoint_chunks:
        parts = [checkpoint(_chunk_logprobs, h, lm_head_weight, y, use_reentrant=False) for h, y in chunks]
    else:
        parts = [_chunk_logprobs(h, lm_head_weight, y) for h, y in chunks]
    return torch.cat(parts).view(B, T - 1)  # (B, T-1)


def response_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens only, with the mask shifted to match.

    Args:
        logits: (B, T, V) policy output.
        input_ids: (B, T) prompt followed by response (and padding).
        response_mask: (B, T) bool or 0/1, true where ``input_ids`` is a
            response token (the tokens GRPO scores), aligned with ``input_ids``.

    Returns:
        ``(logprobs, mask)``, both (B, T-1): ``mask = response_mask[:, 1:]`` as
        bool, aligned with ``token_logprobs``'s columns, and ``logprobs`` is
        zero wherever ``mask`` is false (so sums over it need no further masking).
    """
    if response_mask.shape != input_ids.shape:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    mask = response_mask[:, 1:].bool()  # (B, T-1): column t is token t+1
    lp = token_logprobs(logits, input_ids)  # (B, T-1)
    # where() rather than multiply: a -inf log-prob at a masked position must not become nan.
    return torch.where(mask, lp, torch.zeros_like(lp)), mask
