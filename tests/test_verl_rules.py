"""The verl integration's rules, in one process: when skipping or dropping a
zero-advantage micro-batch is exact, the exposures, the slot order, verl's
token budget, the engine's registration and config, and the honest metrics.
(verl's engine trained in two processes: test_verl.py.)"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("verl")

from hilore_compiler.integrations.slots import microbatch_bucket, schedule_slots  # noqa: E402


def test_honest_metrics_average_to_the_whole_batch_token_mean():
    from verl.utils.metric import AggregationType, Metric

    from hilore_compiler.integrations.verl_packing import honest_metrics

    # Two packed micro-batches of 3 and 1 response tokens, 6 dropped tokens: 10 in all.
    frac = [1 / 3, 1.0]  # clipped tokens 1 of 3 and 1 of 1: 2 of the batch's 10
    entries = [honest_metrics({"c": Metric(AggregationType.MEAN, f), "l": Metric(AggregationType.SUM, 0.5)},
                              share=tokens * 2 / 10) for f, tokens in zip(frac, (3, 1))]
    merged = Metric(AggregationType.MEAN)
    for e in entries:
        merged.extend(e["c"])
    assert merged.aggregate() == pytest.approx(2 / 10)
    assert sum(e["l"].values[0] for e in entries) == 1.0  # SUM metrics are left as they are
    pad = honest_metrics({"l": Metric(AggregationType.SUM, 0.5)}, share=0.0)
    assert pad["l"].values == [0.0]


def test_verls_token_budget_is_the_planned_range_unless_given():
    from types import SimpleNamespace

    from hilore_compiler.integrations.verl import planned_lengths

    dynamic = SimpleNamespace(use_dynamic_bsz=True, max_token_len_per_gpu=4096)
    assert planned_lengths({"codecs": []}, dynamic) == {"codecs": [], "min_seq_len": 1, "max_seq_len": 4096}
    assert planned_lengths({"max_seq_len": 2048}, dynamic) == {"max_seq_len": 2048}  # the user's bounds
    assert planned_lengths({"plan": "p.json"}, dynamic) == {"plan": "p.json"}
    fixed = SimpleNamespace(use_dynamic_bsz=False, max_token_len_per_gpu=4096)  # no token bound then
    assert planned_lengths({}, fixed) == {}
    assert planned_lengths({}, SimpleNamespace(use_dynamic_bsz=True, max_token_len_per_gpu=None)) == {}


def test_slots_least_exposed_first_and_never_the_last():
    order = ("zero", "b0", "b1")
    s = schedule_slots(["b1", "zero", "b0", "zero"], order)  # one process: no collective
    assert s.order == (1, 3, 2, 0) and s.skip == (True, True, False, False)
    assert s.run == (2, 0) and s.skipped == (1, 3)
    assert schedule_slots(["zero", "zero"], order).skip == (True, False)  # the last slot always runs
    kept = schedule_slots(["b1", "zero"], order, sort=False, skip_zero=False)
    assert kept.order == (0, 1) and kept.skip == (False, False)
    assert microbatch_bucket(["zero", "b1", "b0"], order) == "b1"


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


def test_drop_only_where_every_normaliser_is_global():
    import verl.utils.tensordict_utils as tu
    from tensordict import TensorDict
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from hilore_compiler.integrations.verl_packing import drop_is_exact

    def loss(**kw):
        return functools.partial(ppo_loss, config=ActorConfig(
            strategy="fsdp2", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=4, **kw))

    def data(**non_tensor):
        td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
        tu.assign_non_tensor(td, **non_tensor)
        return td

    whole = data(global_batch_size=8)
    assert drop_is_exact(loss(), whole)
    assert drop_is_exact(loss(loss_agg_mode="seq-mean-token-mean"), whole)
    assert not drop_is_exact(loss(loss_agg_mode="seq-mean-token-mean"), data())  # per micro-batch count
    assert not drop_is_exact(loss(loss_agg_mode="seq-mean-token-sum-norm"), whole)  # padded length
    assert not drop_is_exact(loss(use_kl_loss=True), whole)
    assert not drop_is_exact(loss(), data(global_batch_size=8, return_model_output=True))
    assert not drop_is_exact(loss(), data(global_batch_size=8, force_group_size=2))


def test_exposure_is_zero_exactly_where_advantages_are():
    from hilore_compiler.integrations.verl import microbatch_exposures

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5], [-2.0, 0.0, 0.0]]) * mask
    x = microbatch_exposures({"advantages": adv, "response_mask": mask},
                             {"dp_size": 2, "batch_num_tokens": 12, "global_batch_size": 6})
    # token-mean: |A| per token / (global tokens / dp) = |A| / 6
    assert x.tolist() == pytest.approx([0.0, 1.5 / 6, 2.0 / 6])
