"""The baselines issue #38 added: the fixed checkpointing ones, torchtitan's op- and layer-level
selective AC and GC with int8 checkpoints (``bench/checkpointing.py``), compiled as
``prepare_method`` compiles them; the budgeted ``int8-recompute``; and issue #53's planners
that ship with PyTorch (``bench/peers.py``), searched over their knob."""

from __future__ import annotations

import collections
import importlib.util
import types

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from hilore_compiler.backend.planning import cache_key, trace_key
from hilore_compiler.bench.checkpointing import (
    MM,
    Checkpointed,
    Int8Checkpointed,
    _sac_save_ops,
    op_sac_policy,
    wrap_layers_int8,
)
from hilore_compiler.bench.frontier import BUDGETED
from hilore_compiler.bench.peers import SEARCHED, hidden_state_mb, probe_grid
from hilore_compiler.bench.methods import (
    DEFAULT_METHODS,
    LABELS,
    METHODS,
    UNBOUNDED_RISK,
    MethodOptions,
    prepare_method,
    uniform_plan,
)
from hilore_compiler.bench.worker import actor_step, flat_grad, make_data
from hilore_compiler.codecs import INT8
from hilore_compiler.grpo import GRPOConfig
from hilore_compiler.models import build_model
from hilore_compiler.models.llama import LlamaDecoderLayer, rotary_cos_sin
from hilore_compiler.solver import solve
from hilore_compiler.solver.risk import parse_risk_budget
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

BASELINES = ("sac-op", "sac-layer2", "gc-int8")
#: Tiny's shape in these tests: (B, T) tokens, hidden C.
B, T, C = 2, 16, 64
#: Matmuls per tiny Llama layer: q, k, v, o projections, gate, up, down.
LAYER_MMS = 7


def _data():
    return make_data(256, B, T, seed=0, device=torch.device("cpu"))


def test_the_baselines_are_fixed_methods_run_only_by_name():
    assert METHODS[METHODS.index("sac") + 1:METHODS.index("sac") + 4] == BASELINES
    assert all(m in LABELS and m not in DEFAULT_METHODS and m not in BUDGETED for m in BASELINES)
    assert list(DEFAULT_METHODS) == [m for m in METHODS if m in DEFAULT_METHODS]  # METHODS' order


# --- sac-op: torchtitan's op-level policy ----------------------------------------

def test_op_policy_recomputes_every_second_mm_counting_each_pass_apart():
    save, sdpa = _sac_save_ops(), torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    ops = [MM, sdpa, MM, torch.ops.aten.add.Tensor, MM, MM, MM]
    meta: dict = collections.defaultdict(int)
    decisions = {}
    for recompute in (False, True):
        ctx = types.SimpleNamespace(is_recompute=recompute)
        decisions[recompute] = [op_sac_policy(save, meta, ctx, op) == CheckpointPolicy.MUST_SAVE for op in ops]
    # mm 1, 3, 5 saved, mm 2, 4 recomputed; attention saved; add recomputed.
    assert decisions[False] == [True, True, False, False, True, False, True]
    assert decisions[True] == decisions[False]  # the recompute counts from 1 again
    assert dict(meta) == {"forward_mm_count": 5, "recompute_mm_count": 5}


def _aot_graphs(method: str, options: MethodOptions | None = None) -> dict:
    """``method`` compiled with AOTAutograd and Inductor's partitioner, no Inductor, under the
    method's config patch: its partitioned graphs, dynamo graph count and graph breaks after one step."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict = {"fw": [], "bw": []}

    def keep(kind):
        return lambda gm, _: graphs[kind].append(gm) or make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    counters.clear()
    model = build_model("tiny", seed=0)
    # The method's wrapping, with the AOTAutograd backend instead of Inductor.
    prepared = prepare_method(method, model, options or MethodOptions())
    with prepared.compile_context():
        actor_step(torch.compile(model, backend=backend), _data(), GRPOConfig())
    return {**graphs, "dynamo_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def _mms(gms) -> int:
    return sum(n.target == MM for gm in gms for n in gm.graph.nodes)


def test_sac_op_recomputes_every_second_matmul_of_each_layer_in_one_graph():
    """Backward runs two mms per linear; sac-op adds the recompute of mm 2, 4, 6 of each
    layer (a counter shared across layers would recompute 4 in the second), sac none."""
    runs = {m: _aot_graphs(m) for m in ("store-all", "sac", "sac-op")}
    layers = 2
    assert _mms(runs["sac"]["bw"]) == _mms(runs["store-all"]["bw"])
    assert _mms(runs["sac-op"]["bw"]) - _mms(runs["sac"]["bw"]) == layers * (LAYER_MMS // 2)
    assert _mms(runs["sac-op"]["fw"]) == _mms(runs["sac"]["fw"])
    for key in ("dynamo_graphs", "graph_breaks"):
        assert runs["sac-op"][key] == runs["sac"][key]
    assert (runs["sac-op"]["dynamo_graphs"], runs["sac-op"]["graph_breaks"]) == (1, 0)


# --- sac-layer2 ---------------------------------------------------------------------

def test_sac_layer2_checkpoints_every_second_layer_counted_from_one():
    model = build_model("tiny", seed=0, n_layers=5)
    prepare_method("sac-layer2", model, MethodOptions())  # torch.compile is lazy: nothing compiles
    wrapped = [i for i, layer in enumerate(model.layers) if isinstance(layer, Checkpointed)]
    assert wrapped == [1, 3]  # torchtitan: the 2nd and 4th layer
    assert all(isinstance(model.layers[i], LlamaDecoderLayer) for i in (0, 2, 4))
    assert model.layers[1].context_fn is None  # full checkpoint, as gc's


# --- gc-int8 ------------------------------------------------------------------------

def test_gc_int8_keeps_only_the_int8_encoded_layer_input():
    model = build_model("tiny", seed=0)
    layer, cfg = model.layers[0], model.config
    cos, sin = rotary_cos_sin(T, cfg.head_dim, cfg.rope_theta, torch.device("cpu"))  # (T, hd), kept as they are
    x = torch.randn(B, T, C, requires_grad=True)
    saved: dict = {}
    for name, module in (("store", layer), ("int8", Int8Checkpointed(layer, compiled=False))):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = module(x, cos, sin)
        saved[name] = (out, [t for t in kept if t is not cos and t is not sin])
    (exact, _), (out, kept) = saved["store"], saved["int8"]
    assert torch.equal(out, exact)  # the forward is exact
    assert [(t.dtype, tuple(t.shape)) for t in kept] == [(torch.int8, (B, T, C)), (torch.float32, (B, T, 1))]
    assert sum(t.nbytes for t in kept) == B * T * C + 4 * B * T == INT8.encoded_nbytes((B, T, C), x.dtype)
    assert sum(t.nbytes for t in saved["store"][1]) > 4 * x.nbytes  # what the layer keeps unwrapped


@pytest.mark.parametrize("model_name", ["tiny", "gpt-tiny", "llama-tiny-dropout"])
def test_gc_int8_eager_gradients_are_close_to_store_alls_not_equal(model_name):
    """With dropout too: the recompute replays the forward's RNG state (without that,
    cosine 0.92 here)."""
    data, grads = _data(), {}
    for wrap in (False, True):
        model = build_model(model_name, seed=0)
        if wrap:
            wrap_layers_int8(model, compiled=False)
        torch.manual_seed(1)
        actor_step(model, data, GRPOConfig())
        grads[wrap] = flat_grad(model)
    assert torch.cosine_similarity(grads[True], grads[False], dim=0) > 0.999
    assert not torch.equal(grads[True], grads[False])


def test_encode_unchecked_is_encode_on_finite_rows_and_poisons_a_non_finite_row():
    x = torch.randn(3, 8)
    assert all(torch.equal(a, b) for a, b in zip(INT8.encode_unchecked(x), INT8.encode(x)))
    x[1, 2] = float("inf")
    decoded = INT8.decode(INT8.encode_unchecked(x), x.dtype)
    assert decoded[1].isnan().all() and decoded[[0, 2]].isfinite().all()


# --- compiled with Inductor, as the bench runs them ---------------------------------

@pytest.fixture(scope="module")
def compiled():
    """Store-all's eager gradient and each baseline's, compiled by ``prepare_method`` with
    Inductor (tens of seconds each), with its model and dynamo's graph counts."""
    from torch._dynamo.utils import counters

    data = _data()
    reference = build_model("tiny", seed=0)
    actor_step(reference, data, GRPOConfig())
    out = {"store-all": {"grad": flat_grad(reference)}}
    for method in BASELINES:
        torch._dynamo.reset()
        counters.clear()
        model = build_model("tiny", seed=0)
        prepared = prepare_method(method, model, MethodOptions())
        actor_step(prepared.policy, data, GRPOConfig())
        out[method] = {"grad": flat_grad(model), "model": model, "policy": prepared.policy,
                       "dynamo_graphs": counters["stats"]["unique_graphs"],
                       "graph_breaks": dict(counters["graph_break"])}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sac-op", "sac-layer2"])
def test_compiled_selective_ac_gradients_match_store_alls(compiled, method):
    run = compiled[method]
    assert torch.allclose(run["grad"], compiled["store-all"]["grad"], rtol=1e-4, atol=1e-6)
    assert (run["dynamo_graphs"], run["graph_breaks"]) == (1, {})


@pytest.mark.slow
def test_compiled_gc_int8_is_close_to_store_all_keeps_int8_and_breaks_only_around_layers(compiled):
    run, exact = compiled["gc-int8"], compiled["store-all"]["grad"]
    assert torch.cosine_similarity(run["grad"], exact, dim=0) > 0.999
    assert not torch.equal(run["grad"], exact)
    # The backward graph holds one int8 checkpoint per layer, in the Function's ctx.
    logits = run["policy"](_data().input_ids)
    nodes, seen, kept = [logits.grad_fn], set(), []
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_KeptInputCheckpointBackward":
            kept.append(node.saved_tensors[0])
        nodes += [n for n, _ in node.next_functions]
    assert [(t.dtype, tuple(t.shape)) for t in kept] == [(torch.int8, (B, T, C))] * 2
    # Dynamo breaks the model's graph only at the layers' Function, kept out of it; its
    # graphs: rotary and embedding, final norm, lm_head (forward and hidden_states each
    # resume after the break), and, shared by both layers, the layer without grad (the
    # forward), with grad (the recompute), the encode and the decode.
    assert len(run["graph_breaks"]) == 1
    assert all("KeptInputCheckpointed.forward" in reason for reason in run["graph_breaks"]), run["graph_breaks"]
    assert run["dynamo_graphs"] == 7


# --- int8-recompute: uniform int8 made to fit a ceiling ---------------------------

def test_int8_recompute_is_one_error_blind_int8_plan_under_the_same_budget(tmp_path):
    options = MethodOptions(hilore_budget="1.0x-gc", hilore_codecs=("bf16", "int8", "int4"),
                            hilore_cache_dir=str(tmp_path))
    backends = {name: prepare_method(name, build_model("tiny", seed=0), options).backend
                for name in ("hilore", "int8-recompute")}  # torch.compile is lazy: nothing compiles
    hilore, baseline = backends["hilore"].options, backends["int8-recompute"].options
    assert (baseline.buckets, baseline.codecs, baseline.memory_budget) == (1, ("int8",), hilore.memory_budget)
    assert parse_risk_budget(baseline.risk_budget) == UNBOUNDED_RISK > parse_risk_budget(hilore.risk_budget)
    assert "int8-recompute" in BUDGETED and "int8-recompute" not in DEFAULT_METHODS
    # One trace for both: the plans differ by planning alone, not by two profiles' timing noise.
    assert baseline.profiled_codecs == hilore.profiled_codecs == ("bf16", "int8", "int4")
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    inputs = [torch.ones(2, 4)]
    assert trace_key(gm, inputs, baseline) == trace_key(gm, inputs, hilore)
    assert cache_key(gm, inputs, baseline) != cache_key(gm, inputs, hilore)


def test_int8_recompute_mixes_int8_and_recompute_where_int8_alone_does_not_fit():
    small = SyntheticConfig(num_layers=2, hidden=64, intermediate=172, heads=4, kv_heads=2, vocab=128,
                            batch=2, seq_len=16)
    trace = synthetic_trace(small)
    all_int8 = next(b for b in uniform_plan(trace, "int8").buckets if not b.skip)
    plan = solve(trace, int(0.9 * all_int8.memory_bytes), risk_budget=UNBOUNDED_RISK, buckets=1, codecs="int8")
    decisions = set(plan.decisions("b0").values())
    assert decisions <= {"store", "compress:int8", "recompute"}
    assert {"compress:int8", "recompute"} <= decisions
    assert plan.bucket("b0").memory_bytes <= 0.9 * all_int8.memory_bytes


# --- the planners that ship with PyTorch (bench/peers.py) ---------------------------

def _saved(gms) -> list[torch.Tensor]:
    """What the backward graphs read from the forward: their tensor inputs' fake values."""
    return [n.meta["val"] for gm in gms for n in gm.graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]


def _saved_bytes(gms) -> int:
    return sum(t.numel() * t.element_size() for t in _saved(gms))


def test_the_peers_are_searched_methods_run_only_by_name():
    assert set(SEARCHED) == {"pt-budget", "pt-budget-greedy", "pt-budget-ilp", "pt-budget-knee",
                             "pt-budget-profile", "inductor-fp8"}
    assert all(m in METHODS and m in LABELS and m in BUDGETED for m in SEARCHED)
    assert [m for m in SEARCHED if m in DEFAULT_METHODS] == ["pt-budget"]


def test_probe_grids_are_budgets_and_fp8_size_thresholds_in_hidden_states():
    assert probe_grid("pt-budget-greedy", 4, unit_mb=9.0) == [0.125, 0.375, 0.625, 0.875]
    unit = hidden_state_mb("small", 2, 2048, "float32")
    assert unit == 2 * 2048 * 256 * 4 / 2**20 == 4.0  # one (B, T, C) fp32 activation of small
    assert probe_grid("inductor-fp8", 4, unit) == [1.0, 3.0, 6.0]
    assert hidden_state_mb("small", 2, 2048, "bfloat16") == 2.0
    with pytest.raises(ValueError, match="not a searched method"):
        probe_grid("gc", 4, unit)


@pytest.mark.parametrize("method, solver", [("pt-budget-greedy", "greedy"), ("pt-budget-knee",
                                                                            "dynamic_memory_budget_dp")])
def test_budget_variants_patch_their_solver_and_bypass_autograd_cache_only_while_compiling(method, solver):
    import torch._functorch.config as functorch_config

    prepared = prepare_method(method, build_model("tiny", seed=0), MethodOptions(activation_memory_budget=0.3))
    with prepared.compile_context():
        assert functorch_config.activation_memory_budget == 0.3
        assert functorch_config.activation_memory_budget_solver == solver
        assert functorch_config.activation_memory_budget_runtime_estimator == "flops"
        # Solver and estimator are not in AOTAutograd's cache key: a cached
        # pt-budget partition at the same budget would be served otherwise.
        assert not functorch_config.enable_autograd_cache
    assert functorch_config.activation_memory_budget_solver == "dp"
    assert functorch_config.activation_memory_budget == 1.0


def test_methods_that_cannot_run_here_say_why_before_compiling():
    options = MethodOptions(activation_memory_budget=0.3)
    with pytest.raises(ValueError, match="CUDA only.*benchmark_gpu"):
        prepare_method("pt-budget-profile", build_model("tiny", seed=0), options)
    if importlib.util.find_spec("scipy") is None:
        with pytest.raises(ValueError, match="needs scipy"):
            prepare_method("pt-budget-ilp", build_model("tiny", seed=0), options)
    with pytest.raises(ValueError, match="fp8_size_mb"):
        prepare_method("inductor-fp8", build_model("tiny", seed=0), MethodOptions())


@pytest.mark.parametrize("method", ["pt-budget", "pt-budget-greedy", "pt-budget-knee"])
def test_budget_methods_save_less_and_recompute_matmuls_at_a_low_budget(method):
    exact = _aot_graphs("store-all")
    low = _aot_graphs(method, MethodOptions(activation_memory_budget=0.125))
    assert _saved_bytes(low["bw"]) < 0.8 * _saved_bytes(exact["bw"])
    assert _mms(low["bw"]) > _mms(exact["bw"])  # matmuls recomputed in backward
    assert (low["dynamo_graphs"], low["graph_breaks"]) == (1, 0)


def test_inductor_fp8_keeps_activations_above_its_threshold_in_float8():
    exact = _aot_graphs("store-all")
    every = _aot_graphs("inductor-fp8", MethodOptions(fp8_size_mb=0.0))
    # tiny at (B, T) = (2, 16): a (B, T, C) fp32 activation is 8 KiB, the MLP's (B, T, 128) 16 KiB.
    mlp_only = _aot_graphs("inductor-fp8", MethodOptions(fp8_size_mb=12 / 1024))
    fp8 = {name: [t for t in _saved(run["bw"]) if t.dtype == torch.float8_e5m2]
           for name, run in (("every", every), ("mlp_only", mlp_only))}
    # Three (B*T, 128) MLP values per layer (gate, up, the product); at threshold 0 also the
    # attention's and the norms' values and their row statistics.
    assert [tuple(t.shape) for t in fp8["mlp_only"]] == [(B * T, 128)] * 3 * 2
    assert len(fp8["every"]) > len(fp8["mlp_only"])
    assert (B, T, 1) in {tuple(t.shape) for t in fp8["every"]}
    assert not any(t.dtype == torch.float8_e5m2 for t in _saved(exact["bw"]))
    assert _saved_bytes(every["bw"]) < _saved_bytes(mlp_only["bw"]) < _saved_bytes(exact["bw"])
    assert _mms(every["bw"]) == _mms(exact["bw"])  # it compresses; it recomputes nothing more


def test_a_probe_that_fails_to_compile_stops_the_frontier_grid():
    from types import SimpleNamespace

    from hilore_compiler.bench.frontier import FAILED, _searched_points
    from hilore_compiler.bench.rounds import MethodRun
    from hilore_compiler.bench.runner import BenchConfig

    started = []

    def start(method, tag="", budget=None, **_):
        started.append(budget)
        return MethodRun(method=method, name=method + tag, status="failed", error="CUDA only",
                         worker_config=SimpleNamespace(options=MethodOptions(activation_memory_budget=budget)))

    launcher = SimpleNamespace(config=BenchConfig(model="tiny", ceilings=(1.0, 1.5), budget_probes=4),
                               gc_peaks={"gc": 100_000_000}, start=start)
    runs: dict = {}
    points, probes = _searched_points(launcher, runs, "pt-budget-profile", progress=lambda m: None)
    assert started == [0.125] and len(probes) == 1 and probes[0].method == "pt-budget-profile"
    assert [p.status for p in points] == [FAILED, FAILED]
    assert list(runs) == ["pt-budget-profile@0.125"]  # kept: its log says why


@pytest.fixture(scope="module")
def compiled_peers():
    """Store-all's eager gradient and two peers' compiled by ``prepare_method`` with Inductor."""
    from torch._dynamo.utils import counters

    data = _data()
    reference = build_model("tiny", seed=0)
    actor_step(reference, data, GRPOConfig())
    out = {"store-all": {"grad": flat_grad(reference)}}
    for method, options in (("pt-budget-greedy", MethodOptions(activation_memory_budget=0.125)),
                            ("inductor-fp8", MethodOptions(fp8_size_mb=0.0))):
        torch._dynamo.reset()
        counters.clear()
        model = build_model("tiny", seed=0)
        prepared = prepare_method(method, model, options)
        with prepared.compile_context():
            actor_step(prepared.policy, data, GRPOConfig())
        out[method] = {"grad": flat_grad(model), "inductor": dict(counters["inductor"])}
    return out


@pytest.mark.slow
def test_compiled_budget_variant_recomputes_exactly(compiled_peers):
    assert torch.allclose(compiled_peers["pt-budget-greedy"]["grad"], compiled_peers["store-all"]["grad"],
                          rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_inductor_fp8_quantizes_in_both_graphs_and_is_close_not_equal(compiled_peers):
    run, exact = compiled_peers["inductor-fp8"], compiled_peers["store-all"]["grad"]
    assert run["inductor"]["activation_quantization_fwd_aten_pass"] == 1
    assert run["inductor"]["activation_quantization_bwd_aten_pass"] == 1
    assert torch.cosine_similarity(run["grad"], exact, dim=0) > 0.9  # e5m2: 2 mantissa bits
    assert not torch.equal(run["grad"], exact)
