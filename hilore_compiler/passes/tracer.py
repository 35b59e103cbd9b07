"""The tracer: model -> recovery units with measured costs -> ``Trace``.

Runs the first half of the pipeline: capture the joint graph torch.compile
builds, annotate its saved activations as recovery units, profile each unit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .annotate import UnitNodes, annotate_units, is_backward, layer_of, module_fqn
from .capture import GraphCapture, capture_joint_graphs
from .allocator import default_allocator
from .classes import profile_by_class, unit_classes
from .depth import DepthError, DepthMap, extend_by_layer, extend_classes, extend_units
from .profile import ProfileConfig, profile_unit
from .sizes import largest, nbytes_expr, shape_symbols, size_hint, total_nbytes
from .values import meta_values
from ..progress import Ticker
from ..sizeexpr import format_size
from ..tracefile import TIED_PARTIALS, RecoveryUnit, Trace, eval_size, parse_size
from ..solver.rounding import round_measured_costs
from ..vocabulary import DEFAULT_CODECS, group_of
from ..progress import tell


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceConfig:
    """Options of ``trace``."""

    #: ``"measured"`` or ``"roofline:h100"`` / ``"roofline:h200"`` / ``"roofline:a100"``.
    cost_model: str = "measured"
    #: The codecs profiled: the backend's and every command's default (``vocabulary``).
    codecs: tuple[str, ...] = DEFAULT_CODECS
    warmup: int = 1
    repeats: int = 5
    #: Name recorded in the trace (e.g. the built-in model's name).
    model_name: str = "model"
    #: Print progress to stderr.
    verbose: bool = True
    #: Trace with the batch and sequence dims symbolic (sizes as expressions
    #: of B and S, plannable at any shape). False traces the exact graph a
    #: ``dynamic=False`` compile at this shape makes.
    dynamic: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: The model given is the first ``depth.CAPTURED_LAYERS`` layers of a stack
    #: of this many: the trace is extended to them (``depth.py``). None: the model as given.
    full_layers: int | None = None


def default_loss(out: Any) -> torch.Tensor:
    """A loss for tracing when none is given: mean of squares of the first output."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.float().pow(2).mean()


def _progress(config: TraceConfig) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if config.verbose:
            tell(f"hilore trace: {msg}")
    return say


def gc_boundary_by_layer(joint: fx.GraphModule, symbols) -> dict[int, sympy.Expr]:
    """Bytes GC keeps at each layer's entry: the tensors made outside a layer that its
    forward reads (its input hidden state), each counted once, at the first layer that reads it
    (so what all layers share, rotary tables or a mask, counts at layer 0)."""
    boundary: dict[fx.Node, tuple[int, sympy.Expr]] = {}
    for node in joint.graph.nodes:
        layer = layer_of(module_fqn(node))
        if node.op != "call_function" or is_backward(node) or layer is None:
            continue
        for arg in node.all_input_nodes:
            if arg.op != "placeholder" and layer_of(module_fqn(arg)) != layer and isinstance(arg.meta.get("val"), torch.Tensor):
                if arg not in boundary or layer < boundary[arg][0]:
                    boundary[arg] = (layer, nbytes_expr(arg, symbols))
    by_layer: dict[int, sympy.Expr] = {}
    for layer, nbytes in boundary.values():
        by_layer[layer] = by_layer.get(layer, sympy.Integer(0)) + nbytes
    return by_layer


def gc_bytes_expr(joint: fx.GraphModule, units: list[UnitNodes], symbols, batch: int, seq_len: int,
                  boundary: Mapping[int, sympy.Expr] | None = None) -> sympy.Expr:
    """Activation bytes of per-layer gradient checkpointing at this graph.

    GC keeps each layer's inputs (``boundary``: ``gc_boundary_by_layer``'s,
    by default of this graph), everything saved outside the layer stack,
    and during backward one layer's recomputed activations at a time (the
    caller adds the largest recompute workspace, known after profiling).
    """
    if boundary is None:
        boundary = gc_boundary_by_layer(joint, symbols)
    outside = [u for u in units if u.layer is None]
    per_layer: dict[int, sympy.Expr] = {}
    for u in units:
        if u.layer is not None:
            per_layer[u.layer] = per_layer.get(u.layer, 0) + total_nbytes(u.saved, symbols)
    outside_bytes = total_nbytes((n for u in outside for n in u.saved), symbols)
    total = sum(boundary.values(), sympy.Integer(0)) + outside_bytes
    return sympy.expand(total + largest(per_layer.values(), batch, seq_len))


def output_bytes_expr(joint: fx.GraphModule, symbols) -> sympy.Expr:
    """Bytes of the graph's outputs that backward differentiates: the tangents' sizes.

    The caller holds these outputs (the logits) until backward, and backward
    starts from their gradient, so both count in the step's peak (``memory.py``).
    """
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")
                and isinstance(n.meta.get("val"), torch.Tensor)]
    return total_nbytes(tangents, symbols)


def output_dtype(joint: fx.GraphModule, batch: int, seq_len: int) -> str:
    """The dtype of the graph's logits, which a loss after the graph reads
    (``solver.lossmodel``), as ``str(torch.dtype)`` without ``torch.``; "" when
    the graph has none: no differentiated output, or one no wider than a
    hidden state the graph takes in (a block compiled alone, whose output
    the next block reads, not a loss)."""
    floats = [(n.name, n.meta["val"]) for n in joint.graph.nodes if n.op == "placeholder"
              and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()]
    tangents = [v for name, v in floats if name.startswith("tangents")]
    if not tangents:
        return ""
    largest = max(tangents, key=lambda v: size_hint(v.numel()) * v.element_size())
    hidden = [size_hint(v.shape[-1]) for name, v in floats if not name.startswith("tangents")
              and v.dim() >= 2 and tuple(size_hint(d) for d in v.shape[:2]) == (batch, seq_len)]
    if largest.dim() == 0 or size_hint(largest.shape[-1]) <= max(hidden, default=0):
        return ""
    return str(largest.dtype).removeprefix("torch.")


def trained_parameters(joint: fx.GraphModule, symbols, batch: int,
                       seq_len: int) -> list[tuple[str, int, int]]:
    """(backward segment, bytes, forward ops reading it) of each trained parameter.

    The bytes are its gradient's too: the trace's ``param_bytes`` sums them
    per segment. A parameter several ops read has its gradient summed from
    one partial per reader, each a tensor of its size alive beside the sum
    (an lm_head read by every log-prob chunk): ``partial_grad_bytes`` keeps
    the largest such per segment.

    A parameter belongs to the layer of the op that reads it: parameter
    placeholders carry no module path of their own. Outside the layer stack,
    parameters read before the first layer (the embedding) form the segment
    ``inputs``: backward makes their gradients last, not with the head's.
    A parameter read in several segments (an embedding tied to the lm_head)
    belongs to the one backward meets first, its last reader's, and is
    listed a second time under ``TIED_PARTIALS``: the partial gradient made
    there is still alive when the first reader's is added to it, at the end
    of backward (measured on Qwen2.5-0.5B's widths, 4 layers: the tied
    embedding's second 545 MB was the 28% the model missed). Readers are
    counted through views (``weight.t()``).
    """
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    first_layer = min((order[n] for n in joint.graph.nodes if n.op == "call_function" and not is_backward(n)
                       and layer_of(module_fqn(n)) is not None), default=len(order))
    # The joint graph returns (*forward outputs, *one gradient per primal input);
    # a primal with a gradient is a trained parameter (or a differentiable input).
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    outputs = next(n for n in reversed(joint.graph.nodes) if n.op == "output").args[0]
    grads = list(outputs)[-len(primals):] if primals else []
    found = []
    for node, grad in zip(primals, grads):
        val = node.meta.get("val")
        if grad is None or not isinstance(val, torch.Tensor):
            continue
        if val.dim() >= 2 and tuple(size_hint(d) for d in val.shape[:2]) == (batch, seq_len):
            continue  # shaped like the batch: an activation input (a block's hidden state), not a weight
        readers = sorted(_forward_readers(node), key=order.__getitem__)
        segments = {_segment_of(r, order, first_layer) for r in readers}
        nbytes = int(eval_size(nbytes_expr(node, symbols), batch, seq_len))
        if len(segments) > 1:
            # Read in several segments (an embedding tied to the lm_head):
            # backward meets the last reader first and makes a partial
            # gradient there, alive until the first reader's partial is
            # added to it at the end of backward.
            found.append((_segment_of(readers[-1], order, first_layer), nbytes, 1))
            found.append((TIED_PARTIALS, nbytes, 1))
        else:
            found.append((_segment_of(readers[0], order, first_layer) if readers else group_of(None), nbytes,
                          len(readers)))
    return found


def _segment_of(reader: fx.Node, order: Mapping[fx.Node, int], first_layer: int) -> str:
    """The backward segment of a forward op reading a parameter (``trained_parameters``)."""
    layer = layer_of(module_fqn(reader))
    return "inputs" if layer is None and order[reader] < first_layer else group_of(layer)


def _forward_readers(node: fx.Node) -> list[fx.Node]:
    """The forward ops that read ``node``, looking through view ops."""
    readers = []
    for user in node.users:
        if user.op != "call_function" or is_backward(user):
            continue
        if isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
            readers += _forward_readers(user)
        else:
            readers.append(user)
    return readers


def fingerprint(units: Iterable[tuple[str, str, str]], graphs: Iterable[fx.Graph], salt: str = "") -> str:
    """Hash of what identifies a model graph: (key, kind, dtype) of every unit
    and the shapes of the trained parameters; not the batch or sequence size.
    ``salt`` names how the units were made when not from these graphs alone
    (a depth extension)."""
    h = hashlib.sha256(salt.encode())
    for key, kind, dtype in sorted(units):
        h.update(f"{key}|{kind}|{dtype}\n".encode())
    for graph in graphs:
        for node in graph.nodes:
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.requires_grad:
                h.update(f"{tuple(val.shape)}|{val.dtype}\n".encode())
    return h.hexdigest()[:16]


def trace(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    config: TraceConfig = TraceConfig(),
    example_kwargs: Mapping[str, Any] | None = None,
) -> Trace:
    """Profile ``model`` on ``example_inputs`` into a ``Trace``.

    ``model`` is called as ``model(*example_inputs, **example_kwargs)``. The
    first two dimensions of the first tensor input (token ids, or hidden
    states for a single block) become the symbols ``B`` and ``S`` of every size in
    the trace. The joint graph does not depend on the loss, so ``loss_fn`` is
    not needed (accepted for callers that pass one).
    """
    say = _progress(config)
    start = time.perf_counter()
    lead = _first_tensor(example_inputs, example_kwargs)
    if config.dynamic and lead is not None and lead.dim() >= 1 and lead.shape[0] == 1:
        # Dynamo specialises a size-1 dim to the constant 1, so a batch-1
        # trace would read ``1024*S`` and plan batch 2 at half its bytes.
        example_inputs, example_kwargs = _doubled(example_inputs), _doubled(example_kwargs or {})
        config = dataclasses.replace(config, notes=config.notes + (
            "traced at batch 2 from a batch-1 example: a size-1 batch would be specialised and lose B",))
        say("batch 1 doubled to 2 so that sizes keep the batch symbol B")
    # Roofline costs read shapes alone (``values.meta_values``): nothing is run.
    captures = capture_joint_graphs(model, example_inputs, loss_fn or default_loss, dynamic=config.dynamic,
                                    example_kwargs=example_kwargs, record_values=config.cost_model == "measured")
    say(f"captured {len(captures)} graph(s) in {time.perf_counter() - start:.1f}s")
    shape = tuple(_first_tensor(example_inputs, example_kwargs).shape)
    batch, seq_len = (shape + (1, 1))[:2]
    result = dataclasses.replace(trace_captures(captures, int(batch), int(seq_len), config),
                                 frozen_param_bytes=frozen_parameter_bytes(model))
    say(f"{len(result.units)} recovery units, done in {time.perf_counter() - start:.1f}s")
    return result


def frozen_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters that train nothing (``requires_grad`` off: a LoRA
    model's base weights); a tied weight counts once, as ``parameters()`` yields it once."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _first_tensor(inputs: Sequence[Any], kwargs: Mapping[str, Any] | None) -> torch.Tensor | None:
    """The first tensor among the inputs, then the keyword inputs: its dims are B and S."""
    return next((x for x in [*inputs, *(kwargs or {}).values()] if isinstance(x, torch.Tensor)), None)


def _doubled(values: Any) -> Any:
    """Tensors with a leading size of 1 (the batch) repeated to 2; the rest unchanged."""
    def double(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == 1:
            return torch.cat([x, x]).detach().requires_grad_(x.requires_grad)
        return x
    if isinstance(values, Mapping):
        return {k: double(v) for k, v in values.items()}
    return type(values)(double(v) for v in values) if isinstance(values, (list, tuple)) else values


def trace_captures(captures: Sequence[GraphCapture], batch: int, seq_len: int, config: TraceConfig) -> Trace:
    """Annotate and profile captured graphs (the tracer's second half).

    With ``config.full_layers`` the one captured graph is of a cut stack, and
    the trace is extended to the full one (``depth.py``); ``DepthError`` when it cannot be.
    """
    say = _progress(config)
    depth = None if config.full_layers is None else DepthMap(config.full_layers)
    if depth is not None and len(captures) != 1:
        raise DepthError(f"the cut model made {len(captures)} graphs; a depth extension needs one")
    profile_config = ProfileConfig(cost_model=config.cost_model, warmup=config.warmup,
                                   repeats=config.repeats, codecs=config.codecs,
                                   batch=batch, seq_len=seq_len)
    units: list[RecoveryUnit] = []
    gc_total, store_total, output_total = sympy.Integer(0), sympy.Integer(0), sympy.Integer(0)
    param_bytes: dict[str, int] = {}
    partial_grad_bytes: dict[str, int] = {}
    block_classes: dict[str, tuple[int, ...]] = {}
    dtypes: list[str] = []
    for capture in captures:
        symbols = shape_symbols(capture.joint.graph)
        prefix = f"g{capture.index}/" if capture.index else ""
        graph_units = annotate_units(capture.joint, capture.saved_names, prefix)
        if config.cost_model != "measured" and not capture.values:
            capture.values = meta_values(capture.joint)
        classes = unit_classes(graph_units, symbols)
        ticker = Ticker(say)

        def measure(unit: UnitNodes, factor: int, values: dict = capture.values, symbols: dict = symbols) -> RecoveryUnit:
            repeats = dataclasses.replace(profile_config, repeats=profile_config.repeats * factor)
            return _profile(unit, values, symbols, repeats)

        # Costs run real (or meta) tensors: a caller's fake mode (a model
        # traced on fake CUDA tensors) must be off meanwhile.
        with default_allocator(), unset_fake_temporarily():
            profiled = profile_by_class(graph_units, classes, measure, progress=lambda done, total, key: ticker(
                f"graph {capture.index}: profiled {done}/{total} units, one layer per block class "
                f"({len(graph_units)} units, {len(classes)} classes; {key})", last=done == total))
        # GC's backward also re-runs one unit's region at a time: its workspace
        # (the largest of a set of values that a depth extension only repeats).
        workspace = largest((parse_size(u.recompute_transient) for u in profiled), batch, seq_len)
        boundary = gc_boundary_by_layer(capture.joint, symbols)
        if depth is not None:
            profiled = extend_units(profiled, depth, classes)
            classes = extend_classes(classes, depth)
            boundary = {layer: boundary.get(depth.template(layer), sympy.Integer(0)) for layer in range(depth.full)}
        block_classes.update({f"{prefix}{name}": layers for name, layers in classes.items()})
        units += profiled
        gc_total += gc_bytes_expr(capture.joint, graph_units, symbols, batch, seq_len, boundary) + workspace
        store_total += sum((parse_size(u.bytes) for u in profiled), sympy.Integer(0))
        output_total += output_bytes_expr(capture.joint, symbols)
        dtypes.append(output_dtype(capture.joint, batch, seq_len))
        for segment, nbytes, readers in trained_parameters(capture.joint, symbols, batch, seq_len):
            if segment == TIED_PARTIALS:  # partials add up: each tied weight has one beside its sum
                partial_grad_bytes[segment] = partial_grad_bytes.get(segment, 0) + nbytes
                continue
            param_bytes[segment] = param_bytes.get(segment, 0) + nbytes
            if readers > 1:
                partial_grad_bytes[segment] = max(partial_grad_bytes.get(segment, 0), nbytes)
    if depth is not None:
        param_bytes = extend_by_layer(param_bytes, depth, group_of)
        partial_grad_bytes = extend_by_layer(partial_grad_bytes, depth, group_of)
    keys = [u.key for u in units]
    if len(set(keys)) != len(keys):
        raise RuntimeError("recovery unit keys collide across graphs; report this model")
    device = config.cost_model.partition(":")[2] or _device_of(captures)
    # Every trace, the backend's and ``hilore trace``'s, holds measured times
    # summarised to a stated resolution, so that two traces of one graph plan alike.
    return round_measured_costs(Trace(
        fingerprint=fingerprint(((u.key, u.kind, u.dtype) for u in units), (c.joint.graph for c in captures),
                                salt="" if depth is None else f"depth {depth.captured} -> {depth.full}"),
        model=config.model_name, batch=batch, seq_len=seq_len, device=device,
        cost_source=config.cost_model, units=tuple(units), gc_bytes=format_size(gc_total),
        store_bytes=format_size(sympy.expand(store_total)),
        num_layers=len({u.layer for u in units if u.layer is not None}),
        torch_version=torch.__version__,
        graph_breaks=tuple(f"graph {c.index}" for c in captures[1:]),
        notes=config.notes + _value_notes(captures),
        output_bytes=format_size(sympy.expand(output_total)), param_bytes=param_bytes,
        partial_grad_bytes=partial_grad_bytes, block_classes=block_classes,
        output_dtype=next((d for d in reversed(dtypes) if d), ""),  # the last graph's: the logits come last
    ))


def _value_notes(captures: Sequence[GraphCapture]) -> tuple[str, ...]:
    synthetic = [c.index for c in captures if c.synthetic_values and c.values]
    if not synthetic:
        return ()
    return (f"graph(s) {synthetic}: inputs could not be matched to the joint graph's; costs and codec "
            "errors were measured on random inputs of the same shapes",)


def _profile(unit: UnitNodes, values: dict[str, Any], symbols, config: ProfileConfig) -> RecoveryUnit:
    """``profile_unit``, or a unit pinned to ``store`` when its region cannot be re-run
    here (the reason is kept in the trace): one odd op never stops a trace."""
    try:
        return profile_unit(unit, values, symbols, config)
    except Exception as error:  # the unit is kept, exactly as Inductor would keep it
        pinned = dataclasses.replace(unit, recomputable=False,
                                     not_recomputable_reason=f"profiling failed: {type(error).__name__}: {error}")
        return profile_unit(pinned, values, symbols, dataclasses.replace(config, codecs=()), run=False)


def _device_of(captures: Sequence[GraphCapture]) -> str:
    """The device the graph runs on: its first input's (fake CUDA counts as CUDA)."""
    for node in captures[0].joint.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            return val.device.type
    return "cpu"
