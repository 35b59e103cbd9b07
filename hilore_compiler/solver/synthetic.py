"""Synthetic traces of a Llama-style decoder, for tests, demos and scale checks.

Costs come from a roofline (FLOPs / peak rate, bytes / bandwidth), not from a
measurement, and the trace says so (``cost_source = "roofline:synthetic"``).
Every size is ``bytes-per-token x B x S``: attention's quadratic part appears
only in its recompute time, as with a flash kernel that saves no S x S matrix.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from ..tracefile import CodecCost, RecoveryUnit, Trace
from ..vocabulary import READ_PAST_UNITS

#: Codec error on a typical activation: bf16 keeps 8 mantissa bits (rms relative
#: rounding error ~2^-9/sqrt(3)); int8 row-wise absmax on a ~4-sigma row max has
#: a step of ~sigma/32 (rms error ~1% of sigma); fp8 e4m3 keeps 3 mantissa bits.
REL_L2 = {"bf16": 1.1e-3, "int8": 8e-3, "fp8": 2.5e-2}
#: Heavy-tailed activations (after SiLU, gated products) quantise worse with an
#: absmax scale: the row max sits further out, so the step is coarser.
HEAVY_TAIL_KINDS = {"mlp.act": 1.5, "mlp.mul": 1.5}


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticConfig:
    """Shape of the synthetic decoder and of the roofline device."""

    num_layers: int = 32
    hidden: int = 4096
    intermediate: int = 11008
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 32000
    batch: int = 1
    seq_len: int = 2048
    #: Bytes per activation element (4: fp32 training, where bf16 halves it).
    dtype_bytes: int = 4
    #: Roofline device: tf32 tensor-core FLOP/s and HBM bytes/s of a recent GPU.
    flops_per_s: float = 100e12
    bytes_per_s: float = 2e12
    codecs: tuple[str, ...] = ("bf16", "int8", "fp8")
    #: Fill ``unit.sensitivity`` (as calibration would) instead of leaving it empty.
    calibrated: bool = False
    #: Kinds marked not recomputable (as random ops without saved seeds would be).
    not_recomputable: tuple[str, ...] = ()


class _Builder:
    """Accumulates units of one synthetic trace, costing each by roofline."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        self.tokens = cfg.batch * cfg.seq_len
        self.units: list[RecoveryUnit] = []
        self.per_token: dict[str, int] = {}

    def add(self, key: str, layer: int | None, kind: str, op: str, width: int,
            inputs: tuple[str, ...], flops_per_token: float = 0.0,
            transient_per_token: int = 0, elem_bytes: int | None = None) -> str:
        """Add a unit of ``width`` elements per token; returns its key."""
        cfg = self.cfg
        elem = cfg.dtype_bytes if elem_bytes is None else elem_bytes
        per_token = width * elem
        nbytes = per_token * self.tokens
        read = sum(self.per_token[k] for k in inputs) * self.tokens
        # Elementwise ops are bandwidth-bound (read inputs, write output);
        # matmuls and attention FLOP-bound; the roofline takes the larger.
        seconds = max((read + nbytes) / cfg.bytes_per_s, flops_per_token * self.tokens / cfg.flops_per_s)
        if kind == "attn.sdpa":  # causal attention: ~2 * S^2 * hidden FLOPs per sample, forward
            seconds = max(seconds, 2 * cfg.batch * cfg.seq_len**2 * cfg.hidden / cfg.flops_per_s)
        self.per_token[key] = per_token
        self.units.append(RecoveryUnit(
            key=key, layer=layer, kind=kind, op=op, dtype=f"float{8 * elem}",
            bytes=f"B*S*{per_token}", bytes_at_trace=nbytes, recompute_from=inputs,
            recompute_transient=f"B*S*{transient_per_token}", recompute_time_s=seconds,
            recompute_flops=int(flops_per_token * self.tokens), recompute_source="roofline:synthetic",
            recomputable=kind not in cfg.not_recomputable,
            not_recomputable_reason="synthetic: marked not recomputable" if kind in cfg.not_recomputable else None,
            codecs=self._codecs(kind, width, elem), sensitivity=self._sensitivity(kind),
        ))
        return key

    def _codecs(self, kind: str, width: int, elem: int) -> dict[str, CodecCost]:
        cfg, out = self.cfg, {}
        full = width * elem * self.tokens
        payload = {"bf16": 2 * width, "int8": width + 4, "fp8": width}  # per token; int8: + fp32 row scale
        for name in cfg.codecs:
            if name == "bf16" and elem <= 2:
                continue  # already 16-bit: nothing to gain
            tensor_scale = 4 if name == "fp8" else 0  # fp8: one fp32 scale per tensor
            comp = payload[name] * self.tokens + tensor_scale
            small = width == 1  # per-token statistics: kept exact, saving nothing
            out[name] = CodecCost(
                bytes=f"B*S*{payload[name]} + {tensor_scale}",
                time_s=2 * (full + comp) / cfg.bytes_per_s,  # encode + decode, bandwidth-bound
                rel_l2=REL_L2[name] * HEAVY_TAIL_KINDS.get(kind, 1.0), max_abs=0.0,
                source="roofline:synthetic", usable=not small,
                reason="per-token statistic, too small to compress" if small else None,
            )
        return out

    def _sensitivity(self, kind: str) -> dict[str, float]:
        if not self.cfg.calibrated:
            return {}
        # Stand-in for calibration: attention outputs and layer inputs reach
        # more of the gradient than a single MLP branch.
        weight = 2.0 if kind in ("attn.sdpa", "resid") else 1.0
        return {c: REL_L2[c] * HEAVY_TAIL_KINDS.get(kind, 1.0) * 0.03 * weight for c in self.cfg.codecs}


def _layer(b: _Builder, i: int, layer_input: str) -> tuple[str, str, str]:
    """Add one decoder layer's 18 units; returns (resid_mid, mlp.down, its input unit)."""
    c, p = b.cfg, f"model.layers.{i}"
    h, inter, kv = c.hidden, c.intermediate, c.hidden * c.kv_heads // c.heads
    x = b.add(f"{p}:add:0", i, "resid", "add", h, layer_input)
    n1 = b.add(f"{p}.input_layernorm:mul:0", i, "norm", "mul", h, (x,))
    b.add(f"{p}.input_layernorm:rsqrt:0", i, "norm.rstd", "rsqrt", 1, (x,), elem_bytes=4)
    q = b.add(f"{p}.self_attn.q_proj:mm:0", i, "attn.q", "mm", h, (n1,), 2 * h * h)
    k = b.add(f"{p}.self_attn.k_proj:mm:0", i, "attn.k", "mm", kv, (n1,), 2 * h * kv)
    v = b.add(f"{p}.self_attn.v_proj:mm:0", i, "attn.v", "mm", kv, (n1,), 2 * h * kv)
    qr = b.add(f"{p}.self_attn:rope:0", i, "attn.rope", "mul", h, (q,))
    kr = b.add(f"{p}.self_attn:rope:1", i, "attn.rope", "mul", kv, (k,))
    # The flash kernel's transient: the per-head logsumexp it rebuilds (fp32).
    o = b.add(f"{p}.self_attn:sdpa:0", i, "attn.sdpa", "sdpa", h, (qr, kr, v), transient_per_token=4 * c.heads)
    ao = b.add(f"{p}.self_attn.o_proj:mm:0", i, "attn.out", "mm", h, (o,), 2 * h * h)
    mid = b.add(f"{p}:add:1", i, "resid", "add", h, (x, ao))
    n2 = b.add(f"{p}.post_attention_layernorm:mul:0", i, "norm", "mul", h, (mid,))
    b.add(f"{p}.post_attention_layernorm:rsqrt:0", i, "norm.rstd", "rsqrt", 1, (mid,), elem_bytes=4)
    g = b.add(f"{p}.mlp.gate_proj:mm:0", i, "mlp.gate", "mm", inter, (n2,), 2 * h * inter)
    u = b.add(f"{p}.mlp.up_proj:mm:0", i, "mlp.up", "mm", inter, (n2,), 2 * h * inter)
    a = b.add(f"{p}.mlp.act_fn:silu:0", i, "mlp.act", "silu", inter, (g,))
    m = b.add(f"{p}.mlp:mul:0", i, "mlp.mul", "mul", inter, (a, u))
    d = b.add(f"{p}.mlp.down_proj:mm:0", i, "mlp.down", "mm", h, (m,), 2 * inter * h)
    return mid, d, x


def synthetic_trace(config: SyntheticConfig | None = None) -> Trace:
    """A Trace of a Llama-style decoder with ~18 recovery units per layer."""
    cfg = config or SyntheticConfig()
    b = _Builder(cfg)
    prev = (b.add("model.embed_tokens:embedding:0", None, "embed", "embedding", cfg.hidden, ()),)
    layer_inputs = []
    for i in range(cfg.num_layers):
        mid, down, x = _layer(b, i, prev)
        layer_inputs.append(x)
        prev = (mid, down)
    fn = b.add("model.norm:mul:0", None, "norm", "mul", cfg.hidden, prev)
    b.add("model.norm:rsqrt:0", None, "norm.rstd", "rsqrt", 1, prev, elem_bytes=4)
    logits = b.add("lm_head:mm:0", None, "head.logits", "mm", cfg.vocab, (fn,), 2 * cfg.hidden * cfg.vocab)
    b.add("loss:log_softmax:0", None, "loss.logprobs", "log_softmax", cfg.vocab, (logits,))
    outside = sum(t for k, t in b.per_token.items() if not k.startswith("model.layers."))
    one_layer = sum(t for k, t in b.per_token.items() if k.startswith("model.layers.0:") or k.startswith("model.layers.0."))
    # GC keeps each layer's input and everything outside the layers, and
    # rebuilds one layer at a time during backward.
    gc = sum(b.per_token[k] for k in layer_inputs) + outside + one_layer
    return Trace(
        fingerprint=f"synthetic-llama-L{cfg.num_layers}-H{cfg.hidden}-I{cfg.intermediate}",
        model=f"synthetic-llama-{cfg.num_layers}L", batch=cfg.batch, seq_len=cfg.seq_len,
        device="synthetic", cost_source="roofline:synthetic", units=tuple(b.units),
        gc_bytes=f"B*S*{gc}", store_bytes=f"B*S*{sum(b.per_token.values())}",
        num_layers=cfg.num_layers, notes=("synthetic trace: roofline costs, not measured",),
    )


#: Kinds drawn for random unit graphs (names only; they carry no cost).
_RANDOM_KINDS = ("norm", "attn.q", "attn.sdpa", "mlp.up", "mlp.act", "mlp.down")


def _random_codecs(rng: random.Random, nbytes: int, codecs: tuple[str, ...]) -> dict[str, CodecCost]:
    out = {}
    for name in codecs:
        if rng.random() < 0.75:
            shrink = 2 if name == "bf16" else 4
            out[name] = CodecCost(
                bytes=str(nbytes // shrink + rng.randint(0, 16)), time_s=rng.uniform(1e-4, 5e-3),
                rel_l2=rng.uniform(0.1, 2.0), max_abs=0.0, source="random",
                usable=rng.random() < 0.9, reason=None,
            )
    return out


def random_trace(seed: int, num_units: int = 5, *, codecs: tuple[str, ...] = ("bf16", "int8"),
                 calibrated_share: float = 0.5, read_until: bool = False) -> Trace:
    """A small random unit graph (sizes are constants) for checks against brute force.

    Units draw a layer (0, 1 or outside), bytes, recompute inputs among earlier
    units, a recompute workspace, codecs (some unusable) and, for a share of
    the codecs, a calibrated sensitivity; the rest fall back to the proxy.
    ``read_until``: each unit also draws the unit backward last needs it at,
    any later one, in its segment or another (``segments.carried_units``).
    """
    rng = random.Random(seed)
    units: list[RecoveryUnit] = []
    for i in range(num_units):
        nbytes = rng.randint(100, 5000)
        earlier = [u.key for u in units]
        inputs = tuple(sorted(rng.sample(earlier, k=min(len(earlier), rng.randint(0, 2)))))
        unit_codecs = _random_codecs(rng, nbytes, codecs)
        recomputable = rng.random() < 0.8
        units.append(RecoveryUnit(
            key=f"u{i}", layer=rng.choice([0, 0, 1, None]), kind=rng.choice(_RANDOM_KINDS), op="op",
            dtype="float32", bytes=str(nbytes), bytes_at_trace=nbytes, recompute_from=inputs,
            recompute_transient=str(rng.choice([0, 0, rng.randint(1, 800)])),
            recompute_time_s=rng.uniform(1e-4, 1e-2), recompute_flops=0, recompute_source="random",
            recomputable=recomputable, not_recomputable_reason=None if recomputable else "random",
            codecs=unit_codecs,
            sensitivity={c: rng.uniform(0.005, 0.1) for c in unit_codecs if rng.random() < calibrated_share},
        ))
    if read_until:
        keys = [u.key for u in units]
        units = [dataclasses.replace(u, read_until=rng.choice([*keys[i + 1:], READ_PAST_UNITS]))
                 for i, u in enumerate(units)]
    total = sum(u.bytes_at_trace for u in units)
    return Trace(
        fingerprint=f"random-{seed}-{num_units}" + ("-read" if read_until else ""), model=f"random-{num_units}u", batch=1, seq_len=1,
        device="none", cost_source="random", units=tuple(units), gc_bytes=str(total // 2),
        store_bytes=str(total), num_layers=2,
    )
