"""Block classes of a joint graph's recovery units, and profiling one member per class.

Layers whose units are the same up to the layer index (``blockclasses``) cost
the same: the same ops on the same shapes and dtypes, reading the same units
at the same layer offsets. Profiling measures one member of each class, the
first, with more repeats than a lone unit gets, and gives every member its
costs; a 32-layer Llama then profiles about 2 layers' units instead of 32's.

Found from the graph alone: the unit keys modulo the layer index, the saved
values' shapes and dtypes, the ops of each unit's recompute region and the
units it reads (its producers). No model-specific names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..blockclasses import group_layers, layer_free_key, relative_ref, shared_targets
from ..tracefile import RecoveryUnit
from .annotate import UnitNodes, frontier_keys, op_name
from .sizes import shape_expr

#: Timed runs of a class's profiled member, as a multiple of a lone unit's:
#: its costs stand for every member, so they get the samples the members
#: would have had (up to this many times).
CLASS_REPEATS_FACTOR = 2


def _node_structure(node: Any, symbols: Mapping) -> tuple:
    val = node.meta.get("val")
    shape = tuple(str(d) for d in shape_expr(node, symbols)) if hasattr(val, "shape") else ()
    return (op_name(node) if node.op == "call_function" else node.op, shape, str(getattr(val, "dtype", "")))


def _unit_structure(u: UnitNodes, by_key: Mapping[str, UnitNodes], symbols: Mapping,
                    shared: frozenset[str] = frozenset()) -> tuple:
    """What two units of alike layers share: everything but the layer index."""
    return (layer_free_key(u.key, u.layer), u.kind, u.op, u.recomputable,
            tuple(_node_structure(n, symbols) for n in u.saved),
            tuple(_node_structure(n, symbols) for n in u.region),
            tuple(relative_ref(k, u.layer, by_key, shared) for k in frontier_keys(u)),
            relative_ref(u.read_until, u.layer, by_key, shared))


def unit_classes(units: Sequence[UnitNodes], symbols: Mapping) -> dict[str, tuple[int, ...]]:
    """The block classes of one graph's units: ``{"c0": (layers...), ...}``, by first layer."""
    by_key = {u.key: u for u in units}
    shared = shared_targets(units, frontier_keys)
    groups = group_layers(units, lambda u: _unit_structure(u, by_key, symbols, shared))
    return {f"c{i}": members for i, members in enumerate(groups)}


def profile_by_class(units: Sequence[UnitNodes], classes: Mapping[str, Sequence[int]],
                     profile: Callable[[UnitNodes, int], RecoveryUnit],
                     progress: Callable[[int, int, str], None] = lambda done, total, key: None) -> list[RecoveryUnit]:
    """Every unit's costs, measured on the first member of its class only.

    ``profile(unit, repeats_factor)`` measures one unit; ``progress(done,
    total, key)`` hears of each unit measured. Units keep their order.
    """
    first = {layer: members[0] for members in classes.values() for layer in members}
    shared = {layer: len(members) > 1 for members in classes.values() for layer in members}
    measured = [u for u in units if u.layer is None or first.get(u.layer, u.layer) == u.layer]
    index_in_layer = _index_in_layer(units)
    costs: dict[str, RecoveryUnit] = {}
    by_position: dict[tuple[int, int], RecoveryUnit] = {}
    for done, u in enumerate(measured, 1):
        factor = CLASS_REPEATS_FACTOR if u.layer is not None and shared.get(u.layer) else 1
        costs[u.key] = profile(u, factor)
        if u.layer is not None:
            by_position[u.layer, index_in_layer[u.key]] = costs[u.key]
        progress(done, len(measured), u.key)
    result = []
    for u in units:
        if u.key in costs:
            result.append(costs[u.key])
            continue
        # A member's structure is its first member's (``unit_classes``): only
        # its names and the units it reads differ.
        source = by_position[first[u.layer], index_in_layer[u.key]]
        result.append(dataclasses.replace(source, key=u.key, layer=u.layer, recompute_from=frontier_keys(u),
                                          read_until=u.read_until))
    return result


def _index_in_layer(units: Sequence[UnitNodes]) -> dict[str, int]:
    """Each unit's position among its layer's units (outside units: their own)."""
    seen: dict[int | None, int] = {}
    index = {}
    for u in units:
        index[u.key] = seen.get(u.layer, 0)
        seen[u.layer] = index[u.key] + 1
    return index
