"""verl's FSDP2 engine with and without hilore, two gloo processes on CPU (tiny random Qwen2).

One spawn of two ranks trains verl's own ``FSDPEngineWithLMHead`` and then
``HiLoReFSDPEngine`` (``codecs: []``, exact plans) for three optimizer steps
each on the same batches (the last with verl's dynamic batch size), and
returns what it measured, so the slow compile is shared by every test here. Each step computes the old log-probs with a
``forward_only`` pass first, as verl's ``compute_log_prob`` does.

The batches are built so the ranks disagree: rank 0 has one mixed group and
two groups with equal rewards (zero advantages), rank 1 one zero group and
two mixed ones. Ordered least exposed first, slot 0 is zero on both ranks
(skipped by both), slot 1 is zero on rank 0 only (it runs there, since rank 1
works in that slot), slot 2 is real work on both.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import pytest
import torch

pytest.importorskip("verl")

from hilore_compiler.distributed import spawn  # noqa: E402
from hilore_compiler.integrations.slots import microbatch_bucket, schedule_slots  # noqa: E402

#: Samples per rank, GRPO group size (= micro-batch size), prompt and response lengths.
B_RANK, GROUP, PROMPT, RESPONSE = 12, 4, 6, 10
#: Groups with zero advantages, per rank (see the module docstring).
ZERO_GROUPS = ((1, 2), (0,))
#: verl's token budget per micro-batch under its dynamic batch size: GROUP * (PROMPT + RESPONSE)
#: tokens at most, rounded up. Packed micro-batches are not padded: each has its own token count.
PAD_BUCKET = 64
STEPS = 3
#: From this step on verl's dynamic batch size packs the micro-batches (by a
#: token budget of PAD_BUCKET).
DYNAMIC_FROM = 2
#: SGD: the update is a fixed multiple of the gradient, so comparing parameters
#: compares gradients (Adam's first step, about lr * sign(g), amplifies rounding).
LR = 0.5


def cpu_platform():
    """verl's platform for a CPU process group: device "cpu", backend "gloo"."""
    from verl.plugin.platform import PlatformBase

    class CPUPlatform(PlatformBase):
        device_name, vendor_name, device_module = "cpu", "cpu", torch.cpu

        def is_available(self): return True
        def current_device(self): return "cpu"  # verl moves batches with .to(current_device())
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def get_device_capability(self, device_index=0): return (None, None)
        def cudart(self): return None
        def is_ipc_supported(self): return False
        def nvtx_range(self, msg): return contextlib.nullcontext()
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_noset_envvars(self): return []
        def ray_resource_name(self): return "CPU"

    return CPUPlatform()


def save_tiny_qwen2(path: str) -> None:
    """A 2-layer, hidden-64 Qwen2 with random weights, saved where verl loads it from."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)


def build_engine(path: str, hilore: dict | None, initialize: bool = True, skip_zero: bool = True,
                 registered: bool = False, **model_fields):
    """verl's engine (``hilore=None``) or the hilore one, built directly as verl's worker builds it.

    ``registered``: the class the registry now holds (``HiLoReFSDPEngine``) even without hilore,
    as the reference model gets it.
    """
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from hilore_compiler.integrations.verl import HiLoReFSDPEngine, HiLoReFSDPEngineConfig

    fields = {"enable_gradient_checkpointing": False, **model_fields}
    model = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                          **fields)
    common = dict(strategy="fsdp2", use_torch_compile=False, use_dynamic_bsz=False,
                  micro_batch_size_per_gpu=GROUP,
                  mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    if hilore is None:
        cls = HiLoReFSDPEngine if registered else FSDPEngineWithLMHead
        engine_config = FSDPEngineConfig(**common)
    else:
        engine_config = HiLoReFSDPEngineConfig(**common, hilore=hilore, hilore_skip_zero=skip_zero)
        cls = HiLoReFSDPEngine
    optim = FSDPOptimizerConfig(optimizer="SGD", lr=LR, weight_decay=0.0, clip_grad=1e9)
    engine = cls(model_config=model, engine_config=engine_config, optimizer_config=optim,
                 checkpoint_config=CheckpointConfig())
    if initialize:
        engine.initialize()
    return engine


def rank_batch(rank: int, step: int):
    """This rank's left/right-padded batch of one step, as verl's trainer hands it over."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(100 * step + rank)
    n, t = B_RANK, PROMPT + RESPONSE
    ids = torch.randint(1, 128, (n, t), generator=g)
    prompt_len = torch.randint(3, PROMPT + 1, (n,), generator=g)
    response_len = torch.randint(4, RESPONSE + 1, (n,), generator=g)
    attention = torch.zeros(n, t, dtype=torch.long)
    for i in range(n):
        attention[i, PROMPT - prompt_len[i]:PROMPT + response_len[i]] = 1
    response_mask = attention[:, PROMPT:].clone()  # (B, R)
    advantages = torch.randn(n, generator=g)  # one per sample, broadcast over its tokens as GRPO does
    for group in ZERO_GROUPS[rank]:
        advantages[GROUP * group:GROUP * (group + 1)] = 0.0
    td = TensorDict({
        "prompts": ids[:, :PROMPT].clone(), "responses": ids[:, PROMPT:].clone(), "input_ids": ids,
        "attention_mask": attention, "response_mask": response_mask,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "advantages": advantages[:, None] * response_mask, "old_log_probs": torch.zeros(n, RESPONSE),
    }, batch_size=[n])
    return left_right_2_no_padding(td)


def full_parameters(engine) -> dict:
    """Unsharded parameters as numpy arrays: pickled by value, so they outlive this process."""
    return {n: p.full_tensor().detach().numpy().copy() for n, p in engine.module.named_parameters()}


def run_engine(engine, rank: int, steps: int = STEPS, dynamic_from: int | None = DYNAMIC_FROM) -> dict:
    """``steps`` updates (old log-probs forward_only, then train_batch); parameters and what was seen.

    Updates from ``dynamic_from`` on use verl's dynamic batch size (None: never).
    """
    import verl.utils.tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=2 * B_RANK, ppo_micro_batch_size_per_gpu=GROUP,
                        use_dynamic_bsz=False, rollout_n=GROUP)
    loss = functools.partial(ppo_loss, config=actor)
    out = {"times": [], "graphs": [], "frames": []}
    backends = list({id(b): b for b in getattr(engine, "hilore_backends", [])}.values())  # blocks share some
    for step in range(steps):
        data = rank_batch(rank, step)
        dynamic = dynamic_from is not None and step >= dynamic_from
        tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=dynamic, max_token_len_per_gpu=PAD_BUCKET,
                             micro_batch_size_per_gpu=GROUP, global_batch_size=2 * B_RANK, temperature=1.0)
        with engine.eval_mode():
            logp = engine.infer_batch(data.clone(), loss_function=None)["model_output"]["log_probs"]
        data["old_log_probs"] = no_padding_2_padding(logp, data)  # on-policy: ratio 1
        start = time.perf_counter()
        with engine.train_mode():
            engine.train_batch(data, loss_function=loss)
        out["times"].append(time.perf_counter() - start)
        out["graphs"].append(sum(len(b.graphs) for b in backends))
        out["frames"].append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    out["params"] = full_parameters(engine)
    out["history"] = list(getattr(engine, "bucket_history", []))
    out["planned"] = sum(g.plan is not None for b in backends for g in b.graphs)
    out["dynamic"] = [g.planner is not None and g.planner.dynamic for b in backends for g in b.graphs]
    out["packed_lengths"] = sorted({n for b in backends for g in b.graphs if g.planner for n in g.planner.seq_range})
    return out


def refusals(path: str, hilore: dict) -> dict:
    """What the hilore engine says about gradient checkpointing and activation offload."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = build_engine(path, hilore, enable_gradient_checkpointing=True)
    said = [str(w.message) for w in caught if "turns gradient checkpointing off" in str(w.message)]
    try:
        build_engine(path, hilore, initialize=False, enable_activation_offload=True)
        offload = None
    except ValueError as error:
        offload = str(error)
    return {"checkpointing_warned": bool(said), "offload_refused": offload,
            "checkpointing_left_on": bool(engine.module.is_gradient_checkpointing)}


#: The hilore options of these runs: exact plans, one nonzero bucket (one compile).
HILORE = {"codecs": [], "buckets": 1, "verbose": False}


def rank_main(rank: int, world: int, path: str, steps: int = STEPS, timing: bool = False) -> dict:
    """verl's engine, then hilore's, ``steps`` updates each; ``timing``: also hilore without the skip."""
    from verl.plugin.platform import set_platform

    set_platform(cpu_platform())
    import hilore_compiler.integrations.verl  # noqa: F401  (what external_lib does: registers, patches)

    torch.manual_seed(0)
    start = full_parameters(build_engine(path, None))
    dynamic_from = None if timing else DYNAMIC_FROM
    ref = run_engine(build_engine(path, None), rank, steps, dynamic_from)
    sub = run_engine(build_engine(path, HILORE), rank, steps, dynamic_from)
    if timing:
        no_skip = run_engine(build_engine(path, HILORE, skip_zero=False), rank, steps, None)
        return {"ref": ref, "sub": sub, "no_skip": no_skip}
    plain = run_engine(build_engine(path, None, registered=True), rank, steps, dynamic_from)
    return {"start": start, "ref": ref, "sub": sub, "plain": plain, **refusals(path, HILORE)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    save_tiny_qwen2(path)
    cache = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0",
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}
    results = spawn(rank_main, 2, path, backend="gloo", env=cache, timeout_s=900)
    for rank, r in enumerate(results):  # the measured figures, for pytest -s
        print(f"rank {rank}: verl step s {[round(t, 3) for t in r['ref']['times']]}, hilore step s "
              f"{[round(t, 3) for t in r['sub']['times']]}, buckets {r['sub']['history']}")
    return results


def _flat(params: dict) -> torch.Tensor:
    return torch.cat([torch.from_numpy(params[n]).reshape(-1).double() for n in sorted(params)])


@pytest.mark.slow
def test_three_steps_match_verls_engine_with_exact_plans(ranks):
    for r in ranks:
        p0, ref, sub = _flat(r["start"]), _flat(r["ref"]["params"]), _flat(r["sub"]["params"])
        assert (ref - p0).norm() / p0.norm() > 1e-4, "verl's engine did not move the parameters"
        rel = ((sub - ref).norm() / ref.norm()).item()
        print(f"parameters, relative L2 after {STEPS} steps: {rel:.2e}")
        assert rel < 1e-5
        assert ((sub - ref).norm() / (ref - p0).norm()).item() < 1e-3  # the updates, not just the weights


@pytest.mark.slow
def test_without_a_hilore_field_the_registered_engine_is_verls(ranks):
    for r in ranks:  # the reference model's case: bit for bit what verl's engine does
        assert all((r["plain"]["params"][n] == r["ref"]["params"][n]).all() for n in r["ref"]["params"])
        assert r["plain"]["graphs"] == [0] * STEPS and r["plain"]["history"] == []


@pytest.mark.slow
def test_blocks_went_through_hilore_and_nothing_recompiles(ranks):
    for r in ranks:
        graphs, frames = r["sub"]["graphs"], r["sub"]["frames"]
        assert graphs[0] > 0, "no block graph was compiled by the hilore backend"
        assert r["sub"]["planned"] > 0, "the backend fell back to Inductor: no block graph has a plan"
        assert graphs[1:] == [graphs[0]] * (STEPS - 1), f"hilore graphs per step: {graphs}"
        assert frames[1:] == [frames[0]] * (STEPS - 1), f"dynamo graphs per step: {frames}"
        # Unpadded packed micro-batches of several token counts: after the first
        # length, one symbolic graph per block serves them all.
        assert any(r["sub"]["dynamic"]), "no block graph was compiled with the packed length symbolic"
        assert r["ref"]["graphs"] == [0] * STEPS  # verl's engine compiled nothing


@pytest.mark.slow
def test_zero_microbatches_are_skipped_on_both_ranks_together(ranks):
    r0, r1 = (r["sub"]["history"] for r in ranks)
    # Slot 0 is zero on both ranks: skipped by both. Slot 1 is zero on rank 0
    # only: it runs there, since rank 1 works in that slot. (With the dynamic
    # batch size verl balances lengths, which mixes groups: no fixed expectation.)
    assert [h["skipped_microbatches"] for h in r0[:DYNAMIC_FROM]] == [1] * DYNAMIC_FROM
    assert [h["skipped_microbatches"] for h in r1[:DYNAMIC_FROM]] == [1] * DYNAMIC_FROM
    assert all(h["zero"] == GROUP * len(ZERO_GROUPS[0]) for h in r0)
    assert all(h["zero"] == GROUP * len(ZERO_GROUPS[1]) for h in r1)


def test_slots_least_exposed_first_and_never_the_last():
    order = ("zero", "b0", "b1")
    s = schedule_slots(["b1", "zero", "b0", "zero"], order)  # one process: no collective
    assert s.order == (1, 3, 2, 0) and s.skip == (True, True, False, False)
    assert s.run == (2, 0) and s.skipped == (1, 3)
    assert schedule_slots(["zero", "zero"], order).skip == (True, False)  # the last slot always runs
    kept = schedule_slots(["b1", "zero"], order, sort=False, skip_zero=False)
    assert kept.order == (0, 1) and kept.skip == (False, False)
    assert microbatch_bucket(["zero", "b1", "b0"], order) == "b1"


@pytest.mark.slow
def test_checkpointing_is_turned_off_with_a_warning_and_offload_refused(ranks):
    for r in ranks:
        assert r["checkpointing_warned"] and not r["checkpointing_left_on"]
        assert r["offload_refused"] and "enable_activation_offload=False" in r["offload_refused"]


def test_engine_config_is_selected_with_verls_target_override():
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from hilore_compiler.integrations.verl import HiLoReFSDPEngineConfig

    cfg = OmegaConf.create({"_target_": "hilore_compiler.integrations.verl.HiLoReFSDPEngineConfig",
                            "strategy": "fsdp2", "hilore": {"codecs": [], "buckets": 2}})
    built = omega_conf_to_dataclass(cfg)
    assert isinstance(built, HiLoReFSDPEngineConfig) and built.hilore["buckets"] == 2


def test_importing_registers_the_engine_where_verl_picks_fsdp_engines(monkeypatch):
    from verl.workers.engine import EngineRegistry

    from hilore_compiler.integrations.verl import HiLoReFSDPEngine

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # the device verl registered its engine for
    for strategy in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", strategy) is HiLoReFSDPEngine
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is not HiLoReFSDPEngine  # critic: verl's


def test_skip_only_for_losses_with_zero_gradient_at_zero_advantage():
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from hilore_compiler.integrations.verl import skip_is_exact

    def actor(**kw):
        return ActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                           rollout_n=4, **kw)

    assert skip_is_exact(functools.partial(ppo_loss, config=actor()))
    assert not skip_is_exact(functools.partial(ppo_loss, config=actor(use_kl_loss=True)))
    assert not skip_is_exact(functools.partial(ppo_loss, config=actor(entropy_coeff=0.01)))
    assert not skip_is_exact(lambda **kw: None)  # an unknown loss: every micro-batch runs


def test_exposure_is_zero_exactly_where_advantages_are():
    from hilore_compiler.integrations.verl import microbatch_exposures

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [-2.0, 0.0, 0.0]]) * mask
    x = microbatch_exposures({"advantages": adv, "response_mask": mask},
                             {"dp_size": 2, "batch_num_tokens": 12, "global_batch_size": 6})
    # token-mean: |A| per token / (global tokens / dp) = |A| / 6
    assert x.tolist() == pytest.approx([0.0, 1.5 / 6, 2.0 / 6])


if __name__ == "__main__":
    # Step times of verl's engine alone and with hilore (median of the steps
    # after the first, which compiles), each rank's bucket histogram:
    #   PYTHONPATH=$PWD python tests/test_verl.py 8
    import statistics
    import sys
    import tempfile

    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_qwen2(tmp)
        results = spawn(rank_main, 2, tmp, steps, True, backend="gloo", timeout_s=1800)
    for rank, r in enumerate(results):
        times = {k: statistics.median(r[k]["times"][1:]) for k in ("ref", "sub", "no_skip")}
        print(f"rank {rank}: median step s: verl {times['ref']:.3f}, hilore {times['sub']:.3f} "
              f"(x{times['ref'] / times['sub']:.2f}), hilore without the zero skip {times['no_skip']:.3f} "
              f"(x{times['ref'] / times['no_skip']:.2f}); first hilore step {r['sub']['times'][0]:.1f} s; "
              f"buckets per step {r['sub']['history']}")


