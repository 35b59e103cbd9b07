"""A GPT-2 style decoder: LayerNorm, learned positions, GELU MLP, tied embeddings.

The second built-in architecture, so passes are not tuned to Llama alone. It
differs where it matters for activation planning: biased Linears, LayerNorm
(saves mean and rstd), GELU instead of SwiGLU, a fused qkv projection, and an
lm_head that shares its weight with the token embedding.

Module names follow nanoGPT (``wte``, ``wpe``, ``layers.<i>.attn.c_attn``,
``layers.<i>.mlp.c_fc``, ``ln_f``), with the layer stack named ``layers`` as
in every built-in model, because the tracer reads the layer index from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPTModel"]

INIT_STD = 0.02
"""Standard deviation of every Linear and Embedding weight (GPT-2's choice)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape and numerics of a GPT-2 style decoder."""

    vocab_size: int
    """Number of token ids; size of the (tied) embedding table and of the logits."""
    hidden: int
    """Width of the residual stream (d_model)."""
    n_layers: int
    """Number of blocks in ``layers``."""
    n_heads: int
    """Number of attention heads; ``hidden`` must be a multiple of it."""
    intermediate: int
    """Width of the GELU MLP (GPT-2 uses 4 * hidden)."""
    max_seq_len: int
    """Rows of the learned position table; longer inputs are rejected."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm."""
    dropout: float = 0.0
    """Dropout probability on the embeddings, the attention output and the MLP output."""
    bias: bool = True
    """Whether Linears and LayerNorms carry a bias (GPT-2: yes)."""

    def __post_init__(self) -> None:
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.n_heads


class GPTAttention(nn.Module):
    """Causal self-attention with one fused qkv projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    """c_proj(gelu(c_fc(x))), tanh-approximated GELU as in GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, cfg.intermediate, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.c_fc(x), approximate="tanh")  # (B, T, I)
        return self.c_proj(h)  # (B, T, C)


class GPTBlock(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.mlp_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.ln_1(x)))  # (B, T, C)
        x = x + self.mlp_dropout(self.mlp(self.ln_2(x)))  # (B, T, C)
        return x


class GPTModel(nn.Module):
    """GPT-2 style causal language model: ``model(input_ids (B, T)) -> logits (B, T, V)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.max_seq_len, config.hidden)
        self.emb_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one (V, C) parameter, counted once
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, INIT_STD) weights, zero biases, LayerNorm to identity.

        Draws from the global RNG in module order, so ``torch.manual_seed``
        before construction fixes the weights. The tied lm_head is visited
        as a Linear after ``wte``, so the shared weight is drawn twice; the
        second draw is the one kept, deterministically.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) for token ids (B, T); position t sees tokens 0..t only."""
        return self.lm_head(self.hidden_states(input_ids))  # (B, T, V)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final (normed) hidden state (B, T, C): ``forward`` is ``lm_head`` of it."""
        T = input_ids.shape[1]
        # A symbolic-friendly bound check: under mark_dynamic it becomes a range
        # assertion on T instead of specialising the graph to one length. The
        # message closure must hold only constants, or dynamo breaks the graph.
        torch._check(T <= self.config.max_seq_len, lambda: "sequence length exceeds max_seq_len")
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.emb_dropout(self.wte(input_ids) + self.wpe(pos))  # (B, T, C)
        for block in self.layers:
            x = block(x)  # (B, T, C)
        return self.ln_f(x)  # (B, T, C)
