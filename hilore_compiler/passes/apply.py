"""Apply: rewrite the joint graph so min-cut partitions it as the plan says.

Before Inductor's partitioner runs, every recovery unit gets its option:

- ``store``: its saved nodes are tagged ``MUST_SAVE``.
- ``recompute``: its whole recompute region is tagged ``MUST_RECOMPUTE``, so
  backward re-runs it from the (stored or recomputed) units it reads.
- ``compress:<codec>``: the codec's encode runs right after the producer and
  its payload is tagged ``MUST_SAVE``; backward reads a decode of it (tagged
  ``MUST_RECOMPUTE``, so it runs in backward). Cheap forward ops that the
  default partition recomputes from the unit in backward are cloned to read
  the decoded value, so the full-precision tensor is never kept.

The partitioner then saves exactly the stored tensors and the payloads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils.checkpoint import CheckpointPolicy

from .. import codecs as codec_registry
from ..vocabulary import CODEC_META_KEY, COMPRESS_PREFIX as COMPRESS, RECOMPUTE, STORE
from .annotate import UnitNodes, frontier_keys, is_backward, storage_root

#: node.meta key naming the codec node a rewrite inserted (for inspection).
CODEC_META = CODEC_META_KEY
#: node.meta key set on encode nodes: they run in forward (see ``in_forward``).
IN_FORWARD_META = "hilore_in_forward"


def in_forward(node: fx.Node) -> bool:
    """Whether ``node`` is part of an encode, which must run in forward.

    Inductor's min-cut only honours ``MUST_SAVE`` on nodes the forward outputs
    need; an encode is not one of them, so without this flag min-cut may save
    the full-precision root instead and re-run the encode in backward (it did
    when one saved root fed two payloads). The partitioner counts these nodes
    as forward nodes (``backend.partitioner``), so payloads are saved.
    """
    return bool(node.meta.get(IN_FORWARD_META))


class PlanMismatchError(ValueError):
    """A plan that does not fit the graph it is applied to."""


def check_decisions(units: list[UnitNodes], decisions: Mapping[str, str]) -> None:
    """Refuse decisions for units this graph lacks, or that break the plan's rules.

    Units without a decision are allowed: they keep Inductor's own choice
    (``backend.matching`` decides, and says, which units those are).
    """
    unknown = sorted(set(decisions) - {u.key for u in units})
    if unknown:
        raise PlanMismatchError(f"decisions for units that are not in this graph: {unknown[:3]}")
    by_key = {u.key: u for u in units}
    for key, option in decisions.items():
        unit = by_key[key]
        if option == RECOMPUTE:
            if not unit.recomputable:
                raise PlanMismatchError(f"plan recomputes {key}, which is not recomputable: {unit.not_recomputable_reason}")
            compressed = [k for k in frontier_keys(unit) if decisions.get(k, "").startswith(COMPRESS)]
            if compressed:
                raise PlanMismatchError(f"plan recomputes {key} from compressed units {compressed}")
        elif option.startswith(COMPRESS):
            codec_registry.get_codec(option[len(COMPRESS):])
        elif option != STORE:
            raise PlanMismatchError(f"unknown option {option!r} for unit {key}")


def apply_decisions(joint: fx.GraphModule, units: list[UnitNodes], decisions: Mapping[str, str]) -> dict[str, int]:
    """Tag and rewrite ``joint`` in place; returns how many units got each option."""
    check_decisions(units, decisions)
    counts = {STORE: 0, RECOMPUTE: 0, "compress": 0}
    # Recompute regions first, stores second: a stored value that lies inside
    # a recompute region (a shared view base) stays stored and is read there.
    for unit in units:
        if decisions.get(unit.key) == RECOMPUTE:
            for node in unit.region:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            counts[RECOMPUTE] += 1
    for unit in units:
        if decisions.get(unit.key) == STORE:
            for node in unit.saved:
                storage_root(node).meta["recompute"] = CheckpointPolicy.MUST_SAVE
            counts[STORE] += 1
    # Compress the memory, not one view of it: every view backward reads
    # then comes from the decoded copy.
    roots: dict[fx.Node, object] = {}
    for unit in units:
        option = decisions.get(unit.key, "")
        if option.startswith(COMPRESS):
            codec = codec_registry.get_codec(option[len(COMPRESS):])
            for root in unit.encoded_roots:
                roots.setdefault(root, codec)
            for node in unit.kept_as_is:  # e.g. attention's philox seed and offset on CUDA
                storage_root(node).meta["recompute"] = CheckpointPolicy.MUST_SAVE
            counts["compress"] += 1
    if roots:
        _compress_all(joint.graph, roots)
    joint.graph.lint()
    joint.recompile()
    return counts


def _first_backward(graph: fx.Graph) -> fx.Node:
    """The first node that reads a tangent: every forward value exists by then.

    (Backward-tagged nodes that read only parameters may sit earlier.)
    """
    from_tangents: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and "tangents" in node.name:
            from_tangents.add(node)
        elif node.op == "output" or any(a in from_tangents for a in node.all_input_nodes):
            return node
    raise AssertionError("joint graph without an output node")


def _recomputed_downstream(roots: Mapping[fx.Node, object]) -> list[fx.Node]:
    """Forward nodes computed from the compressed ``roots`` (without passing a
    stored value) whose values backward reads: the default partition would
    recompute them from the roots, so backward must get them from the decoded
    copies instead. In graph order."""
    reach, todo, seen = [], list(roots), set(roots)
    while todo:
        for user in todo.pop().users:
            # Stop at stored values, at backward, and at what rewrites added.
            if (user in seen or is_backward(user) or user.op == "output" or CODEC_META in user.meta
                    or user.meta.get("recompute") == CheckpointPolicy.MUST_SAVE):
                continue
            seen.add(user)
            reach.append(user)
            todo.append(user)
    order = {n: i for i, n in enumerate(next(iter(roots)).graph.nodes)}
    needed: set[fx.Node] = set()
    for node in sorted(reach, key=order.__getitem__, reverse=True):
        if any(is_backward(u) or u in needed for u in node.users):
            needed.add(node)
    return sorted(needed, key=order.__getitem__)


def _new_nodes(graph: fx.Graph, build) -> tuple[object, list[fx.Node]]:
    """Run a graph builder; return its result and the nodes it inserted."""
    before = set(graph.nodes)
    result = build()
    return result, [n for n in graph.nodes if n not in before]


def _memory_order(node: fx.Node) -> list[int]:
    """Dims of ``node``'s value from outermost to innermost in memory."""
    val = node.meta["val"]
    return sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))


def _permute(graph: fx.Graph, node: fx.Node, order: list[int]) -> fx.Node:
    """``node`` permuted by ``order`` (``node`` itself for the identity).

    A value laid out transposed in memory (attention outputs are (B, H, T, D)
    over (B, T, H, D) storage) is encoded through the permuted, contiguous
    view and decoded back through the inverse permutation, so the decoded
    copy has the original strides and the views backward takes of it stay valid.
    """
    if order == sorted(order):
        return node
    permuted = graph.call_function(torch.ops.aten.permute.default, (node, order))
    val = node.meta["val"]
    with detect_fake_mode([val]) or contextlib.nullcontext():
        permuted.meta["val"] = val.permute(order)
    permuted.meta[CODEC_META] = "layout"
    return permuted


def _realized(graph: fx.Graph, root: fx.Node) -> fx.Node:
    """``root`` through Inductor's ``force_stride_order`` at its own strides.

    Inductor keeps a pointwise value as an expression and computes it inside
    each consumer's loop, unless on CPU it holds an op it deems heavy (exp,
    log, tanh, ...). An encode reads its input twice (absmax, then quantize),
    so a root left as an expression was computed three times: on ``small``
    the rotary embedding's pow, cos and sin ran once for attention and twice
    more per key element for int8, 3.3x that kernel's time (a (2, 4, 2048,
    32) rotary + encode: 10.4 ms against 3.6 ms forced). The forced value
    is a buffer Inductor computes once (a copy of an unrealized expression;
    nothing for a value that already is one, as a matmul's output); the
    caller points every forward consumer of the root at it. Roots with
    symbolic strides are left as they are: the prim takes concrete strides.
    """
    stride = root.meta["val"].stride()
    if not all(isinstance(s, int) for s in stride):
        return root
    from torch._inductor import inductor_prims

    realized = graph.call_function(inductor_prims.force_stride_order, (root, list(stride)))
    realized.meta["val"] = root.meta["val"]
    realized.meta[CODEC_META] = "layout"
    return realized


def _compress_all(graph: fx.Graph, roots: Mapping[fx.Node, object]) -> None:
    """Encode each root after its producer; give backward decoded copies.

    Forward ops between the roots and backward's reads are cloned onto the
    decoded values, so no full-precision root or value derived from it needs
    to be kept. Decode and clones are tagged MUST_RECOMPUTE: they run in
    backward, from the payloads (tagged MUST_SAVE).
    """
    downstream = _recomputed_downstream(roots)
    first_backward = _first_backward(graph)
    clones: dict[fx.Node, fx.Node] = {}
    recomputed: list[fx.Node] = []
    for root, codec in roots.items():
        order = _memory_order(root)
        with graph.inserting_after(root):
            source = _realized(graph, root)
        if source is not root:  # every forward consumer reads the one buffer
            for user in list(root.users):
                if user is not source and not is_backward(user) and user.op != "output":
                    user.replace_input_with(root, source)
        with graph.inserting_after(source):
            dense = _permute(graph, source, order)
        with graph.inserting_after(dense):
            parts, encode_nodes = _new_nodes(graph, lambda: codec.graph_encode(graph, dense))
        for part in parts:
            part.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        for node in encode_nodes + [n for n in (source, dense) if n is not root]:
            node.meta[IN_FORWARD_META] = True
        dtype = root.meta["val"].dtype
        with graph.inserting_before(first_backward):
            decoded, decode_nodes = _new_nodes(
                graph, lambda: codec.graph_decode(graph, tuple(parts), dtype))
        with graph.inserting_before(first_backward):
            clones[root] = clones[source] = _permute(graph, decoded, [order.index(d) for d in range(len(order))])
        recomputed += decode_nodes + ([clones[root]] if clones[root] is not decoded else [])
    # A fresh block: the codec's emitter leaves the point after its last node.
    with graph.inserting_before(first_backward):
        for node in downstream:
            clones[node] = graph.node_copy(node, lambda a: clones.get(a, a))
            clones[node].meta[CODEC_META] = "clone"
            recomputed.append(clones[node])
    for node in recomputed:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    for original, replacement in clones.items():
        for user in list(original.users):
            if is_backward(user):
                user.replace_input_with(original, replacement)
