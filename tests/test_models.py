"""Built-in policy models: shapes, determinism, meta builds, causality, compile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from hilore_compiler.models import (
    MODEL_CONFIGS,
    GPTModel,
    LlamaModel,
    build_model,
    model_names,
    response_logprobs,
    token_logprobs,
)
from hilore_compiler.models.llama import apply_rotary, rotary_cos_sin

#: Policies built with real weights in tests; the GPU-sized ones are built on meta
#: (tinyllama-8l's 0.48e9 random weights took 20 s of the suite to initialise).
META_NAMES = ("llama-8b", "tinyllama-8l")
CPU_NAMES = [n for n in model_names() if n not in META_NAMES]


def _ids(vocab: int, B: int = 2, T: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)  # (B, T)


def test_registry_names_and_configs() -> None:
    assert {"tiny", "small", "llama-8b", "gpt-tiny", "llama-tiny-dropout"} <= set(model_names())
    assert MODEL_CONFIGS["llama-tiny-dropout"].dropout == pytest.approx(0.1)
    assert MODEL_CONFIGS["tiny"].dropout == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        MODEL_CONFIGS["tiny"].hidden = 1  # type: ignore[misc]


def test_unknown_model_name_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope'") as info:
        build_model("nope")
    for name in model_names():
        assert name in str(info.value)


def test_overrides_replace_fields_and_reject_unknown() -> None:
    model = build_model("tiny", n_layers=1, hidden=32)
    assert model.config.n_layers == 1 and len(model.layers) == 1
    assert model.layers[0].mlp.gate_proj.weight.shape == (128, 32)
    with pytest.raises(ValueError, match="unknown config fields"):
        build_model("tiny", n_layer=1)


@pytest.mark.parametrize("name", CPU_NAMES)
def test_forward_shape_and_config(name: str) -> None:
    model = build_model(name).eval()
    cfg = model.config
    assert cfg is not None and isinstance(model.layers, torch.nn.ModuleList)
    logits = model(_ids(cfg.vocab_size, B=3, T=7))
    assert logits.shape == (3, 7, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_module_fqns_follow_layer_naming() -> None:
    llama = dict(build_model("tiny").named_modules())
    for fqn in ["layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj", "layers.1.self_attn.v_proj",
                "layers.1.self_attn.o_proj", "layers.1.mlp.gate_proj", "layers.1.mlp.up_proj",
                "layers.1.mlp.down_proj", "layers.1.input_layernorm",
                "layers.1.post_attention_layernorm", "norm", "lm_head", "embed_tokens"]:
        assert fqn in llama, fqn
    assert llama["layers.0.self_attn.q_proj"].bias is None
    gpt = dict(build_model("gpt-tiny").named_modules())
    for fqn in ["layers.1.mlp.c_fc", "layers.1.mlp.c_proj", "layers.1.attn.c_attn", "ln_f", "wpe"]:
        assert fqn in gpt, fqn


def test_gqa_projection_widths() -> None:
    cfg = MODEL_CONFIGS["tiny"]
    attn = build_model("tiny").layers[0].self_attn
    assert attn.q_proj.weight.shape == (cfg.hidden, cfg.hidden)
    assert attn.k_proj.weight.shape == (cfg.n_kv_heads * cfg.head_dim, cfg.hidden)
    assert cfg.n_kv_heads < cfg.n_heads


@pytest.mark.parametrize("name", ["tiny", "gpt-tiny"])
def test_seed_determines_weights_without_touching_global_rng(name: str) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = build_model(name, seed=0), build_model(name, seed=0), build_model(name, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.mlp.c_fc.weight" if name == "gpt-tiny" else "layers.0.mlp.gate_proj.weight"],
                           sc["layers.0.mlp.c_fc.weight" if name == "gpt-tiny" else "layers.0.mlp.gate_proj.weight"])


def test_init_statistics() -> None:
    w = build_model("small").layers[0].mlp.up_proj.weight  # 176k samples of normal(0, 0.02)
    assert abs(w.mean().item()) < 1e-3
    assert w.std().item() == pytest.approx(0.02, rel=0.02)
    assert torch.equal(build_model("tiny").norm.weight, torch.ones(64))


def test_llama_8b_builds_on_meta_without_allocating() -> None:
    model = build_model("llama-8b", device="meta", dtype=torch.bfloat16)
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    n = sum(p.numel() for p in params)
    assert n == pytest.approx(8.03e9, rel=0.01)
    assert len(model.layers) == 32


def test_tinyllama_8l_has_tinyllamas_shapes_on_meta() -> None:
    model = build_model("tinyllama-8l", device="meta", dtype=torch.bfloat16)
    cfg = model.config
    assert (cfg.hidden, cfg.intermediate, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (2048, 5632, 32, 4, 32000)
    assert len(model.layers) == 8 and sum(p.numel() for p in model.parameters()) == pytest.approx(0.48e9, rel=0.02)
    logits = model(torch.zeros(2, 9, dtype=torch.long, device="meta"))
    assert logits.is_meta and logits.shape == (2, 9, 32000)


def test_meta_forward_gives_meta_logits() -> None:
    model = build_model("tiny", device="meta")
    logits = model(torch.zeros(2, 9, dtype=torch.long, device="meta"))
    assert logits.is_meta and logits.shape == (2, 9, 256)


def test_gpt_embeddings_are_tied() -> None:
    model = build_model("gpt-tiny")
    assert isinstance(model, GPTModel)
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # the shared weight is counted once
    llama = build_model("tiny")
    assert isinstance(llama, LlamaModel)
    assert llama.lm_head.weight.data_ptr() != llama.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", ["tiny", "gpt-tiny"])
def test_causal_later_token_does_not_change_earlier_logits(name: str) -> None:
    model = build_model(name).eval()
    ids = _ids(model.config.vocab_size, B=1, T=10)
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_rotary_scores_depend_only_on_relative_position() -> None:
    cos, sin = rotary_cos_sin(16, 8, 10000.0, torch.device("cpu"))  # (T, hd)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, generator=g).expand(1, 1, 16, 8)  # same vector at every position
    k = torch.randn(8, generator=g).expand(1, 1, 16, 8)
    rq, rk = apply_rotary(q, cos, sin)[0, 0], apply_rotary(k, cos, sin)[0, 0]  # (T, hd)
    torch.testing.assert_close(rq[5] @ rk[2], rq[13] @ rk[10])
    assert not torch.allclose(rq[5] @ rk[2], rq[5] @ rk[4])


def test_dropout_is_random_in_train_and_off_in_eval() -> None:
    model = build_model("llama-tiny-dropout")
    ids = _ids(256)
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def _naive_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    B, T, _ = logits.shape
    out = torch.empty(B, T - 1, dtype=torch.float64)
    for b in range(B):
        for t in range(T - 1):
            out[b, t] = torch.log_softmax(logits[b, t].double(), dim=-1)[ids[b, t + 1]]
    return out


def test_token_logprobs_matches_naive_loop() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 50, generator=g) * 3  # (B, T, V)
    ids = torch.randint(0, 50, (2, 7), generator=g)  # (B, T)
    lp = token_logprobs(logits, ids)
    assert lp.shape == (2, 6) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), _naive_logprobs(logits, ids), atol=1e-5, rtol=1e-5)
    lp16 = token_logprobs(logits.bfloat16(), ids)  # upcast happens inside
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16.double(), _naive_logprobs(logits.bfloat16().float(), ids),
                               atol=1e-5, rtol=1e-5)


def test_token_logprobs_gradient_matches_log_softmax() -> None:
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    torch.autograd.gradcheck(lambda x: token_logprobs(x, ids), (logits,))


def test_response_logprobs_masks_with_shift() -> None:
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 6, 20, generator=g), torch.randint(0, 20, (2, 6), generator=g)
    response = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    lp, mask = response_logprobs(logits, ids, response)
    assert lp.shape == mask.shape == (2, 5) and mask.dtype == torch.bool
    assert torch.equal(mask, response[:, 1:].bool())
    full = token_logprobs(logits, ids)
    torch.testing.assert_close(lp[mask], full[mask])
    assert torch.all(lp[~mask] == 0)


@pytest.mark.parametrize("name", ["tiny", "gpt-tiny"])
def test_compile_fullgraph_dynamic_sequence_does_not_recompile(name: str) -> None:
    torch._dynamo.reset()
    model = build_model(name).eval()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for T in (16, 24, 40):
        ids = _ids(model.config.vocab_size, B=2, T=T)
        torch._dynamo.mark_dynamic(ids, 1)
        torch.testing.assert_close(compiled(ids), model(ids))
    assert counter.frame_count == 1


def test_compile_training_step_matches_eager_gradients() -> None:
    torch._dynamo.reset()
    model = build_model("tiny")
    ids = _ids(256, B=2, T=16)
    token_logprobs(model(ids), ids).sum().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    token_logprobs(compiled(ids), ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], msg=n)


def test_gpt_rejects_sequences_longer_than_position_table() -> None:
    model = build_model("gpt-tiny", max_seq_len=8)
    model(_ids(256, T=8))
    with pytest.raises(RuntimeError, match="max_seq_len"):
        model(_ids(256, T=9))
