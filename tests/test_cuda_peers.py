"""Issue #53's peers that run on CUDA only (``bench/offload.py``, ``bench/sac_milp.py``): each
refuses a CPU device in one line saying why; what runs on a CPU all the same is checked here:
what ``gc-offload`` keeps, ``sac-offload``'s policy and compiled offloads, ``sac-milp``'s budget,
op policy, how its plan is applied, and the whole plan with the roofline replaced by a CPU
estimate."""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import math
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from hilore_compiler.bench import offload, sac_milp
from hilore_compiler.bench.checkpointing import (
    MM,
    Checkpointed,
    _sac_save_ops,
    op_sac_policy,
    wrap_layers,
    wrap_layers_kept,
)
from hilore_compiler.bench.frontier import BUDGETED
from hilore_compiler.bench.launcher import REFERENCE_GC
from hilore_compiler.bench.methods import CUDA_ONLY, DEFAULT_METHODS, LABELS, METHODS, MethodOptions, prepare_method
from hilore_compiler.bench.worker import actor_step, flat_grad, make_data
from hilore_compiler.grpo import GRPOConfig
from hilore_compiler.models import build_model
from hilore_compiler.models.llama import rotary_cos_sin

#: Tiny's shape in these tests: (B, T) tokens, hidden C; matmuls per layer (q, k, v, o, gate, up, down).
B, T, C, LAYER_MMS = 2, 16, 64, 7


def _data():
    return make_data(256, B, T, seed=0, device=torch.device("cpu"))


def _grad(model) -> torch.Tensor:
    actor_step(model, _data(), GRPOConfig())
    return flat_grad(model)


@pytest.mark.parametrize("method", CUDA_ONLY)
def test_cuda_only_methods_refuse_a_cpu_in_one_line_saying_why(method):
    assert method in METHODS and method in LABELS and method not in DEFAULT_METHODS
    with pytest.raises(ValueError, match=rf"^{method} runs on CUDA only: \S.{{40,}}$") as info:
        prepare_method(method, build_model("tiny", seed=0), MethodOptions(activation_memory_budget=0.3))
    assert "\n" not in str(info.value)


def test_the_new_peers_are_fixed_except_sac_milp_planned_at_gcs_peak():
    assert set(CUDA_ONLY) == {"gc-offload", "sac-offload", "sac-milp", "pt-budget-profile"}
    assert sac_milp.METHOD in BUDGETED and REFERENCE_GC[sac_milp.METHOD] == "gc"
    assert not set(offload.METHODS) & set(BUDGETED)
    assert METHODS.index("gc") < METHODS.index(sac_milp.METHOD)  # GC's peak is measured first


# --- gc-offload -----------------------------------------------------------------------

def test_gc_offload_keeps_only_a_host_copy_of_the_layer_input():
    model = build_model("tiny", seed=0)
    layer, cfg = model.layers[0], model.config
    cos, sin = rotary_cos_sin(T, cfg.head_dim, cfg.rope_theta, torch.device("cpu"))
    x = torch.randn(B, T, C, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = offload.OffloadCheckpointed(layer, compiled=False)(x, cos, sin)
    assert torch.equal(out, layer(x, cos, sin))  # the forward is exact
    (host,) = [t for t in kept if t is not cos and t is not sin]
    assert host.device.type == "cpu" and torch.equal(host, x)
    assert host.data_ptr() != x.data_ptr()  # a copy, as save_on_cpu packs it
    assert host.is_pinned() == (x.is_cuda and torch.cuda.is_available())


def test_gc_offload_gradients_equal_store_alls_with_dropout():
    """The recompute runs on the host copy brought back, with the forward's RNG state."""
    grads = {}
    for wrap in (False, True):
        model = build_model("llama-tiny-dropout", seed=0)
        if wrap:
            wrap_layers_kept(model, offload.OffloadCheckpointed, compiled=False)
        torch.manual_seed(1)
        grads[wrap] = _grad(model)
    assert torch.equal(grads[True], grads[False])


# --- sac-offload ----------------------------------------------------------------------

def test_offload_policy_offloads_exactly_what_sac_op_saves():
    save, sdpa = _sac_save_ops(), torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    ops = [MM, sdpa, MM, torch.ops.aten.add.Tensor, MM, MM, MM]
    ctx = types.SimpleNamespace(is_recompute=False)
    sac_op_meta, offload_meta = collections.defaultdict(int), collections.defaultdict(int)
    sac_op = [op_sac_policy(save, sac_op_meta, ctx, op) for op in ops]
    offloaded = [offload.op_offload_policy(save, offload_meta, ctx, op) for op in ops]
    assert [p == CheckpointPolicy.MUST_SAVE for p in sac_op] == \
        [p == CheckpointPolicy.MUST_CPU_OFFLOAD for p in offloaded] == [True, True, False, False, True, False, True]
    assert [p for p in offloaded if p != CheckpointPolicy.MUST_CPU_OFFLOAD] == \
        [p for p in sac_op if p != CheckpointPolicy.MUST_SAVE]


def test_sac_offload_compiled_moves_saved_matmuls_to_the_host_and_back():
    """Inductor's partitioner (no Inductor) under ``sac-offload``'s patch: its forward offloads
    matmul outputs only, its backward reloads each; the device copies are identities here."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict = {"fw": [], "bw": []}

    def keep(kind):
        return lambda gm, _: graphs[kind].append(gm) or make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    exact = _grad(build_model("tiny", seed=0))
    torch._dynamo.reset()
    model = wrap_layers(build_model("tiny", seed=0), offload.op_offload_context_fn())
    with offload.offload_compile_context()():
        assert functorch_config.enable_activation_offloading and not functorch_config.enable_autograd_cache
        grad = _grad(torch.compile(model, backend=backend))
    assert not functorch_config.enable_activation_offloading  # patched only while compiling
    assert torch.allclose(grad, exact, atol=1e-6)
    (fw,), (bw,) = graphs["fw"], graphs["bw"]
    offloads = [n for n in fw.graph.nodes if n.name.startswith("cpu_offload_")]
    reloads = {n.name for n in bw.graph.nodes if n.name.startswith("gpu_reload_")}
    assert all(n.args[0].target == MM for n in offloads)
    layers = len(model.layers)
    assert layers <= len(offloads) <= layers * (LAYER_MMS + 1) // 2  # sac-op saves mm 1, 3, 5, 7
    assert reloads == {n.name.replace("cpu_offload_", "gpu_reload_") for n in offloads}


# --- sac-milp -------------------------------------------------------------------------

def test_sac_milp_budget_is_the_ceiling_plus_the_parameters_in_gib():
    assert sac_milp.budget_gib("1.1x-gc", gc_peak_bytes=2**30, param_bytes=2**29) == pytest.approx(1.6)
    assert sac_milp.budget_gib("3GiB", gc_peak_bytes=None, param_bytes=2**30) == 4.0
    for text, gc in (("1.1x-gc", None), ("0.5x-store", 2**30)):
        with pytest.raises(ValueError, match="multiple of GC's measured peak"):
            sac_milp.budget_gib(text, gc_peak_bytes=gc, param_bytes=0)


def test_sac_milp_policy_decides_each_call_of_an_op_in_order_per_pass():
    decisions = dict(sac_milp.by_op_name(["mm", "add", "mm", "mm"], [1, 0, 0, 1]))
    assert decisions == {"mm": (1, 0, 1), "add": (0,)}
    aten, counts = torch.ops.aten, collections.defaultdict(int)
    ops = [aten.mm.default, aten.detach.default, aten.add.Tensor, aten.mm.default, aten.mm.default,
           aten.mm.default, aten.mul.Tensor]
    got = {}
    for recompute in (False, True):
        ctx = types.SimpleNamespace(is_recompute=recompute)
        got[recompute] = [sac_milp.milp_policy(decisions, counts, ctx, op).name for op in ops]
    # detach: ignored by SAC, counted for nothing; the 4th mm and mul: not seen by the estimate.
    assert got[False] == ["PREFER_SAVE", "MUST_RECOMPUTE", "MUST_RECOMPUTE", "MUST_RECOMPUTE", "PREFER_SAVE",
                          "PREFER_RECOMPUTE", "PREFER_RECOMPUTE"]
    assert got[True] == got[False]  # the recompute counts from the first call again


class _CountMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.mms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.mms += func == MM
        return func(*args, **(kwargs or {}))


def _backward_mms(model) -> tuple[int, torch.Tensor]:
    """Matmuls run by the step's backward (recomputes included), and the gradient."""
    data = _data()
    logits = model(data.input_ids)
    loss = torch.nn.functional.log_softmax(logits.float(), -1).mean()
    with _CountMM() as count:
        loss.backward()
    return count.mms, flat_grad(model)


def test_sac_milp_plan_applies_a_whole_recompute_and_an_op_policy_per_unit():
    """layers.0 discarded whole; layers.1.mlp recomputing only its 2nd matmul, or all; the
    gradient is store-all's. Backward recomputes no more than it needs (non-reentrant
    checkpoint stops early): a layer's down projection feeds only the residual add, so a
    whole layer recomputes LAYER_MMS - 1 matmuls and the MLP's 3rd is never recomputed."""
    store_mms, exact = _backward_mms(build_model("tiny", seed=0))
    runs = {}
    for mlp in (None, (1, 0, 1), (0, 0, 0)):
        model = build_model("tiny", seed=0)
        policies = {"LlamaModel.layers.0": None}
        if mlp is not None:
            policies["LlamaModel.layers.1.mlp"] = (("mm", mlp),)
        assert sac_milp.apply(model, policies) is model
        assert isinstance(model.layers[0], Checkpointed) and model.layers[0].context_fn is None
        assert isinstance(model.layers[1].mlp, Checkpointed) == (mlp is not None)
        runs[mlp] = _backward_mms(model)
        assert torch.equal(runs[mlp][1], exact)
    assert runs[None][0] - store_mms == LAYER_MMS - 1
    assert runs[(1, 0, 1)][0] - runs[None][0] == 1
    assert runs[(0, 0, 0)][0] - runs[None][0] == 2
    root = sac_milp.apply(build_model("tiny", seed=0), {"LlamaModel": None})  # the root as the unit
    assert isinstance(root, Checkpointed) and torch.equal(_backward_mms(root)[1], exact)


def _cpu_roofline(cls, func, args, kwargs):
    """A stand-in for the roofline, which asserts CUDA: cost proportional to output elements."""
    out = func(*args, **(kwargs or {}))
    elements = sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return out, elements * 1e-6


class _OneLineFit:
    """A stand-in for ``pwlf.PiecewiseLinFit`` where pwlf is not installed: one least-squares
    line, repeated in every segment (what ``SACEstimator`` reads: slopes, intercepts, breaks)."""

    def __init__(self, x, y) -> None:
        import numpy as np

        self.x, self.y, self.np = np.asarray(x, dtype=float), np.asarray(y, dtype=float), np

    def fit(self, n_segments: int) -> None:
        np = self.np
        slope, intercept = np.polyfit(self.x, self.y, 1) if len(self.x) > 1 else (0.0, float(self.y[0]))
        self.slopes, self.intercepts = np.full(n_segments, slope), np.full(n_segments, intercept)
        self.fit_breaks = np.linspace(self.x.min(), self.x.max(), n_segments + 1)

    def calc_slopes(self):
        return self.slopes


def test_sac_milp_plans_under_the_budget_and_its_plan_keeps_the_gradient(monkeypatch):
    """The whole plan on a CPU: the roofline replaced by a CPU estimate, and pwlf by one
    least-squares line where it is not installed."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    monkeypatch.setattr(RuntimeEstimator, "_roofline_estimate", classmethod(_cpu_roofline))
    if importlib.util.find_spec("pwlf") is None:
        monkeypatch.setitem(sys.modules, "pwlf", types.SimpleNamespace(PiecewiseLinFit=_OneLineFit))
    model, shape = build_model("tiny", seed=0), (B, 4 * T)  # activations outweigh tiny's parameters
    with pytest.raises(ValueError, match="no AC plan fits"):
        sac_milp.plan(model, shape, 1e-6, GRPOConfig())
    loose = sac_milp.plan(model, shape, 1.0, GRPOConfig())  # 1 GiB: no AC needed
    assert loose.ac_decisions == {} and loose.recomputation_ms == 0 and loose.peak_bytes <= 2**30
    budget = 0.9 * loose.baseline_peak_bytes / 2**30
    tight = sac_milp.plan(model, shape, budget, GRPOConfig())
    # sac_milp rounds its bound to whole bytes
    assert tight.ac_decisions and tight.peak_bytes <= math.ceil(budget * 2**30) < tight.baseline_peak_bytes
    assert set(tight.policies) == set(tight.ac_decisions)
    data = make_data(256, *shape, seed=0, device=torch.device("cpu"))
    exact = build_model("tiny", seed=0)
    actor_step(exact, data, GRPOConfig())
    actor_step(sac_milp.apply(model, tight.policies), data, GRPOConfig())
    assert torch.equal(flat_grad(model), flat_grad(exact))


# --- on CUDA: what bench/gpu_session.sh's test step checks there -------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the offloads and sac-milp need CUDA")


def _cuda_step(model) -> tuple[int, torch.Tensor]:
    """One step on CUDA: its peak over what was allocated before it, and the gradient."""
    data = make_data(256, B, 4 * T, seed=0, device=torch.device("cuda"))
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    actor_step(model, data, GRPOConfig())
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, flat_grad(model).cpu()


@needs_cuda
def test_on_cuda_gc_offload_keeps_the_gradient_and_holds_less_than_gc():
    peaks, grads = {}, {}
    for name, wrap in (("store", None), ("gc", Checkpointed), ("offload", offload.OffloadCheckpointed)):
        model = build_model("tiny", seed=0, device="cuda")
        if wrap is Checkpointed:
            wrap_layers(model)
        elif wrap is not None:
            wrap_layers_kept(model, wrap, compiled=False)
        peaks[name], grads[name] = _cuda_step(model)
    assert torch.equal(grads["offload"], grads["store"]) and torch.equal(grads["gc"], grads["store"])
    assert peaks["offload"] < peaks["gc"] < peaks["store"]


@needs_cuda
def test_on_cuda_sac_offload_compiled_keeps_the_gradient_and_holds_less_than_sac_op():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from hilore_compiler.bench.checkpointing import op_selective_context_fn

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition)  # no Inductor: seconds
    _, exact = _cuda_step(build_model("tiny", seed=0, device="cuda"))
    peaks = {}
    for name, context_fn, patch in (("sac-op", op_selective_context_fn(), contextlib.nullcontext),
                                    ("sac-offload", offload.op_offload_context_fn(),
                                     offload.offload_compile_context())):
        torch._dynamo.reset()
        compiled = torch.compile(wrap_layers(build_model("tiny", seed=0, device="cuda"), context_fn), backend=backend)
        with patch():
            _cuda_step(compiled)  # compiles
        peaks[name], grad = _cuda_step(compiled)
        assert torch.allclose(grad, exact, rtol=1e-3, atol=1e-5)
    assert peaks["sac-offload"] < peaks["sac-op"]


@needs_cuda
@pytest.mark.skipif(bool(sac_milp.missing_modules()), reason="sac-milp needs pulp, pwlf and scipy")
def test_on_cuda_sac_milp_plans_with_torchs_estimators_and_keeps_the_gradient():
    model = build_model("tiny", seed=0, device="cuda")
    _, exact = _cuda_step(build_model("tiny", seed=0, device="cuda"))
    # sac_milp's budget counts the parameters, the bench's (a size here) does not.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    baseline = sac_milp.plan(model, (B, 4 * T), 1.0, GRPOConfig()).baseline_peak_bytes
    ceiling = int(0.9 * baseline) - params  # under what the step holds without AC: some module is AC'd
    prepared = prepare_method("sac-milp", model, MethodOptions(hilore_budget=str(ceiling)))
    _, grad = _cuda_step(prepared.policy)
    record = prepared.record()["sac_milp"]
    assert record["budget_gib"] == pytest.approx((ceiling + params) / 2**30, rel=1e-9)
    assert record["ac_decisions"] and record["peak_bytes"] <= math.ceil(record["budget_gib"] * 2**30)
    assert torch.allclose(grad, exact, rtol=1e-3, atol=1e-5)
