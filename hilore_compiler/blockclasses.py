"""Block classes: layers whose recovery units are the same up to the layer index.

The models GRPO trains repeat one decoder block tens of times. Two layers are
of one *block class* when their units, in forward order, have the same keys
once the layer index is taken out of them (``model.layers.7.mlp:mul:0`` ->
``model.layers.*.mlp:mul:0``), the same kinds, ops, dtypes, size expressions
and recompute rules, and read the same units at the same layer offsets (their
producers). Nothing here knows a model's names: the layer index is the first
all-digit component of the module path, as ``passes.annotate`` finds layers.

Whoever reads the result: the tracer records the classes in the trace
(``Trace.block_classes``) and profiles one member per class
(``passes.profile``); validation checks that a trace's recorded classes are
structurally identical; the solver decides the members of a class with a few
shared patterns (``solver.tying``). Torch-free, so the solver can use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol

#: Same rule as ``passes.annotate._LAYER_RE``: the first all-digit component
#: of a module path is the layer index.
_LAYER_COMPONENT = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
#: What replaces the layer index in a layer-free key.
ANY_LAYER = "*"


class _Unit(Protocol):
    key: str
    layer: int | None


def layer_free_key(key: str, layer: int | None) -> str:
    """``key`` (``<fqn>:<op>:<index>``) with its layer index replaced by ``*``.

    A key whose module path does not hold ``layer`` (or of a unit outside the
    layers) comes back unchanged, so it matches only itself.
    """
    if layer is None:
        return key
    fqn, sep, rest = key.partition(":")
    match = _LAYER_COMPONENT.search(fqn)
    if match is None or int(match.group(1)) != layer:
        return key
    start, end = match.span(1)
    return f"{fqn[:start]}{ANY_LAYER}{fqn[end:]}{sep}{rest}"


def shared_targets(units: Iterable[_Unit], refs: Callable[[Any], Iterable[str]]) -> frozenset[str]:
    """Keys of the units that units of two or more other layers read (``refs``):
    the attention mask that layer 0 makes and every layer reads. Every member
    of a class reads that one unit, at a different layer offset each."""
    units = list(units)
    own = {u.key: u.layer for u in units}
    readers: dict[str, set[int]] = {}
    for u in units:
        if u.layer is not None:
            for ref in refs(u):
                readers.setdefault(ref, set()).add(u.layer)
    return frozenset(k for k, layers in readers.items() if len(layers - {own.get(k)}) >= 2)


def relative_ref(ref: str, layer: int | None, units: Mapping[str, _Unit],
                 shared: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """A reference from a unit of ``layer`` to unit ``ref`` that is the same for
    every member of a class: (layer offset, layer-free key) for a unit of
    another layer, ``("abs", ref)`` for one outside the layers, one that many
    layers read (``shared``), or a marker."""
    target = units.get(ref)
    if target is None or target.layer is None or layer is None or ref in shared:
        return ("abs", ref)
    return (target.layer - layer, layer_free_key(ref, target.layer))


def group_layers(units: Iterable[_Unit], unit_signature: Callable[[Any], Hashable],
                 layer_signature: Callable[[int], Hashable] = lambda _layer: None) -> list[tuple[int, ...]]:
    """Layers grouped by the signature of their units in forward order (and
    ``layer_signature``, what else must agree), each group sorted, groups
    ordered by their first layer."""
    by_layer: dict[int, list[Hashable]] = {}
    for u in units:
        if u.layer is not None:
            by_layer.setdefault(u.layer, []).append(unit_signature(u))
    classes: dict[tuple[Hashable, ...], list[int]] = {}
    for layer in sorted(by_layer):
        classes.setdefault((layer_signature(layer), *by_layer[layer]), []).append(layer)
    return sorted((tuple(members) for members in classes.values()), key=lambda m: m[0])


def trace_unit_signature(u: Any, units: Mapping[str, Any], shared: frozenset[str] = frozenset()) -> tuple[Any, ...]:
    """What must agree between units of two layers of one class: structure, not
    measured seconds or errors (those are what profiling a member gives)."""
    return (layer_free_key(u.key, u.layer), u.kind, u.op, u.dtype, u.bytes, u.recompute_transient,
            u.recomputable, tuple(relative_ref(r, u.layer, units, shared) for r in u.recompute_from),
            None if u.read_until is None else relative_ref(u.read_until, u.layer, units, shared),
            tuple(sorted((name, c.bytes, c.usable) for name, c in u.codecs.items())))


def find_block_classes(units: Sequence[Any]) -> dict[str, tuple[int, ...]]:
    """The block classes of a trace's units: ``{"c0": (0, 1, ...), ...}``, named
    in order of their first layer. A layer like no other is a class of one."""
    by_key = {u.key: u for u in units}
    shared = shared_targets(units, lambda u: u.recompute_from)
    groups = group_layers(units, lambda u: trace_unit_signature(u, by_key, shared))
    return {f"c{i}": members for i, members in enumerate(groups)}


def class_of_layer(classes: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """``{layer: class name}`` for recorded classes."""
    return {layer: name for name, members in classes.items() for layer in members}


def _graph_prefix(name: str) -> str:
    """``g2/c0`` -> ``g2/``; ``c0`` -> ``""`` (the first graph's units carry no prefix)."""
    return name[:name.index("/") + 1] if "/" in name else ""


def block_class_problems(trace: Any, where: str) -> list[str]:
    """What is wrong with a trace's recorded classes (``validate`` runs it): a
    class's layers must be indices of the trace's layers, in one class per
    graph, and structurally identical (``trace_unit_signature``)."""
    problems: list[str] = []
    layers = {u.layer for u in trace.units if u.layer is not None}
    by_key = {u.key: u for u in trace.units}
    shared = shared_targets(trace.units, lambda u: u.recompute_from)
    seen: dict[tuple[str, int], str] = {}
    grouped: dict[tuple[str, int | None], list[Any]] = {}
    for u in trace.units:
        grouped.setdefault((_graph_prefix(u.key.split(":")[0]), u.layer), []).append(u)
    for name, members in trace.block_classes.items():
        at = f"{where}.block_classes.{name}"
        if not isinstance(members, (list, tuple)) or not members or \
                not all(type(m) is int and m in layers for m in members):
            problems.append(f"{at}: expected a non-empty list of the trace's layer indices, found {members!r}")
            continue
        prefix = _graph_prefix(name)
        for m in members:
            if (prefix, m) in seen:
                problems.append(f"{at}: layer {m} is also in class {seen[prefix, m]}")
            seen[prefix, m] = name
        shapes = {m: tuple(trace_unit_signature(u, by_key, shared) for u in grouped.get((prefix, m), ()))
                  for m in members}
        odd = [m for m in members if shapes[m] != shapes[members[0]]]
        if odd:
            problems.append(f"{at}: layer(s) {odd[:3]} are not structurally identical to layer {members[0]}")
    return problems
