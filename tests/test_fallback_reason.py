"""When a graph cannot be compiled, the warning names the real cause, once."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DataDependentOutputException

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.backend.report import HiLoReWarning


def _graph_reading_a_tensor_value() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.nn.functional.relu, (x,))
    hint = graph.call_function(torch.ops.aten._local_scalar_dense.default, (x,))
    hint.meta["stack_trace"] = '  File "moe.py", line 339, in _grouped_mm\n    sizes = counts.tolist()\n'
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_models_own_data_dependent_code_is_named_and_reraised_for_dynamo(monkeypatch):
    """Transformers' MoE backward reads group sizes with ``.tolist()``: AOTAutograd cannot
    trace it with any partitioner. hilore re-raises what dynamo turns into a graph break
    (as for plain Inductor), and says once that the model's code, not planning, is why."""
    backend = HiLoReBackend({"verbose": False})
    cause = DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

    def fails(gm, example_inputs):
        raise RuntimeError("compile_fx failed") from cause

    monkeypatch.setattr(backend, "_plan_and_compile", fails)
    gm = _graph_reading_a_tensor_value()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            with pytest.raises(RuntimeError, match="compile_fx failed"):
                backend(gm, [torch.randn(2)])
    messages = [str(w.message) for w in said if issubclass(w.category, HiLoReWarning)]
    assert len(messages) == 1, messages
    assert "model's own code reads tensor values" in messages[0] and "_local_scalar_dense" in messages[0]
    assert "moe.py" in messages[0] and "not a planning failure" in messages[0]
    assert "compiling with the plan failed" not in messages[0]
