"""Annotate: group the joint graph's saved activations into recovery units.

Input: the AOT joint graph and the names of the forward values that the
default min-cut partition saves for backward. Output: one ``UnitNodes`` per
recovery unit, and ``node.meta["hilore_unit"]`` (the unit key) on every node
that belongs to a unit. Keys come from the module path and op kind, never
from FX node names, so the same model gives the same keys in every process
and at every shape, and a fused attention kernel is named by its call
(``sdpa``), so the same model gives the same keys on every device.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..vocabulary import READ_PAST_UNITS

#: node.meta key holding the recovery unit key of a saved node.
UNIT_META = "hilore_unit"

#: A layer is an entry of the first ``nn.ModuleList`` / ``nn.Sequential`` on a
#: module path: the first all-digit path component (``model.layers.3.mlp``,
#: ``transformer.h.3.attn``, ``blocks.3``), whatever the container is called.
_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(frozen=True, slots=True)
class UnitNodes:
    """A recovery unit as it appears in one joint graph."""

    key: str
    fqn: str
    layer: int | None
    kind: str
    op: str
    #: The saved forward nodes (several for multi-output ops such as sdpa).
    saved: tuple[fx.Node, ...]
    #: Forward nodes recomputation must re-run (the saved nodes included).
    region: tuple[fx.Node, ...]
    #: Saved nodes of other units that recomputation reads.
    frontier: tuple[fx.Node, ...]
    recomputable: bool
    not_recomputable_reason: str | None
    #: Key of the first unit made after the last forward op whose backward
    #: reads this unit (``READ_PAST_UNITS`` when none is): backward needs it
    #: from that unit's cut down to its own (``solver.segments.Segment``).
    read_until: str = READ_PAST_UNITS

    @property
    def encoded(self) -> tuple[fx.Node, ...]:
        """The saved nodes a codec encodes when the unit is compressed: its
        floating tensors of at least one dimension. Empty: no codec applies."""
        return tuple(n for n in self.saved if encodable(n))

    @property
    def encoded_roots(self) -> tuple[fx.Node, ...]:
        """The memories a codec encodes: the storage root of each ``encoded`` node, once.
        ``passes.apply`` compresses the memory, not the view min-cut saved, so sizes
        of the compressed unit are the roots' (a saved ``(B*S, H*D)`` view of an
        attention output ``(B, H, S, D)`` takes one scale per ``D`` row, not per ``H*D``)."""
        return tuple(dict.fromkeys(storage_root(n) for n in self.encoded))

    @property
    def kept_as_is(self) -> tuple[fx.Node, ...]:
        """Saved nodes that stay as they are even when the unit is compressed:
        CUDA's fused attention saves an integer philox seed and offset beside
        its output and log-sum-exp, a few bytes that no codec takes and that
        should not keep the output from being compressed."""
        return tuple(n for n in self.saved if not encodable(n))


def encodable(node: fx.Node) -> bool:
    """Whether a codec can encode this saved node's value (floating, not a scalar)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() > 0


#: Dynamo's name of the root object a module path starts from: a local or
#: global (``L['self']``, ``G['model']``), indexed when it came through
#: ``*args`` of a decorated forward (``L['args'][0]``, as Hugging Face's are).
_ROOT_SOURCE = re.compile(r"^[LG]\['[^']*'\](?:\[\d+\]|\['[^']*'\])*\.?")


def normalize_fqn(path: str) -> str:
    """``"L['self'].layers[0]._modules['mlp'].up"`` -> ``"layers.0.mlp.up"``."""
    path = _ROOT_SOURCE.sub("", path)
    path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return re.sub(r"\.+", ".", path).strip(".")


def module_fqn(node: fx.Node) -> str:
    """The innermost module path that produced ``node`` ("" at top level).

    Only modules nested in the model count: the stack's entries are followed
    while each lies under the one before. A module object called from outside
    the model's tree (transformers 5.11+ wraps ``apply_rotary_pos_emb`` in a
    module-level kernel-hub module, ``G['...modeling_llama'].apply_rotary_pos_emb``)
    is where the code lives, not where in the model it ran; keying by it
    would change every unit key when a library moves a helper, and lose the
    layer the call ran in.
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    fqn: str | None = None
    for path, _cls in stack.values():
        path = normalize_fqn(path)
        if fqn is None or not fqn or path == fqn or path.startswith(fqn + "."):
            fqn = path
    return fqn or ""


def op_name(node: fx.Node) -> str:
    """A short, process-independent name of the op: ``mm``, ``mul``, ..."""
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        return op_name(node.args[0])
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


#: The fused attention kernels one ``F.scaled_dot_product_attention`` call
#: becomes, one per device and input (the CPU's flash, CUDA's flash,
#: memory-efficient and cuDNN kernels, a backend's own). A unit key names the
#: call, not the kernel, so a plan made where one kernel runs fits a graph
#: where another does (``passes.gpu_lowering`` makes traces pick the GPU's).
ATTENTION_OPS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
})


def key_op(node: fx.Node) -> str:
    """The op as a unit key names it: ``op_name``, with every fused attention kernel as ``sdpa``."""
    name = op_name(node)
    return "sdpa" if name in ATTENTION_OPS else name


def _source_fn(node: fx.Node) -> str:
    stack = node.meta.get("source_fn_stack")
    if not stack:
        return op_name(node)
    # "linear_3" and "linear" are the same torch-level function.
    return re.sub(r"_\d+$", "", str(stack[-1][0]))


def layer_of(fqn: str) -> int | None:
    """The layer index a module path names (``model.layers.3.mlp`` -> 3), or None outside the layer stack.

    The first all-digit path component: module lists are how every model we
    met numbers its repeated blocks, whatever the list is called.
    """
    match = _LAYER_RE.search(fqn)
    return int(match.group(1)) if match else None


def unit_kind(fqn: str, node: fx.Node) -> str:
    """Role inside the layer, e.g. ``mlp.gate_proj.linear`` or ``self_attn.sdpa``."""
    rel = _LAYER_RE.split(fqn, maxsplit=1)[-1] if layer_of(fqn) is not None else fqn
    source = _source_fn(node).replace("scaled_dot_product_attention", "sdpa")
    return ".".join(p for p in (rel, source) if p)


def is_random(node: fx.Node) -> bool:
    """True for ops whose output depends on the RNG state.

    Attention kernels are tagged random because they take ``dropout_p``; with
    ``dropout_p == 0`` they are deterministic and safe to recompute.
    """
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return value != 0.0
    return True


def has_side_effect(node: fx.Node) -> bool:
    """True for a mutating op or an effect token: recomputing it would run its effect twice."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    return node.op == "call_function" and getattr(target, "__name__", "") == "with_effects"


def is_backward(node: fx.Node) -> bool:
    """True for joint-graph nodes that belong to the backward pass."""
    return node.meta.get("partitioner_tag") == "is_backward"


def is_activation(node: fx.Node) -> bool:
    """A forward tensor computed by the graph. Backward-tagged values that
    min-cut hoists into the forward (transposed weights) are not activations:
    they depend on parameters alone and no plan changes them."""
    return (node.op == "call_function" and not is_backward(node)
            and isinstance(node.meta.get("val"), torch.Tensor) and not _aliases_input(node))


def _aliases_input(node: fx.Node) -> bool:
    """A view (``t``, ``permute``, ``view``) of a graph input: the memory is the
    input's (a weight's, when a checkpointed region reads ``weight.t()``), so
    keeping it costs nothing and no plan changes it."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if not getattr(node.target, "is_view", False) or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder"


def _unit_root(node: fx.Node) -> fx.Node:
    """Multi-output ops save several getitems; they form one unit."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return node


def _stable_indices(graph: fx.Graph) -> dict[fx.Node, int]:
    """Index of each forward node among forward nodes of the same (fqn, op)."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    index = {}
    for node in graph.nodes:
        if node.op != "call_function" or is_backward(node) or node.target is operator.getitem:
            continue
        group = (module_fqn(node), key_op(node))
        index[node] = seen[group]
        seen[group] += 1
    return index


def storage_root(node: fx.Node) -> fx.Node:
    """The op that owns ``node``'s memory: ``node`` itself unless it is a view."""
    while isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        base = node.args[0]
        if not isinstance(base, fx.Node) or base.op == "placeholder":
            break
        node = base
    return node


def _region(saved: tuple[fx.Node, ...], stops: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """Walk back from ``saved`` to other saved values or graph inputs.

    Another view of a saved value's memory (``view_8`` beside a saved
    ``view_6`` of the same base) counts as that saved value: recomputation
    reads it from there, whichever view the graph happens to use.
    """
    by_root = {storage_root(s): s for s in stops}
    region, frontier, todo, seen = [], [], list(saved), set(saved)
    while todo:
        node = todo.pop()
        region.append(node)
        for arg in node.all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            if arg.op == "placeholder":
                continue
            stop = arg if arg in stops else by_root.get(storage_root(arg))
            if stop is not None and stop not in saved:
                frontier.append(stop)
            else:
                todo.append(arg)
    return region, frontier


def _recompute_verdict(region: list[fx.Node]) -> str | None:
    for node in region:
        if is_random(node):
            return f"random op {op_name(node)} without a saved seed"
        if has_side_effect(node):
            return f"op {op_name(node)} mutates or has side effects"
    return None


def annotate_units(joint: fx.GraphModule, saved_names: set[str], prefix: str = "") -> list[UnitNodes]:
    """Group the saved forward values named ``saved_names`` into recovery units.

    ``prefix`` keeps keys apart when a model compiles to several graphs
    (graph breaks): the tracer passes ``g1/``, ``g2/`` for the later ones.

    Placeholders (parameters, user inputs) are never units: they stay alive
    regardless of the plan; nor are symbolic ints and hoisted weight values.
    """
    graph = joint.graph
    saved_nodes = [n for n in graph.nodes if n.name in saved_names and is_activation(n)]
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in saved_nodes:
        # A saved view and its base are one memory, so one unit, keyed by the
        # op that owns the memory: whether min-cut saves the base, a view of
        # it or both (symbolic and static graphs differ here), the key is one.
        groups[_unit_root(storage_root(node))].append(node)
    index = _stable_indices(graph)
    stops = set(saved_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    units = []
    for root, members in groups.items():
        fqn, op = module_fqn(root), op_name(root)
        key = f"{prefix}{fqn or '<top>'}:{key_op(root)}:{index.get(root, 0)}"
        region, frontier = _region(tuple(members), stops)
        region.sort(key=order.__getitem__)
        reason = _recompute_verdict(region + ([root] if root not in region else []))
        for node in members:
            node.meta[UNIT_META] = key
        units.append(UnitNodes(
            key=key, fqn=fqn, layer=layer_of(fqn), kind=unit_kind(fqn, root), op=op,
            saved=tuple(members), region=tuple(region),
            frontier=tuple(dict.fromkeys(frontier)), recomputable=reason is None,
            not_recomputable_reason=reason,
        ))
    _check_unique(units)
    return _with_read_until(units, order)


def _with_read_until(units: list[UnitNodes], order: dict[fx.Node, int]) -> list[UnitNodes]:
    """Set each unit's ``read_until``: the first unit made after the last forward
    op whose backward reads the unit, directly or through values forward
    derives from it without passing another unit (backward rebuilds those
    from the unit).

    Which units' recomputation reads a unit (``frontier``) is not when
    backward needs it: recomputing a loss statistic reads every log-prob
    chunk's logits through ops nobody saves, while backward needs each
    chunk's logits only for that chunk's own gradient.
    """
    made_at = {u.key: max(order[n] for n in u.saved) for u in units}
    made = sorted((p, key) for key, p in made_at.items())
    positions = [p for p, _ in made]
    saved = {n for u in units for n in u.saved}
    result = []
    for u in units:
        last = made_at[u.key] + 1  # at least the next unit's cut: the unit's own op may read it
        todo = [*u.saved, storage_root(u.saved[0])]
        seen = set(todo)
        while todo:
            node = todo.pop()
            forward_users = [x for x in node.users if not is_backward(x) and x.op != "output"]
            if any(is_backward(x) for x in node.users):  # backward reads it: at its readers' backward
                last = max([last, order[node], *(order[x] for x in forward_users)])
            for x in forward_users:
                if x not in seen and x not in saved:
                    seen.add(x)
                    todo.append(x)
        i = bisect.bisect_left(positions, last)
        result.append(dataclasses.replace(u, read_until=made[i][1] if i < len(made) else READ_PAST_UNITS))
    return result


def distinct_storage(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """One node per memory among ``nodes``: the owner of each storage when it
    is a computed tensor, else the first of its views."""
    by_root: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        root = storage_root(node)
        owner = root if is_activation(root) else node
        by_root.setdefault(root, owner)
    return list(by_root.values())


def _check_unique(units: list[UnitNodes]) -> None:
    keys = [u.key for u in units]
    dupes = {k for k in keys if keys.count(k) > 1}
    if dupes:
        raise RuntimeError(f"recovery unit keys are not unique: {sorted(dupes)}")


def frontier_keys(unit: UnitNodes) -> tuple[str, ...]:
    """Keys of the units that ``unit``'s recomputation reads."""
    return tuple(dict.fromkeys(n.meta[UNIT_META] for n in unit.frontier))
