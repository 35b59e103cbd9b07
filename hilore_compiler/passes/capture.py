"""Capture: the AOT joint graphs torch.compile builds, and what min-cut saves.

The model is compiled with a recording AOTAutograd backend that uses
Inductor's decompositions and joint-graph passes, so the joint graph is the
one Inductor's partitioner would receive. Its forward and backward
"compilers" run the graphs as they are (no Inductor codegen), which keeps
tracing cheap and works on the meta device.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


@dataclass(slots=True)
class GraphCapture:
    """One dynamo graph's joint graph, its default partition and forward values."""

    index: int
    joint: fx.GraphModule
    fw: fx.GraphModule
    bw: fx.GraphModule
    #: Names of forward nodes the default min-cut partition saves for backward.
    saved_names: set[str]
    #: Forward node name -> value from the first real call (saved values, views
    #: and graph inputs only: enough to re-run any recompute region).
    values: dict[str, Any] = field(default_factory=dict)


def saved_output_names(fw: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """Names of the forward graph's outputs that backward reads."""
    outputs = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    return {o.name for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node)}


class _ValueRecorder(fx.Interpreter):
    """Runs the forward graph once and keeps the values named in ``keep``."""

    def __init__(self, gm: fx.GraphModule, keep: set[str], store: dict[str, Any]):
        super().__init__(gm)
        self.keep, self.store = keep, store

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        # Views cost no memory and let a region read "another view of a saved value".
        is_view = isinstance(n.target, torch._ops.OpOverload) and n.target.is_view
        if n.op == "placeholder" or n.name in self.keep or is_view:
            self.store[n.name] = out.detach() if isinstance(out, torch.Tensor) else out
        return out


def inductor_partition(recorder: Callable) -> Callable:
    """``recorder`` behind Inductor's partition entry point (joint-graph passes
    first, as under compile_fx), when this torch has the override hook."""
    from torch._inductor import compile_fx as inductor_compile_fx

    partition_fn = getattr(inductor_compile_fx, "partition_fn", None)
    if partition_fn is not None and "partitioner_fn_override" in inspect.signature(partition_fn).parameters:
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        def with_joint_passes(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            # Inductor's joint passes (the RNG seed pass among them) read the
            # fake mode from V, which compile_fx sets and we must set too.
            with V.set_fake_mode(detect_fake_mode(joint_inputs)):
                return partition_fn(joint, joint_inputs, partitioner_fn_override=recorder, **kwargs)

        return with_joint_passes
    # Older torch: no override hook; the joint graph then lacks Inductor's
    # joint passes, which changes only which cheap ops min-cut may recompute.
    return recorder


def _recording_backend(captures: list[GraphCapture], record_values: bool, joint_passes: bool = True) -> Callable:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, compiler="inductor", **kwargs)
        saved = saved_output_names(fw, kwargs["num_fwd_outputs"])
        captures.append(GraphCapture(len(captures), joint, fw, bw, saved))
        return fw, bw

    def fw_compiler(gm: fx.GraphModule, example_inputs: Sequence[object]):
        capture = captures[-1]

        def run(*args: Any) -> Any:
            if record_values and not capture.values:
                return _ValueRecorder(gm, capture.saved_names, capture.values).run(*args)
            return gm(*args)

        # AOTAutograd calls compiled graphs with one list of arguments.
        return make_boxed_func(run)

    def bw_compiler(gm: fx.GraphModule, example_inputs: Sequence[object]):
        return make_boxed_func(gm)

    return aot_autograd(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        # Inductor's joint passes fold a meta-device graph away (every value is
        # "uninitialised" there), so models on meta skip them.
        partition_fn=inductor_partition(partition) if joint_passes else partition,
        decompositions=select_decomp_table(),
    )


def check_trainable(model: torch.nn.Module, example_inputs: Sequence[Any]) -> None:
    """Raise a clear error when there is no backward pass to plan for."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            "hilore traces the backward pass, but grad mode is off: "
            "call trace() outside torch.no_grad() / torch.inference_mode()"
        )
    inputs_need_grad = any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
    if not inputs_need_grad and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            "nothing in the model requires grad, so backward saves no activations: "
            "enable requires_grad on the parameters you train"
        )


def capture_joint_graphs(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    dynamic: bool = True,
    record_values: bool = True,
) -> list[GraphCapture]:
    """Compile ``model`` with a recording backend, run forward+loss+backward once.

    With ``dynamic``, dimensions 0 and 1 of the first input (batch, sequence)
    are marked dynamic so saved sizes come out as symbolic expressions.
    """
    check_trainable(model, example_inputs)
    captures: list[GraphCapture] = []
    if dynamic:
        # mark_dynamic sticks to the tensor: mark a copy, not the caller's.
        first = example_inputs[0].clone()
        for dim in range(min(2, first.dim())):
            torch._dynamo.mark_dynamic(first, dim)
        example_inputs = [first, *example_inputs[1:]]
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    on_meta = any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in example_inputs)
    backend = _recording_backend(captures, record_values, joint_passes=not on_meta)
    # Compile a wrapper, not the model: dynamo remembers per code object
    # which dims it saw dynamic, and a later torch.compile(model) would
    # otherwise start dynamic too.
    def traced(*args: Any) -> Any:
        return model(*args)

    compiled = torch.compile(traced, backend=backend)
    # The traced backward must leave no trace: restore the caller's grads.
    grads = {p: p.grad for p in model.parameters()}
    out = compiled(*example_inputs)
    loss_fn(out).backward()
    for param, grad in grads.items():
        param.grad = grad
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before
    if breaks or len(captures) > 1:
        reasons = list(torch._dynamo.utils.counters["graph_break"])[-max(breaks, 1):]
        warnings.warn(
            f"the model has {len(captures)} graphs ({breaks} graph breaks: {reasons}); "
            "each graph is traced and planned on its own",
            stacklevel=2,
        )
    if not captures:
        raise RuntimeError("torch.compile produced no training graph for this model")
    return captures


def capture_graph_module(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> GraphCapture:
    """Capture one dynamo graph inside a backend (no nested torch.compile).

    The partition happens when the forward is compiled and the values are
    recorded by the forward run, so no backward is run here (running one
    inside dynamo's compile would also clash with its compile metrics).
    """
    captures: list[GraphCapture] = []
    compiled = _recording_backend(captures, record_values=True)(gm, list(example_inputs))
    with torch.enable_grad():
        compiled(*example_inputs)
    if not captures:
        raise RuntimeError("the graph has no backward pass: nothing to plan")
    return captures[0]
