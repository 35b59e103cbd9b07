"""The ``paper`` method: the reference runtime's recovery (R, H, L), its allocator, its scheduling,
and the method through the bench worker, on the tiny policies."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from hilore_compiler.bench.checkpointing import wrap_layers
from hilore_compiler.bench.measure import allocation_deltas, flat_grad
from hilore_compiler.bench.methods import LABELS, METHODS, MethodOptions
from hilore_compiler.bench.paper import PaperConfig, PaperMethod
from hilore_compiler.bench.paper.allocator import allocate
from hilore_compiler.bench.paper.calibration import Calibration
from hilore_compiler.bench.paper.layers import (
    L_THRESHOLD_SHARE,
    decoder_layer_saved_bytes,
)
from hilore_compiler.bench.paper.profile import CapturePlan, Measured
from hilore_compiler.bench.paper.recovery import ACTIONS, AFTER_CAPTURE, FP8
from hilore_compiler.bench.worker import Worker, WorkerConfig, actor_step, make_data
from hilore_compiler.grpo import GRPOConfig, grpo_loss
from hilore_compiler.models import build_model, token_logprobs

CFG = GRPOConfig()
B, T = 2, 64


def _data(seed: int = 0):
    return make_data(256, B, T, seed=seed, device=torch.device("cpu"))


def _paper(name: str = "tiny", dtype: torch.dtype = torch.float32, **config) -> tuple[torch.nn.Module, PaperMethod]:
    model = build_model(name, seed=0, dtype=dtype)
    return model, PaperMethod(model, PaperConfig(**config))


def _step(method: PaperMethod):
    return lambda data: actor_step(method.policy, data, CFG, method.before_backward)


def _grad_of(model: torch.nn.Module, data) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    actor_step(model, data, CFG)
    return flat_grad(model)


def _fixed_grad(method: PaperMethod, data, captures, actions) -> torch.Tensor:
    method.run_fixed(_step(method), data, captures, actions)
    return flat_grad(method.model)


def _held_after_forward(policy, data, before_backward=None) -> int:
    """Bytes the CPU allocator still holds once the forward, the loss and ``before_backward`` ran:
    what backward is left to read."""
    kept = []

    def forward() -> None:
        logprobs = token_logprobs(policy(data.input_ids), data.input_ids)
        loss = grpo_loss(logprobs, logprobs.detach(), data.advantages, data.mask, CFG)
        if before_backward is not None:
            before_backward(logprobs, data, CFG)
        kept.append(loss)

    held = sum(allocation_deltas(forward))
    kept[0].backward()  # one backward per forward: the bundles expect it
    return held


# --- the recovery units: R, H, L ---------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "llama-tiny-dropout"])
def test_r_gradients_are_gcs_and_r_frees_what_the_layers_saved(name):
    data = _data()
    _, method = _paper(name)
    method.find_l_tensors(_step(method), data)
    torch.manual_seed(1)  # dropout: both draw from the same generator state
    r = _fixed_grad(method, data, ("R", "R"), ("R", "R"))
    torch.manual_seed(1)
    gc = _grad_of(wrap_layers(build_model(name, seed=0)), data)
    assert torch.equal(r, gc)  # the replay is the forward again, as checkpoint's recompute
    if name != "tiny":
        return
    saved = sum(b.activation_bytes for b in method.recovery.bundles.values())
    held = {}
    for action in ACTIONS:
        method.fixed = ((action,) * 2, (action,) * 2)
        held[action] = _held_after_forward(method.policy, data, method.before_backward)
        assert sum(b.kept_bytes() for b in method.recovery.bundles.values()) == 0  # all read by backward
    method.fixed = None
    held_gc = _held_after_forward(wrap_layers(build_model(name, seed=0)), data)
    assert held["R"] <= held_gc * 1.01  # R keeps what GC keeps: the layer inputs
    assert held["H"] - held["R"] >= 0.9 * saved  # H keeps the layers' saved tensors, R drops them
    # L keeps one tensor per layer in 1 byte instead of 4: 3/4 of its bytes less than H.
    l_bytes = sum(math.prod(b.records[b.selected][0]) * 4 for b in method.recovery.bundles.values())
    assert held["H"] - held["L"] == 3 * l_bytes // 4


def test_h_gradients_are_store_alls_and_a_capture_cannot_be_taken_back():
    data = _data()
    _, method = _paper()
    h = _fixed_grad(method, data, ("H", "H"), ("H", "H"))
    assert torch.equal(h, _grad_of(build_model("tiny", seed=0), data))
    gc = _grad_of(wrap_layers(build_model("tiny", seed=0)), data)
    assert torch.equal(_fixed_grad(method, data, ("H", "H"), ("R", "R")), gc)  # H dropped after the forward
    with pytest.raises(ValueError, match="cannot come back"):
        method.run_fixed(_step(method), data, ("R", "R"), ("H", "R"))


def test_hugging_face_layers_with_keyword_arguments_recover_exactly():
    from hilore_compiler.models.hf import build_hf_model
    from hilore_compiler.models.hf_policy import as_policy

    def qwen2() -> torch.nn.Module:
        return as_policy(build_hf_model("qwen2", use_cache=False)).train()

    data = make_data(64, B, 16, seed=0, device=torch.device("cpu"))
    store, gc = _grad_of(qwen2(), data), _grad_of(qwen2().checkpoint_layers(), data)
    method = PaperMethod(qwen2(), PaperConfig())
    method.find_l_tensors(_step(method), data)
    assert torch.equal(_fixed_grad(method, data, ("R", "R"), ("R", "R")), gc)
    assert torch.equal(_fixed_grad(method, data, ("H", "H"), ("H", "H")), store)
    # At this width the MLP's input passes the threshold and is chosen, but up_proj saves it
    # again: an fp8 copy would not be what up_proj reads, so the reference's rule takes L away.
    for bundle in method.recovery.bundles.values():
        assert bundle.in_mlp[bundle.selected] and bundle.invalid_alias and "L" not in bundle.available


def _round_trip_by_hand(model: torch.nn.Module, selected: list[int], data) -> torch.Tensor:
    """store-all's gradient with the ``selected[i]``-th tensor layer i saves replaced by its fp8 round trip."""
    def hooked(i, forward):
        def run(*args, **kwargs):
            count = itertools.count()

            def pack(t):
                return t.to(FP8).to(t.dtype) if next(count) == selected[i] else t

            with saved_tensors_hooks(pack, lambda t: t):
                return forward(*args, **kwargs)
        return run

    for i, layer in enumerate(model.layers):
        layer.forward = hooked(i, layer.forward)
    return _grad_of(model, data)


@pytest.mark.parametrize("capture", ["L", "H"])
def test_l_is_the_fp8_round_trip_of_one_mlp_tensor_per_layer(capture):
    data = _data()
    model, method = _paper()
    method.find_l_tensors(_step(method), data)
    store = _grad_of(build_model("tiny", seed=0), data)
    method.fixed = ((capture,) * 2, ("L",) * 2)
    logprobs = token_logprobs(method.policy(data.input_ids), data.input_ids)
    loss = grpo_loss(logprobs, logprobs.detach(), data.advantages, data.mask, CFG)
    model.zero_grad(set_to_none=True)
    method.before_backward(logprobs, data, CFG)
    bundles = [method.recovery.bundles[i] for i in range(2)]
    for b in bundles:  # one tensor per layer, saved inside the MLP, kept in fp8 until backward
        assert b.selected is not None and b.in_mlp[b.selected] and b.action == "L"
        assert [v.dtype for v in b.values if v is not None].count(FP8) == 1
        assert b.values[b.selected].dtype == FP8
        assert b.records[b.selected][0] == (B, T, model.config.intermediate)  # at tiny: SwiGLU's gate output
    loss.backward()
    method.fixed = None
    low = flat_grad(model)
    by_hand = _round_trip_by_hand(build_model("tiny", seed=0), [b.selected for b in bundles], data)
    assert torch.equal(low, by_hand) and not torch.equal(low, store)


class _ToyLayer(torch.nn.Module):
    """A layer whose MLP saves one tensor of its own (tanh's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).sum(-1, keepdim=True) * x


@pytest.mark.parametrize("capture", ["H", "L"])
def test_l_is_unavailable_where_the_fp8_value_is_not_finite(capture):
    from hilore_compiler.bench.paper.layers import PaperRecovery

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_ToyLayer()])
    recovery = PaperRecovery(model)
    x = torch.randn(3, 4)
    x[0, 0] = math.nan  # tanh's output, the L tensor, is NaN in that row
    recovery.begin([capture])
    out = model.layers[0](x.requires_grad_())
    bundle = recovery.bundles[0]
    assert bundle.selected is not None and bundle.in_mlp[bundle.selected]
    if capture == "L":  # found while packing: L is not offered
        assert bundle.nonfinite and bundle.available == {"R"}
        with pytest.raises(ValueError, match="not available"):
            recovery.select(["L"])
        recovery.select(["R"])
    else:  # found when H turns to L after the forward: the layer falls back to R
        assert recovery.select(["L"]) == ["R"] and bundle.nonfinite
    out.sum().backward()  # R replays the layer
    assert bundle.replays == 1
    recovery.close()
    assert "forward" not in vars(model.layers[0])


def test_the_threshold_share_is_the_references_and_the_formula_counts_a_bf16_layer():
    data = make_data(256, B, 16, seed=0, device=torch.device("cpu"))
    model, method = _paper(dtype=torch.bfloat16)
    method.find_l_tensors(_step(method), data)
    counted = [b.activation_bytes for b in method.recovery.bundles.values()]
    c = model.config
    assert counted == [decoder_layer_saved_bytes(B * 16, c.hidden, c.intermediate, c.n_heads)] * 2
    assert decoder_layer_saved_bytes(4096, 2048, 11008, 16) == 562_331_648
    assert L_THRESHOLD_SHARE == pytest.approx((32 << 20) / 562_331_648)
    assert method.recovery.thresholds == [math.ceil(L_THRESHOLD_SHARE * n) for n in counted]


# --- the allocator -------------------------------------------------------------------

def _brute_force(utility, memory, risk, captures, available, memory_left, risk_left, intervals) -> float:
    """The best utility over every combination of actions, each cost rounded up to whole steps."""
    def options(i):
        for a, action in enumerate(ACTIONS):
            if action == "R":
                yield a, 0, 0
                continue
            if action not in AFTER_CAPTURE[captures[i]] or action not in available[i] or utility[i][a] <= 0:
                continue
            if action == "L" and risk_left == 0:
                continue
            cost_m, cost_r = memory[i][a], risk[i] if action == "L" else 0.0
            if (memory_left == 0 and cost_m > 0) or cost_m > memory_left or cost_r > risk_left:
                continue
            steps_m = 0 if memory_left == 0 else math.ceil(cost_m / (memory_left / intervals))
            steps_r = 0 if risk_left == 0 else math.ceil(cost_r / (risk_left / intervals))
            yield a, steps_m, steps_r

    best = -math.inf
    for combo in itertools.product(*(list(options(i)) for i in range(len(captures)))):
        if sum(c[1] for c in combo) <= intervals and sum(c[2] for c in combo) <= intervals:
            best = max(best, sum(utility[i][c[0]] for i, c in enumerate(combo)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_allocator_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    intervals = 16  # coarse enough that rounding up matters
    mixed = 0
    for _ in range(25):
        n = rng.randint(1, 5)
        captures = [rng.choice("RHHHLL") for _ in range(n)]
        available = [tuple(a for a in ACTIONS if a == "R" or rng.random() < 0.8) for _ in range(n)]
        utility = [[0.0, rng.uniform(-0.2, 1.0), rng.uniform(-0.2, 1.0)] for _ in range(n)]
        memory = [[0.0, rng.choice([0.0, rng.uniform(0, 100)]), rng.uniform(0, 60)] for _ in range(n)]
        risk = [rng.uniform(0, 0.05) for _ in range(n)]
        # Some budgets are zero, one is negative (the all-R plan alone does not fit): then all R.
        memory_left = rng.choice([0.0, -1.0, *(rng.uniform(0, 250) for _ in range(4))])
        risk_left = rng.choice([0.0, *(rng.uniform(0, 0.1) for _ in range(3))])
        got = allocate(utility, memory, risk, captures, available, memory_left, risk_left, intervals=intervals)
        best = _brute_force(utility, memory, risk, captures, available, memory_left, risk_left, intervals)
        if memory_left < 0:
            assert got.actions == ("R",) * n
        mixed += set(got.actions) != {"R"}
        assert got.utility == pytest.approx(best, abs=1e-12)
        assert sum(utility[i][ACTIONS.index(a)] for i, a in enumerate(got.actions)) == pytest.approx(best, abs=1e-12)
        assert sum(memory[i][ACTIONS.index(a)] for i, a in enumerate(got.actions)) <= max(memory_left, 0.0)
        assert sum(risk[i] for i, a in enumerate(got.actions) if a == "L") <= risk_left
        assert all(a in AFTER_CAPTURE[c] and a in av for a, c, av in zip(got.actions, captures, available))
    assert mixed >= 5  # many cases choose more than all R: the search is exercised


def test_the_allocator_gives_all_r_when_nothing_fits_and_breaks_ties_as_the_reference():
    utility, memory, risk = [[0.0, 1.0, 1.0]] * 2, [[0.0, 10.0, 5.0]] * 2, [0.01] * 2
    both = (("R", "H", "L"),) * 2
    # The all-R plan alone over the budget, or every cost over it: all R.
    assert allocate(utility, memory, risk, "HH", both, -1.0, 0.1).actions == ("R", "R")
    assert allocate(utility, memory, risk, "HH", both, 4.0, 0.1).actions == ("R", "R")
    # H and L save the same time: among equal utilities the lowest risk wins (H, H) ...
    assert allocate(utility, memory, risk, "HH", both, 100.0, 0.1).actions == ("H", "H")
    # ... and where only one H fits, H + L and L + H tie in every cost: at one state an action
    # wins only when strictly better, R, H, L in turn, so the last layer takes H.
    assert allocate(utility, memory, risk, "HH", both, 16.0, 0.1).actions == ("L", "H")
    assert allocate(utility, memory, risk, "HH", both, 16.0, 0.0).actions == ("H", "R")  # no risk budget, no L
    # Costs are rounded up: 10 + 5 bytes of a 15-byte budget take 683 + 342 > 1024 steps.
    assert allocate(utility, memory, risk, "HH", both, 15.0, 0.1).actions == ("L", "L")
    with pytest.raises(ValueError, match="R saves no time"):
        allocate([[1.0, 1.0, 1.0]], [[0.0, 1.0, 1.0]], [0.0], "H", both[:1], 1.0, 1.0)


# --- the scheduler and the bench ------------------------------------------------------

def test_the_scheduler_prices_l_by_this_steps_exposure():
    data = _data()
    model, method = _paper(risk_budget=1.0)
    method.find_l_tensors(_step(method), data)
    method.budget_bytes = 10_000
    method.plan = CapturePlan(captures=("H", "H"), admitted=(("R", "H", "L"),) * 2,
                              utility=((0.0, 2.0, 1.0),) * 2, memory=((0.0, 6_000.0, 1_000.0),) * 2,
                              all_r=Measured(seconds=1.0, peak_bytes=2_000))
    cheap, dear = Calibration(kappa=0.0, mean_error=0.1, selected=0), Calibration(kappa=1e6, mean_error=0.1, selected=0)
    # Two H do not fit the 8,000 bytes left; H and L do when L is cheap in risk (the tie broken as
    # the reference: the last layer takes H), H alone when L's risk is over the budget.
    for calibration, expected in ((cheap, ["L", "H"]), (dear, ["H", "R"])):
        method.calibration = {0: calibration, 1: calibration}
        model.zero_grad(set_to_none=True)
        _step(method)(data)
        last = method.last
        assert last["actions"] == expected and last["memory_left"] == 8_000
        assert last["exposure"] > 0 and last["risks"] == [calibration.risk(last["exposure"])] * 2


def test_paper_runs_through_the_bench_worker():
    assert "paper" in METHODS and LABELS["paper"] == "paper (reference runtime)"
    options = MethodOptions(paper_calibration_microbatches=2, paper_repeats=2)
    config = WorkerConfig(method="paper", model="tiny", batch=B, seq_len=32, seed=0, device="cpu", warmup=1,
                          options=options, threads=1)
    assert WorkerConfig.from_json(config.to_json()) == config
    worker = Worker(config)
    info = json.loads(json.dumps(worker.setup()["info"]))["paper"]  # the record crosses the pipe as JSON
    assert info["gc_peak_source"] == "eager GC measured by the method"
    assert info["budget_bytes"] == math.floor(1.10 * info["gc_peak_bytes"])
    assert info["l_threshold_bytes"] == [math.ceil(L_THRESHOLD_SHARE * n) for n in info["layer_saved_bytes"]]
    assert info["calibrated_layers"] == [0, 1] and set(info["calibration"]) == {"0", "1"}
    assert info["config"]["risk_budget"] == pytest.approx(math.sqrt(1 - 0.999 ** 2))  # HiLoRe's cos >= 0.999
    assert len(info["last_step"]["actions"]) == 2
    assert len(worker.measure(1)) == 1
    store = _grad_of(build_model("tiny", seed=0), worker.data)
    cosine = torch.nn.functional.cosine_similarity(flat_grad(worker.model), store, dim=0)
    assert cosine > 0.999
