"""Block classes in the solver: tied layers plan as well as the full ILP, at a size that does not grow with depth."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hilore_compiler.blockclasses import find_block_classes, layer_free_key
from hilore_compiler.jsonio import FormatError
from hilore_compiler.solver import SolverOptions, solve
from hilore_compiler.solver.ilp import BucketWeight, min_time_problem
from hilore_compiler.solver.planner import prepare
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace
from hilore_compiler.solver.tying import binary_split, pattern_groups, tie_blocks, untied
from hilore_compiler.tracefile import trace_from_json

#: A small decoder: the ILP's shape is a 4096-wide one's, its numbers small.
SMALL = SyntheticConfig(hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=1000, seq_len=256)
ONE = [BucketWeight(name="b0", samples=1.0, error=1.0)]


def _model(layers: int):
    return prepare(synthetic_trace(dataclasses.replace(SMALL, num_layers=layers)), codecs=["bf16", "int8"],
                   batch=None, seq_len=None)[1]


@pytest.mark.parametrize("n", range(0, 40))
def test_any_count_of_members_can_take_a_pattern_apart(n):
    sizes = binary_split(n)
    assert sum(sizes) == n
    reachable = {0}
    for s in sizes:
        reachable |= {r + s for r in reachable}
    assert reachable == set(range(n + 1))


def test_class_ends_decide_alone_and_the_middle_shares_few_patterns():
    groups = pattern_groups(list(range(1, 32)))
    assert groups[0] == (1,) and groups[-1] == (31,)
    assert [len(g) for g in groups[1:-1]] == [14, 8, 4, 2, 1]  # 29 = 14 + 8 + 4 + 2 + 1
    assert sorted(m for g in groups for m in g) == list(range(1, 32))


def test_layer_free_keys_match_across_layers_only():
    assert layer_free_key("model.layers.7.mlp:mul:0", 7) == layer_free_key("model.layers.12.mlp:mul:0", 12)
    assert layer_free_key("model.layers.7.mlp:mul:0", 3) == "model.layers.7.mlp:mul:0"
    assert layer_free_key("lm_head:mm:0", None) == "lm_head:mm:0"


def _size(model, tying) -> tuple[int, int]:
    problem, _ = min_time_problem(model, ONE, budget_bytes=model.gc_bytes, risk_budget=1.0, tying=tying)
    return len(problem.prob.variables()), sum(len(c) for c in problem.prob.constraints.values())


def test_tied_ilp_hardly_grows_with_depth_and_the_full_one_grows_linearly():
    small, deep = _model(16), _model(64)
    tied_small, tied_deep = _size(small, tie_blocks(small)), _size(deep, tie_blocks(deep))
    full_small, full_deep = _size(small, untied(small)), _size(deep, untied(deep))
    # Tied: two more patterns (16 -> 64 layers: 1+2+4+6 -> 1+2+4+8+16+28), a
    # few rows per layer for the kept-bytes chain, nothing per unit.
    assert tied_deep[0] < 1.5 * tied_small[0]
    assert tied_deep[1] < 1.5 * tied_small[1]
    # Full: nonzeros linear in units (each phase's row used to re-sum every unit: quadratic).
    assert full_deep[1] < 4.5 * full_small[1]


@pytest.mark.slow
def test_tied_plan_matches_the_full_ilp_where_that_is_optimal():
    # The full ILP proves its optimum here in ~12 s (2 loaded cores); from 8
    # layers on it no longer does in minutes.
    trace = synthetic_trace(SyntheticConfig(num_layers=6))
    plans = {tie: solve(trace, "1.0x-gc", codecs=["bf16", "int8"], buckets=1,
                        options=SolverOptions(time_limit_s=120.0, tie_blocks=tie)) for tie in (False, True)}
    full, tied = ([b for b in plans[tie].buckets if not b.skip][0] for tie in (False, True))
    assert full.solver.status == "optimal" and tied.solver.status == "optimal"
    # Tied plans are plans of the full ILP, so never faster; here none is lost.
    assert tied.time_s == pytest.approx(full.time_s, rel=1e-6)
    assert tied.memory_bytes <= plans[True].budget_bytes
    # Tied layers took one decision each (layers 2-3 share a pattern).
    decided = dict(tied.decisions)
    for key in (k for k in decided if k.startswith("model.layers.2.")):
        assert decided[key] == decided[key.replace("layers.2.", "layers.3.")]


def test_trace_records_classes_and_validation_refuses_unlike_members():
    trace = synthetic_trace(dataclasses.replace(SMALL, num_layers=4))
    classes = find_block_classes(trace.units)
    # Layer 0 reads the embedding, the others the layer before: two classes.
    assert classes == {"c0": (0,), "c1": (1, 2, 3)}
    payload = json.loads(json.dumps({**trace.to_json(), "block_classes": classes}))
    assert trace_from_json(payload).block_classes == classes
    with pytest.raises(FormatError, match="not structurally identical"):
        trace_from_json({**payload, "block_classes": {"c0": [0, 1, 2, 3]}})


def _keys_as_built_in(trace):
    """The synthetic trace keyed as the built-in Llama (``layers.<i>...``), as per-block compiles read it."""
    rename = lambda key: key.replace("model.layers.", "layers.", 1)  # noqa: E731
    units = tuple(dataclasses.replace(u, key=rename(u.key), recompute_from=tuple(map(rename, u.recompute_from)),
                                      read_until=u.read_until and rename(u.read_until)) for u in trace.units)
    return dataclasses.replace(trace, units=units)


def test_per_block_compiles_share_one_backend_per_pattern():
    from hilore_compiler.distributed.blocks import _block_compilers

    layers = 16
    trace = _keys_as_built_in(synthetic_trace(dataclasses.replace(SMALL, num_layers=layers)))
    plan = solve(trace, "1.10x-gc", codecs=["bf16", "int8"], buckets=1, options=SolverOptions(time_limit_s=10.0))
    compilers = _block_compilers(plan, {"verbose": False}, layers)
    # Layers tied to one pattern get one backend (one dynamo graph, one
    # Inductor compile): 16 blocks, at most 1 + 1 + 4 patterns + 1 backends.
    tying = tie_blocks(prepare(trace, codecs=["bf16", "int8"], batch=None, seq_len=None)[1])
    for group in tying.groups:
        assert len({id(compilers[i]) for i in group}) == 1
    assert len({id(c) for c in compilers}) <= layers - sum(len(g) - 1 for g in tying.groups)


def test_progress_speaks_once_per_interval_and_always_last():
    from hilore_compiler.progress import Ticker

    now, said = [0.0], []
    tick = Ticker(said.append, interval_s=3.0, clock=lambda: now[0])
    for i in range(10):  # one unit a second
        now[0] += 1.0
        tick(f"{i + 1}/10", last=i == 9)
    assert said == ["3/10", "6/10", "9/10", "10/10"]
