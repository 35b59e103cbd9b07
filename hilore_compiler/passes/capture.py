"""Capture: the AOT joint graph Inductor's partitioner receives, and what min-cut saves.

The joint graph is taken from inside Inductor itself: ``compile_fx`` runs
with a custom partitioner that records the joint graph it is handed (after
Inductor's decompositions and joint-graph passes, on every device) and then
stops the compile before any code generation. The backend plans on the same
object in the same place, so the units a trace names are the units a compile
sees. The forward values that profiling re-runs regions on are recorded
while the joint graph is at hand (``values.py``).

Models on the meta device (roofline traces of big models) cannot go through
Inductor, whose joint passes fold a meta graph away; they are captured with
an AOTAutograd backend that uses Inductor's decompositions only.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from .values import record_forward_values


@dataclass(slots=True)
class GraphCapture:
    """One dynamo graph's joint graph, its default partition and forward values."""

    index: int
    joint: fx.GraphModule
    fw: fx.GraphModule
    bw: fx.GraphModule
    #: Names of forward nodes the default min-cut partition saves for backward.
    saved_names: set[str]
    #: Forward node name -> value from a real run of the forward graph (saved
    #: values, their storage, views and graph inputs: enough to re-run any
    #: recompute region).
    values: dict[str, Any] = field(default_factory=dict)
    #: True when the joint graph's inputs could not be matched to the real
    #: ones and values come from random inputs of the right shapes.
    synthetic_values: bool = False


def merge_duplicates(joint: fx.GraphModule) -> fx.GraphModule:
    """Merge ``joint``'s duplicate nodes in place, as min-cut does before it partitions.

    Units must be found on the graph min-cut partitions. A Hugging Face
    Llama builds its attention mask once per layer in the joint graph (``where``
    and ``where_1``); min-cut merges them into one tensor that every layer's
    attention backward reads. Unmerged, the mask looked like layer 0's alone
    (needed only through layer 0's backward) and like something layer 1
    rebuilt for itself, so a plan recomputing it was predicted 10% under its
    measured peak (``tests/test_dynamic_hf.py``). Node names and meta are kept.
    """
    joint.graph.eliminate_dead_code()
    if functorch_config.cse:
        joint.graph = fx_graph_cse(joint.graph)
    joint.recompile()
    return joint


def saved_output_names(fw: fx.GraphModule, num_fwd_outputs: int) -> set[str]:
    """Names of the forward graph's outputs that backward reads."""
    outputs = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    return {o.name for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node)}


def light_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph over the same module: parameters, buffers and
    constants are shared, never copied.

    ``copy.deepcopy`` would copy the tensor constants a joint graph holds
    (Hugging Face cache code leaves real ``_tensor_constant`` tensors there),
    which fails under Inductor's fake mode, and would give a dynamo graph
    copies of parameters FSDP later frees or the optimizer never updates.
    Passes only rewrite the graph, so a new graph is all they need.
    """
    graph = fx.Graph()
    output, output_node = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(output).meta = dict(output_node.meta)
    copied = fx.GraphModule(gm, graph)
    copied.meta = dict(getattr(gm, "meta", {}))
    return copied


def default_partition(joint: fx.GraphModule, joint_inputs: Sequence[object],
                      **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule, set[str]]:
    """Inductor's own min-cut partition of ``joint`` (left untouched) and its saved names."""
    fw, bw = min_cut_rematerialization_partition(light_copy(joint), joint_inputs, **kwargs)
    return fw, bw, saved_output_names(fw, kwargs["num_fwd_outputs"])


def capture_joint(joint: fx.GraphModule, joint_inputs: Sequence[object], real_args: Sequence[object] | None,
                  *, index: int = 0, record_values: bool = True, merged: bool = False, **kwargs: Any) -> GraphCapture:
    """The default partition of ``joint`` (its duplicates merged in place: ``merge_duplicates``,
    unless the caller has, ``merged``) and, with ``record_values``, its forward values."""
    if not merged:  # 1.4 s on a 24-layer Qwen2.5-0.5B: not twice
        merge_duplicates(joint)
    fw, bw, saved = default_partition(joint, joint_inputs, **kwargs)
    capture = GraphCapture(index, joint, fw, bw, saved)
    if record_values:
        capture.values, capture.synthetic_values = record_forward_values(joint, joint_inputs, real_args, saved)
    return capture


class CaptureDone(Exception):
    """Raised by ``RecordingPartitioner`` to stop a compile once the graph is captured."""


class _UncachedPartitioner(CustomPartitionerFn):
    """A partitioner that runs for what it sees, not for a graph: Inductor must
    neither serve a cached compile in its place nor copy or pickle what it holds."""

    def __deepcopy__(self, memo: dict) -> _UncachedPartitioner:
        # Inductor deep-copies its config to key caches; this holds fake tensors or a recorder.
        return self

    def uuid(self) -> None:
        return None  # never cache: the point is to run

    def __reduce__(self) -> tuple:
        # Inductor pickles its config into cache keys: not the real tensors held here.
        return str, (f"hilore-{type(self).__name__}",)


class RecordingPartitioner(_UncachedPartitioner):
    """Records the joint graph Inductor hands its partitioner, then stops the compile."""

    def __init__(self, captures: list[GraphCapture], real_args: Sequence[object] | None, record_values: bool):
        self.captures, self.real_args, self.record_values = captures, real_args, record_values

    def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        self.captures.append(capture_joint(joint, joint_inputs, self.real_args, index=len(self.captures),
                                           record_values=self.record_values, **kwargs))
        raise CaptureDone


def lifted_args(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """What AOTAutograd calls the graph with: parameters and buffers it lifts
    from ``gm`` (none when dynamo inlines modules), then the graph's inputs."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    buffers = dict(gm.named_buffers(remove_duplicate=False))
    return [*params.values(), *buffers.values(), *example_inputs]


def needs_backward(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """True when some input AOTAutograd passes (parameters included) requires grad:
    only then is there a backward, and so activations to plan."""
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in lifted_args(gm, example_inputs))


def capture_with_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], captures: list[GraphCapture],
                          record_values: bool = True) -> None:
    """Append ``gm``'s joint graph as Inductor's partitioner sees it to ``captures``.

    ``gm`` itself is not changed (Inductor works on a copy) and no code is
    generated: the compile stops inside the partitioner.
    """
    from torch._inductor.compile_fx import compile_fx

    partitioner = RecordingPartitioner(captures, lifted_args(gm, example_inputs), record_values)
    try:
        compile_fx(light_copy(gm), list(example_inputs), config_patches={"custom_partitioner_fn": partitioner})
    except CaptureDone:
        return
    raise RuntimeError("Inductor compiled the graph without partitioning it: it has no backward pass")


def inductor_partition(recorder: Callable) -> Callable:
    """``recorder`` behind Inductor's partition entry point (joint-graph passes
    first, as under compile_fx), when this torch has the override hook."""
    from torch._inductor import compile_fx as inductor_compile_fx
    from torch._inductor import config as inductor_config

    partition_fn = getattr(inductor_compile_fx, "partition_fn", None)
    if partition_fn is None:
        # No entry point to run the joint passes through: the joint graph then
        # lacks them, which changes only which cheap ops min-cut may recompute.
        return recorder
    from torch._guards import detect_fake_mode
    from torch._inductor.virtualized import V

    overridable = "partitioner_fn_override" in inspect.signature(partition_fn).parameters

    def with_joint_passes(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        # Inductor's joint passes (the RNG seed pass among them) read the
        # fake mode from V, which compile_fx sets and we must set too.
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            if overridable:
                return partition_fn(joint, joint_inputs, partitioner_fn_override=recorder, **kwargs)
            # torch < 2.13 has no override, but runs the joint passes and then
            # the configured custom partitioner: the same graph reaches ``recorder``.
            with inductor_config.patch(custom_partitioner_fn=_Forwarding(recorder)):
                return partition_fn(joint, joint_inputs, **kwargs)

    return with_joint_passes


class _Forwarding(_UncachedPartitioner):
    """``recorder`` as Inductor's configured custom partitioner (``inductor_partition``)."""

    def __init__(self, recorder: Callable) -> None:
        self.recorder = recorder

    def __call__(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        kwargs.pop("compiler", None)  # partition_fn names Inductor; the recorder's caller chose already
        return self.recorder(joint, joint_inputs, **kwargs)


def _meta_backend(captures: list[GraphCapture]) -> Callable:
    """An AOTAutograd backend that records joint graphs of a meta-device model.

    Inductor's joint passes fold a meta graph away (every value is
    "uninitialised" there), so only its decompositions and the passes that
    change what the partitioner sees run: canonicalisation and the removal of
    no-op ops. Without the latter, a LoRA layer's attention output, which the
    frozen ``o_proj`` keeps only through a backward ``aten.alias``, was missing
    from the meta trace while the compiled graph saved it. Nothing runs.
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._inductor.fx_passes.joint_graph import canonicalize_aten_ir_passes
        from torch._inductor.fx_passes.post_grad import remove_noop_ops

        canonicalize_aten_ir_passes(joint)
        remove_noop_ops(joint.graph)
        joint.recompile()
        # Values: the tracer's meta stand-ins (``values.meta_values``), enough for roofline costs.
        capture = capture_joint(joint, joint_inputs, None, index=len(captures), record_values=False,
                                compiler="inductor", **kwargs)
        captures.append(capture)
        return capture.fw, capture.bw

    return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g),
                        partition_fn=partition, decompositions=select_decomp_table())


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
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    dynamic: bool = True,
    record_values: bool = True,
    example_kwargs: Mapping[str, Any] | None = None,
) -> list[GraphCapture]:
    """Compile ``model`` far enough to capture each graph's joint graph; run it eagerly.

    ``model`` is called as ``model(*example_inputs, **example_kwargs)``. With
    ``dynamic``, dimensions 0 and 1 of the first tensor input (batch,
    sequence) are marked dynamic so saved sizes come out as symbolic
    expressions. The joint graph does not depend on the loss: ``loss_fn`` is
    accepted for callers that pass one and is not run.
    """
    kwargs = dict(example_kwargs or {})
    check_trainable(model, [*example_inputs, *kwargs.values()])
    captures: list[GraphCapture] = []
    if dynamic:
        # mark_dynamic sticks to the tensor: mark a copy, not the caller's.
        example_inputs, kwargs = _mark_first_dynamic(list(example_inputs), kwargs)
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    on_meta = any(isinstance(x, torch.Tensor) and x.device.type == "meta"
                  for x in [*example_inputs, *kwargs.values()])

    def recording_backend(gm: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        if needs_backward(gm, inputs):
            capture_with_inductor(gm, inputs, captures, record_values)
        return gm.forward

    backend = _meta_backend(captures) if on_meta else recording_backend

    # Compile a wrapper, not the model: dynamo remembers per code object
    # which dims it saw dynamic, and a later torch.compile(model) would
    # otherwise start dynamic too.
    def traced(*args: Any, **kw: Any) -> Any:
        return model(*args, **kw)

    from .gpu_lowering import lowered_as_gpu

    # Meta and fake CUDA tensors lower attention as a GPU does; real ones as their device does.
    with lowered_as_gpu():
        torch.compile(fresh_code(traced), backend=backend)(*example_inputs, **kwargs)
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


def fresh_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own.

    Dynamo caches compiled frames per code object and stops compiling one
    after ``recompile_limit`` entries: a wrapper defined once and compiled for
    every trace in a process would silently stop being captured.
    """
    fn.__code__ = fn.__code__.replace()
    return fn


def _mark_first_dynamic(args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Copies of the inputs with the first tensor's batch and sequence dims dynamic.

    Other inputs of the same leading sizes (an attention mask beside the
    token ids) are marked too, or the model's comparisons between them would
    specialise the sizes; ``maybe_mark_dynamic`` lets code that really needs
    a constant size specialise it instead of failing.
    """
    slots = [*((args, i) for i in range(len(args))), *((kwargs, k) for k in kwargs)]
    tensors = [(c, k) for c, k in slots if isinstance(c[k], torch.Tensor)]
    if not tensors:
        return args, kwargs
    container, key = tensors[0]
    lead = tuple(container[key].shape[:2])
    for i, (container, key) in enumerate(tensors):
        value = container[key]
        if i == 0 or tuple(value.shape[:2]) == lead:
            # mark_dynamic sticks to the tensor: mark a copy, not the caller's.
            container[key] = value = value.clone()
            for dim in range(len(lead)):
                torch._dynamo.maybe_mark_dynamic(value, dim)
    return args, kwargs


def capture_graph_module(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> GraphCapture:
    """Capture one dynamo graph inside a backend, as Inductor would partition it."""
    captures: list[GraphCapture] = []
    capture_with_inductor(gm, example_inputs, captures)
    return captures[0]
