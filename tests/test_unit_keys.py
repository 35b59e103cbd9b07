"""Unit keys name where in the model an op ran, not where its code lives."""

from __future__ import annotations

import torch
import torch._dynamo
import torch.fx as fx
from torch import nn

from hilore_compiler.passes.annotate import layer_of, module_fqn


class _Rotate(nn.Module):
    """A helper module that lives at module level, outside any model's tree, as
    transformers 5.11+ wraps ``apply_rotary_pos_emb`` for its kernel hub."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


ROTATE = _Rotate()


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ROTATE(self.proj(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _graph(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return graphs[0]


def test_a_module_called_from_outside_the_model_is_keyed_by_the_layer_that_called_it() -> None:
    gm = _graph(_Model(), torch.randn(2, 8))
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    stacks = [[p for p, _ in n.meta["nn_module_stack"].values()] for n in adds]
    assert all(any("ROTATE" in p for p in stack) for stack in stacks), stacks  # the helper is on the stack
    fqns = [module_fqn(n) for n in adds]
    assert [layer_of(f) for f in fqns] == [0, 1], fqns
    assert all(f.endswith(f"layers.{i}") for i, f in enumerate(fqns)), fqns


def test_nested_modules_still_give_the_innermost_path() -> None:
    gm = _graph(_Model(), torch.randn(2, 8))
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert [module_fqn(n).split("layers.", 1)[-1] for n in linears] == ["0.proj", "1.proj"]
