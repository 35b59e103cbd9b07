"""A Llama-style decoder: RMSNorm, rotary attention (optionally grouped-query), SwiGLU.

Module names follow the Hugging Face Llama layout without the ``model.``
prefix (``embed_tokens``, ``layers.<i>.self_attn.q_proj``,
``layers.<i>.mlp.gate_proj``, ``norm``, ``lm_head``), because the tracer reads
the layer index from the ``layers.<i>.`` prefix of a module fqn.

Everything is built from shapes alone: no buffers computed from data at
construction, so the model builds under ``with torch.device("meta"):`` and the
rotary tables are made in ``forward`` from ``torch.arange(T)``, which keeps the
sequence length symbolic under ``torch.compile`` with ``mark_dynamic``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "LlamaModel", "RMSNorm", "rotary_cos_sin", "apply_rotary"]

INIT_STD = 0.02
"""Standard deviation of every Linear and Embedding weight (GPT-2 / Llama default)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Shape and numerics of a Llama-style decoder."""

    vocab_size: int
    """Number of token ids; size of the embedding table and of the logits."""
    hidden: int
    """Width of the residual stream (d_model)."""
    n_layers: int
    """Number of decoder layers in ``layers``."""
    n_heads: int
    """Number of query heads; ``hidden`` must be a multiple of it."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); divides ``n_heads``."""
    intermediate: int
    """Width of the SwiGLU MLP (gate and up projections)."""
    max_seq_len: int
    """Longest sequence the model is meant for; RoPE itself has no hard limit,
    but plans and traces are sized from it."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm's rsqrt."""
    dropout: float = 0.0
    """Dropout probability on the attention output and the MLP output (0 = none);
    non-zero gives tests a random op whose seed recompute must preserve."""

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.n_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 (bf16 sums of squares lose too much)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # (..., C)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., C)
        return x32.to(x.dtype) * self.weight


def rotary_cos_sin(
    seq_len: int | torch.SymInt, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (T, head_dim) in fp32, built from ``arange(T)``.

    Made per call rather than sliced from a buffer: slicing by a Python int
    would specialise the compiled graph to one length, and a precomputed buffer
    holds no data on the meta device.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # (hd/2,)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    freqs = torch.outer(pos, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd): the "rotate half" layout
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (..., hd/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., hd)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, hd) by position; cos/sin are (T, hd) fp32."""
    x32 = x.float()  # rotate in fp32: bf16 angles drift at long positions
    out = x32 * cos + _rotate_half(x32) * sin  # (B, H, T, hd)
    return out.to(x.dtype)


class LlamaAttention(nn.Module):
    """Causal self-attention with rotary positions and grouped-query heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kv_width = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:
            # Share each kv head across its query group; repeat_interleave keeps
            # head h reading kv head h // groups, the usual GQA layout.
            k = k.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(groups, dim=1)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (B, T, I)
        return self.down_proj(act)  # (B, T, C)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)
        # nn.Dropout with p=0 is an identity and adds no op to the graph.
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.mlp_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.self_attn(self.input_layernorm(x), cos, sin))  # (B, T, C)
        x = x + self.mlp_dropout(self.mlp(self.post_attention_layernorm(x)))  # (B, T, C)
        return x


class LlamaModel(nn.Module):
    """Llama-style causal language model: ``model(input_ids (B, T)) -> logits (B, T, V)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)  # untied
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, INIT_STD) for every Linear and Embedding weight, ones for norms.

        Draws from the global RNG in module order, so ``torch.manual_seed``
        before construction fixes the weights; a no-op on the meta device.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T); position t sees tokens 0..t only."""
        return self.lm_head(self.hidden_states(input_ids))  # (B, T, V)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden state (B, T, C): ``forward`` is ``lm_head`` of it.

        For losses that apply ``lm_head`` themselves, chunk by chunk
        (``models.logprobs.chunked_token_logprobs``).
        """
        T = input_ids.shape[1]
        cfg = self.config
        cos, sin = rotary_cos_sin(T, cfg.head_dim, cfg.rope_theta, input_ids.device)  # (T, hd)
        x = self.embed_tokens(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, C)
        return self.norm(x)  # (B, T, C)
