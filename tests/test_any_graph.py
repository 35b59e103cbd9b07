"""The backend accepts any graph plain Inductor compiles: float inputs, BatchNorm,
graphs that save nothing, graph breaks (a plan per graph, offline and zero config)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.passes.tracer import TraceConfig, trace
from hilore_compiler.solver import solve

CONFIG = TraceConfig(repeats=1, warmup=0, verbose=False, codecs=())


def _grads(model: nn.Module, run, *inputs) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    out = run(*inputs)
    out.float().pow(2).mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _compile_and_compare(model: nn.Module, *inputs, options=None) -> HiLoReBackend:
    """Compile with hilore (warnings are errors: nothing may fall back) and compare
    the gradient with eager's."""
    backend = HiLoReBackend({"codecs": [], "buckets": 1, "verbose": False, **(options or {})})
    reference = _grads(model, model, *inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HiLoReWarning)
        got = _grads(model, torch.compile(model, backend=backend, dynamic=False), *inputs)
    assert _rel(got, reference) < 1e-4
    return backend


class Blocks(nn.Module):
    """Float input, residual MLP blocks in a ModuleList, optionally a graph break half way."""

    def __init__(self, n: int = 2, width: int = 16, graph_break: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(n))
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        half = len(self.blocks) // 2
        x = self._run(x, self.blocks[:half])
        if self.graph_break:  # outside any loop: dynamo splits the frame in two graphs
            torch._dynamo.graph_break()
        return self._run(x, self.blocks[half:])

    @staticmethod
    def _run(x: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        for block in blocks:
            x = x + block(x)
        return x


def test_plain_mlp_plans_with_float_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    backend = _compile_and_compare(model, torch.randn(4, 8), options={"memory_budget": "1.0x-gc"})
    (graph,) = backend.graphs
    assert graph.plan is not None and graph.records[0].units > 0


def test_cnn_with_batchnorm_in_train_mode():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 4, 3, padding=1)).train()
    backend = _compile_and_compare(model, torch.randn(2, 3, 8, 8))
    assert backend.graphs[0].plan is not None


def test_graph_that_saves_nothing_compiles():
    # Backward of x @ w needs only the input x: no activation to plan.
    model = nn.Linear(8, 8, bias=False)
    backend = _compile_and_compare(model, torch.randn(4, 8))
    (graph,) = backend.graphs
    assert graph.plan is None and graph.records[0].units == 0


@pytest.mark.slow
def test_recompute_really_happens_on_a_float_input_model():
    # Below store-all's peak: on blocks this small, with backward freeing the
    # blocks it has finished, store-all fits within GC's own peak.
    torch.manual_seed(0)
    model = Blocks()
    backend = _compile_and_compare(model, torch.randn(2, 8, 16), options={"memory_budget": "0.98x-store"})
    (record,) = backend.graphs[0].records
    assert record.counts["recompute"] > 0
    assert record.saved_bytes < record.default_saved_bytes


@pytest.mark.slow
def test_graph_break_gets_a_plan_per_graph_zero_config():
    torch.manual_seed(0)
    model = Blocks(4, graph_break=True)
    backend = _compile_and_compare(model, torch.randn(2, 8, 16), options={"memory_budget": "0.98x-store"})
    assert len(backend.graphs) == 2
    assert all(g.plan is not None and g.records[0].counts["recompute"] > 0 for g in backend.graphs)


@pytest.mark.slow
def test_graph_break_offline_plan_applies_to_each_graph():
    torch.manual_seed(0)
    model, x = Blocks(4, graph_break=True), torch.randn(2, 8, 16)
    with pytest.warns(UserWarning, match="2 graphs"):
        traced = trace(model, [x], config=CONFIG)
    assert any(u.key.startswith("g1/") for u in traced.units)
    plan = solve(traced, budget="1.0x-gc", buckets=1, codecs=[], batch=2, seq_len=8)
    backend = _compile_and_compare(model, x, options={"plan": plan})
    assert len(backend.graphs) == 2
    for graph in backend.graphs:
        (record,) = graph.records
        assert record.matched == record.units > 0  # every unit of each graph had a decision


class Rotary(nn.Module):
    """A rotary embedding computed in forward (cos and sin of a position table,
    as Llama's is) whose output only pointwise ops and a matmul read."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        h = self.inp(x)
        t = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
        angle = t * 10000.0 ** (-torch.arange(x.shape[2], dtype=torch.float32) / x.shape[2])  # (T, C)
        y = h * angle.cos() + h.flip(-1) * angle.sin()
        k = y[:, :, None].expand(-1, -1, 2, -1).reshape(x.shape[0], x.shape[1], -1)  # (B, T, 2C), as GQA's repeat
        return self.out(k * k)


@pytest.mark.slow
def test_encode_reads_its_value_instead_of_computing_it_again():
    """An int8 encode reads its input twice (absmax, quantize); Inductor would
    inline a pointwise root into both loops, evaluating the rotary's sin three
    times per element (``apply._realized``). The forward code of a plan that
    compresses every unit evaluates sin as often as one that stores them."""
    from torch._inductor.utils import run_and_get_code

    from hilore_compiler.solver import fixed_plan
    from hilore_compiler.solver.fixed import uniform_codec

    torch.manual_seed(0)
    model, x = Rotary(), torch.randn(2, 64, 32)
    traced = trace(model, [x], config=TraceConfig(repeats=1, warmup=0, verbose=False, codecs=("int8",)))
    sines = {}
    for codec in (None, "int8"):
        plan = fixed_plan(traced, uniform_codec(codec), buckets=1, codecs=["int8"])
        compiled = torch.compile(model, backend=HiLoReBackend({"plan": plan, "verbose": False}), dynamic=False)
        torch._dynamo.reset()
        _, (forward, *_) = run_and_get_code(lambda: compiled(x).sum().backward())
        assert ("int8_t" in forward) == (codec is not None)
        sines[codec] = forward.count("sin(")
    assert sines["int8"] == sines[None] > 0, sines


@torch.library.custom_op("hilore_test::exp_with_seed", mutates_args=())
def exp_with_seed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(x), and a 0-dim integer its backward reads, as CUDA's fused
    attention returns a philox seed beside its output."""
    return x.exp(), torch.tensor(3, dtype=torch.int64)


@exp_with_seed.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((), dtype=torch.int64)


@torch.library.custom_op("hilore_test::exp_with_seed_backward", mutates_args=())
def exp_with_seed_backward(grad: torch.Tensor, y: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """One opaque op that reads the seed, as attention's backward kernel does:
    the partitioner cannot fold the seed into a forward value instead."""
    return grad * y * (seed > 0)


@exp_with_seed_backward.register_fake
def _(grad: torch.Tensor, y: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


def _exp_backward(ctx, grad: torch.Tensor, _seed_grad: torch.Tensor) -> torch.Tensor:
    y, seed = ctx.saved_tensors
    return exp_with_seed_backward(grad, y, seed)


torch.library.register_autograd("hilore_test::exp_with_seed", _exp_backward,
                                setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*output))


class SeededExp(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = exp_with_seed(self.inp(x).tanh())
        return self.out(y)


def test_a_unit_with_an_integer_member_is_compressed_and_keeps_that_member_as_it_is():
    """One op saves a float output and an integer scalar: the output is encoded,
    the scalar kept (``UnitNodes.kept_as_is``). Before, any integer member left
    the unit without codecs: on CUDA, every attention unit."""
    from hilore_compiler.sizeexpr import eval_size
    from hilore_compiler.solver import fixed_plan
    from hilore_compiler.solver.fixed import uniform_codec

    torch.manual_seed(0)
    model, x = SeededExp(), torch.randn(2, 64, 32)
    traced = trace(model, [x], config=TraceConfig(repeats=1, warmup=0, verbose=False, codecs=("int8",)))
    (unit,) = [u for u in traced.units if "exp_with_seed" in u.key]
    int8 = unit.codecs["int8"]
    assert int8.usable and 0 < int8.rel_l2 < 0.02
    # The payload: a quarter of the fp32 output plus row scales, plus the 8-byte seed.
    payload = eval_size(int8.bytes, traced.batch, traced.seq_len)
    assert unit.bytes_at_trace / 4 < payload < unit.bytes_at_trace / 2
    plan = fixed_plan(traced, uniform_codec("int8"), buckets=1, codecs=["int8"])
    backend = HiLoReBackend({"plan": plan, "strict": True, "verbose": False})
    reference = _grads(model, model, x)
    got = _grads(model, torch.compile(model, backend=backend, dynamic=False), x)
    assert 0 < _rel(got, reference) < 0.02  # int8 changed the gradient, a little
    (graph,) = backend.graphs
    assert graph.records[0].counts["compress"] == len(traced.units)
    assert graph.actual_saved_bytes("b0") == pytest.approx(graph.predicted_saved_bytes("b0"), rel=0.02)

