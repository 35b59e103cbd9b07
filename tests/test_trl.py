"""HiLoReGRPOTrainer against TRL's own GRPOTrainer, on a tiny random Qwen2 (no downloads).

One module fixture trains TRL's trainer and the subclass for three steps each
from one seed (recording TRL's first generation batch), so the one slow
compile is shared by every test here. Nothing is replayed: the subclass draws
TRL's random numbers, so both generate the same completions at every step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("transformers")

from transformers import TrainerCallback  # noqa: E402

from hilore_compiler.backend import current_bucket  # noqa: E402
from hilore_compiler.grpo import GRPOConfig, GRPOLossConfig  # noqa: E402
from hilore_compiler.grpo.packing import drop_then_pack  # noqa: E402
from hilore_compiler.integrations.batching import dropped_slots, equal_slots, pad_batch  # noqa: E402
from hilore_compiler.integrations.toy import (  # noqa: E402
    char_tokenizer,
    digit_dataset,
    largest_digit_reward,
    tiny_qwen2,
)
from hilore_compiler.integrations.trl import BUCKET_KEY, HiLoReGRPOTrainer  # noqa: E402

#: SGD with a large step: the update is then a fixed multiple of the gradient,
#: so comparing parameters compares gradients (Adam's first step is about
#: lr * sign(g), which would amplify rounding of near-zero gradients).
LR = 1.0
#: Optimizer steps each trainer takes: generation from step 2 on samples from
#: updated weights, so the runs agree only if they draw the same random numbers.
STEPS = 3


def _args(out: str, steps: int, **overrides) -> trl.GRPOConfig:
    base = dict(
        output_dir=out, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=1, logging_steps=1, max_steps=steps,  # seed 1: a mixed first batch
        per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=4,
        max_completion_length=8, loss_type="dapo", optim="sgd", learning_rate=LR,
        lr_scheduler_type="constant",
    )
    base.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' gradient_checkpointing rename
        return trl.GRPOConfig(**base)


def _half_zero_reward(prompts, completions, **_):
    """Half the groups of every generation batch earn 0 whatever they say (all-equal rewards:
    zero advantages), the other half a reward that differs between any two distinct
    completions (TRL lays a batch out group after group)."""
    half = len(completions) // 2
    return [0.0 if i < half else sum(map(ord, c)) % 101 / 101 for i, c in enumerate(completions)]


def _counting(trainer, rows: list):
    """Wrap the trainer's ``_compute_loss`` (one training forward per call): rows and zero-advantage rows."""
    def loss(model, inputs, _loss=trainer._compute_loss):
        rows.append((len(inputs["advantages"]), int((inputs["advantages"] == 0).sum())))
        return _loss(model, inputs)

    trainer._compute_loss = loss


def _clone(batch: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in batch.items()}


class _Snapshot(TrainerCallback):
    """Parameters after step 1 and, for the subclass, compiled graphs after every step."""

    def __init__(self, trainer_ref: list):
        self.trainer_ref, self.params, self.graphs, self.frames = trainer_ref, None, [], []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        trainer = self.trainer_ref[0]
        if hasattr(trainer, "hilore_backend"):
            self.graphs.append(len(trainer.hilore_backend.graphs))
            self.frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        if state.global_step == 1:
            self.params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    tok = char_tokenizer()
    start = tiny_qwen2(tok, layers=1, seed=0)  # one layer: the compile dominates this file's time
    data = digit_dataset(64, seed=0)
    ref = trl.GRPOTrainer(model=copy.deepcopy(start), reward_funcs=_half_zero_reward,
                          args=_args(str(tmp / "ref"), STEPS, gradient_checkpointing=False),
                          train_dataset=data, processing_class=tok)
    recorded, generate = [], ref._generate_and_score_completions
    ref_rows, sub_rows = [], []
    _counting(ref, ref_rows)
    ref._generate_and_score_completions = lambda b: recorded.append(_clone(out := generate(b))) or out
    ref_snap = _Snapshot([ref])
    ref.add_callback(ref_snap)
    ref.train()

    with pytest.warns(UserWarning, match="turns gradient checkpointing off"):
        sub = HiLoReGRPOTrainer(
            model=copy.deepcopy(start), reward_funcs=_half_zero_reward,
            args=_args(str(tmp / "sub"), STEPS),  # TRL's default gradient_checkpointing=True
            train_dataset=data, processing_class=tok,
            hilore_options={"codecs": [], "buckets": 1, "cache_dir": str(tmp / "cache"),
                            "verbose": False},
        )
    seen = []  # (bucket active while TRL's loss ran, the microbatch's bucket), per microbatch

    def loss_under_bucket(model, inputs, _loss=sub._compute_loss):
        seen.append((current_bucket(), inputs[BUCKET_KEY]))
        return _loss(model, inputs)

    sub._compute_loss = loss_under_bucket
    _counting(sub, sub_rows)
    snap = _Snapshot([sub])
    sub.add_callback(snap)
    torch._dynamo.reset()
    sub.train()
    return dict(start=start, ref=ref, sub=sub, snap=snap, ref_snap=ref_snap, batch=recorded[0], seen=seen,
                ref_rows=ref_rows, sub_rows=sub_rows)


@pytest.mark.slow
def test_training_forward_goes_through_hilore(runs):
    sub, snap = runs["sub"], runs["snap"]
    assert snap.graphs[0] >= 1, "the training forward compiled no graph with the hilore backend"
    planned = [g for g in sub.hilore_backend.graphs if g.plan is not None]
    assert planned, "the backend compiled the graph without a plan (fell back to Inductor)"
    # transformers renamed is_gradient_checkpointing to is_activation_checkpointing after 5.10.
    flag = "is_activation_checkpointing" if hasattr(sub.model, "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    assert getattr(sub.model, flag) is False


@pytest.mark.slow
def test_no_recompile_after_the_first_step(runs):
    snap = runs["snap"]
    assert len(snap.graphs) == STEPS
    assert snap.graphs[1:] == [snap.graphs[0]] * (STEPS - 1), f"graphs per step: {snap.graphs}"
    assert snap.frames[0] >= 1 and snap.frames[1:] == [snap.frames[0]] * (STEPS - 1), f"dynamo graphs: {snap.frames}"


@pytest.mark.slow
def test_one_step_matches_trl_with_exact_plans(runs):
    """codecs=[]: the step's parameters and update equal TRL's own trainer on the same batch."""
    start = dict(runs["start"].named_parameters())
    ref = runs["ref_snap"].params
    sub = runs["snap"].params
    flat = lambda d: torch.cat([d[n].detach().reshape(-1) for n in sorted(start)])  # noqa: E731
    p0, p_ref, p_sub = flat(start), flat(ref), flat(sub)
    update_ref, update_sub = p_ref - p0, p_sub - p0
    assert update_ref.norm() > 1e-3, "TRL's step did not move the parameters: nothing compared"
    assert ((p_sub - p_ref).norm() / p_ref.norm()).item() < 1e-5
    assert ((update_sub - update_ref).norm() / update_ref.norm()).item() < 1e-4


@pytest.mark.slow
def test_three_steps_from_one_seed_follow_trls_trajectory(runs):
    """codecs=[]: TRL's random stream is kept, so each step generates TRL's completions."""
    names = sorted(dict(runs["start"].named_parameters()))
    ref, sub = dict(runs["ref"].model.named_parameters()), dict(runs["sub"].model.named_parameters())
    flat = lambda d: torch.cat([d[n].detach().reshape(-1) for n in names])  # noqa: E731
    p0, p_ref, p_sub = flat(dict(runs["start"].named_parameters())), flat(ref), flat(sub)
    assert runs["ref"].state.global_step == runs["sub"].state.global_step == STEPS
    assert (p_ref - p0).norm() > 1e-3, "TRL's steps did not move the parameters: nothing compared"
    rel = ((p_sub - p_ref).norm() / p_ref.norm()).item()
    print(f"parameters after {STEPS} steps from one seed, relative L2: {rel:.2e}")
    assert rel < 1e-6  # half the groups zero: their samples dropped, the update TRL's


@pytest.mark.slow
def test_zero_samples_are_dropped_and_never_run(runs):
    sub, batch = runs["sub"], runs["batch"]
    total = batch["advantages"].numel()
    zero = int((batch["advantages"] == 0).sum())
    assert zero == total // 2, "the reward should zero exactly half the groups"
    assert sub.bucket_history[0]["zero"] == zero
    logs = [h["hilore/skipped_samples"] for h in sub.state.log_history if "hilore/skipped_samples" in h]
    assert logs == [float(zero)] * STEPS
    # Forward passes: TRL runs every sample; the subclass only the nonzero ones, never a zero one.
    assert sum(r for r, _ in runs["ref_rows"]) == STEPS * total
    assert sum(r for r, _ in runs["sub_rows"]) == STEPS * (total - zero)
    assert sum(z for _, z in runs["sub_rows"]) == 0
    assert sum(z for _, z in runs["ref_rows"]) == STEPS * zero


@pytest.mark.slow
def test_each_microbatch_runs_under_its_bucket_least_exposed_first(runs):
    sub, seen = runs["sub"], runs["seen"]
    names = sub.bucket_history[0].keys()  # ("zero", "b0", ...): the plan's buckets
    assert seen and all(active == given and given in names for active, given in seen), seen
    size = sub.args.per_device_train_batch_size
    per_step = -(-(runs["batch"]["advantages"].numel() // 2) // size)  # nonzero samples, packed by TRL's size
    assert len(seen) == STEPS * per_step
    first = [b for _, b in seen[:per_step]]
    order = list(names)
    assert first == sorted(first, key=order.index), f"step 1 ran {first}, not least exposed first"


def test_from_trl_maps_and_refuses():
    cfg = GRPOLossConfig.from_trl(_args("/tmp/unused", 1, loss_type="dr_grpo", epsilon_high=0.28, delta=1.5))
    assert (cfg.loss_type, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c, cfg.max_len) == (
        "dr_grpo", 0.2, 0.28, 1.5, 8)
    assert GRPOConfig is GRPOLossConfig
    for bad in (dict(loss_type="cispo"), dict(top_entropy_quantile=0.2), dict(entropy_coef=0.01),
                dict(importance_sampling_level="sequence"), dict(delta=1.1)):
        with pytest.raises(ValueError, match="no closed-form"):
            GRPOLossConfig.from_trl(_args("/tmp/unused", 1, **bad))


def test_trainer_refuses_sapo_before_building_anything():
    with pytest.raises(ValueError, match="loss_type='sapo'"):
        HiLoReGRPOTrainer(model=None, reward_funcs=largest_digit_reward,
                          args=_args("/tmp/unused", 1, loss_type="sapo"))


def test_equal_slots_put_zero_first_and_flag_all_zero_microbatches():
    names = ["b1", "zero", "b0", "zero", "b1", "zero", "zero", "b0"]
    x = torch.tensor([3.0, 0, 1, 0, 2, 0, 0, 0.5])
    slots = equal_slots(names, x, ("zero", "b0", "b1"), 4)
    assert [names[i] for s in slots for i in s.rows] == ["zero"] * 4 + ["b0", "b0", "b1", "b1"]
    assert [s.all_zero for s in slots] == [True, True, False, False]
    assert [s.bucket for s in slots] == ["zero", "zero", "b0", "b1"]
    assert [i for s in slots[2:] for i in s.rows] == [7, 2, 4, 0]  # least exposed first inside a bucket
    kept = equal_slots(names, x, ("zero", "b0", "b1"), 2, sort=False)
    assert [s.rows for s in kept] == [(0, 1, 2, 3), (4, 5, 6, 7)] and [s.bucket for s in kept] == ["b1", "b1"]


def test_dropped_slots_skip_first_and_pad_with_dropped_samples():
    names = ["b1", "zero", "b0", "zero", "b1", "zero", "zero", "b0"]
    x = [3.0, 0, 1, 0, 2, 0, 0, 0.5]
    packed = drop_then_pack(names, x, ("zero", "b0", "b1"), budget=4)
    assert packed.microbatches == ((7, 2, 4, 0),) and packed.dropped == (1, 3, 5, 6)
    slots = dropped_slots(packed, 4, 1)  # the busiest rank runs one microbatch
    assert [s.all_zero for s in slots] == [True, True, True, False] and slots[-1].rows == (7, 2, 4, 0)
    assert sum(s.left_out for s in slots) == 4 and all(s.rows == () for s in slots[:3])
    padded = dropped_slots(packed, 4, 3)  # another rank runs three: two single dropped samples here
    assert [s.rows for s in padded] == [(), (1,), (3,), (7, 2, 4, 0)]
    assert sum(s.left_out for s in padded) == 2
    pure = drop_then_pack(names, x, ("zero", "b0", "b1"), budget=4, at_least=2)
    assert pure.microbatches == ((7, 2), (4, 0)) and pure.buckets == ("b0", "b1")


def test_pad_batch_rounds_lengths_with_masked_padding():
    b = {"prompt_ids": torch.ones(2, 5, dtype=torch.long), "prompt_mask": torch.ones(2, 5, dtype=torch.long),
         "completion_ids": torch.ones(2, 3, dtype=torch.long),
         "completion_mask": torch.ones(2, 3, dtype=torch.long), "advantages": torch.ones(2),
         "num_items_in_batch": torch.tensor(6)}
    out = pad_batch(b, pad_token_id=0, multiple=4)
    assert out["prompt_ids"].shape == (2, 8) and out["completion_ids"].shape == (2, 4)
    assert out["prompt_mask"][:, :3].sum() == 0 and out["prompt_mask"][:, 3:].all()  # left
    assert out["completion_mask"][:, 3:].sum() == 0 and out["completion_mask"][:, :3].all()  # right
    assert out["advantages"] is b["advantages"]


def _built(args) -> HiLoReGRPOTrainer:
    tok = char_tokenizer()
    return HiLoReGRPOTrainer(model=tiny_qwen2(tok, layers=1), reward_funcs=largest_digit_reward,
                             args=args, train_dataset=digit_dataset(16), processing_class=tok)


def test_order_falls_back_where_it_would_move_samples_between_steps():
    args = _args("/tmp/unused", 1, gradient_checkpointing=False, steps_per_generation=8)
    with pytest.warns(UserWarning, match="keeps TRL's shuffled order"):
        trainer = _built(args)
    assert not trainer.exposure_order and trainer.skip_zero


def test_bnpo_orders_with_a_warning_and_a_kl_term_turns_skipping_off():
    with pytest.warns(UserWarning, match="bnpo"):
        trainer = _built(_args("/tmp/unused", 1, gradient_checkpointing=False, loss_type="bnpo"))
    assert trainer.exposure_order and trainer._skip_is_exact()
    trainer.beta = 0.1  # a KL term: zero-advantage samples still have a gradient
    assert not trainer._skip_is_exact()


def test_a_microbatch_is_skipped_only_where_every_rank_can_skip_it():
    trainer = _built(_args("/tmp/unused", 1, gradient_checkpointing=False))
    other_rank = torch.tensor([1, 0, 1, 1])  # what rank 1 found all-zero

    class TwoRanks:  # the three things _on_every_rank asks of accelerate
        num_processes, device = 2, torch.device("cpu")

        @staticmethod
        def gather(t):
            return torch.cat([t, other_rank])

    trainer.accelerator = TwoRanks()
    assert trainer._on_every_rank((True, True, False, True)) == (True, False, False, True)
