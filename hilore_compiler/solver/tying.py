"""Which units the ILP decides together: block classes tied into a few patterns.

A model of L identical layers gives the full ILP L copies of one layer's
variables, and CBC cannot prove anything about them: which of 32 alike layers
takes which pattern does not move its bound (``cbc.SolverOptions``). Here the
members of a block class (``blockclasses``; at the cost model's level, so
every member has the same bytes per option, workspace and gradient workspace)
are decided by a few shared patterns instead:

- the first and last ``EDGE_MEMBERS`` members of a class decide alone: the
  first layer sits next to the embedding, the last one holds the step's peak
  in backward (every kept byte is still alive there);
- the members between them are cut into contiguous groups of 1, 2, 4, ...
  members and a remainder (30 = 15 + 8 + 4 + 2 + 1, ``binary_split``), each
  group one pattern. Any number of them, from 0 to all, can so take a
  pattern apart from the rest, which is how the full ILP fills a memory
  ceiling exactly (some layers one pattern, the others the next cheaper one).

So the ILP has O(classes x log L) copies of a layer's variables, not L. Ties
only restrict the full ILP: every tied plan is one of its plans, decided
and then re-simulated on the whole model (``planner.verify``). What the ties
can cost is measured against the full ILP where that is optimal
(tests/test_tying.py, ``hilore plan --full-ilp``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..blockclasses import group_layers, layer_free_key, relative_ref, shared_targets
from ..vocabulary import group_of
from .memory import CostModel, UnitCost

#: Members at each end of a class that decide alone (module docstring).
EDGE_MEMBERS = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Tying:
    """Which unit's variables decide each unit."""

    #: Unit key -> the key of the unit whose variables decide it (itself if untied).
    alias: Mapping[str, str]
    #: The block classes found (layers per class; classes of one layer included).
    classes: tuple[tuple[int, ...], ...] = ()
    #: The groups of layers sharing one pattern (only groups of two or more).
    groups: tuple[tuple[int, ...], ...] = ()

    def decides(self, key: str) -> bool:
        """True for a unit whose own variables decide it (and maybe others)."""
        return self.alias[key] == key

    def describe(self) -> str:
        """One line for the plan's notes."""
        tied = sum(len(g) for g in self.groups)
        return (f"block classes: {len(self.classes)} ({', '.join(_span(c) for c in self.classes)}); "
                f"{tied} layers decided by {len(self.groups)} shared patterns "
                f"({', '.join(_span(g) for g in self.groups)}), the others alone")


def _span(layers: Sequence[int]) -> str:
    """``(0, 1, 2, 3)`` -> ``0-3``; ``(0, 2, 4)`` -> ``0,2,4`` (a class of alternate layers)."""
    if len(layers) > 1 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]},{layers[1]},..,{layers[-1]}"


def untied(model: CostModel) -> Tying:
    """Every unit decided alone: the full ILP."""
    return Tying(alias={u.key: u.key for u in model.units})


def _unit_signature(u: UnitCost, by_key: Mapping[str, UnitCost], shared: frozenset[str]) -> tuple:
    """What two tied units must share so that the ILP's memory stays exact."""
    return (layer_free_key(u.key, u.layer), u.kind, u.bytes, u.recompute_transient, u.recomputable,
            tuple(relative_ref(r, u.layer, by_key, shared) for r in u.recompute_from),
            None if u.read_until is None else relative_ref(u.read_until, u.layer, by_key, shared),
            tuple(sorted((name, c.bytes) for name, c in u.codecs.items())))


def model_classes(model: CostModel) -> list[tuple[int, ...]]:
    """The block classes of ``model``: layers with units of the same structure
    and bytes at the planned shape and the same gradient workspace."""
    gradient = model.step.gradient_bytes
    shared = shared_targets(model.units, lambda u: u.recompute_from)
    return group_layers(model.units, lambda u: _unit_signature(u, model.by_key, shared),
                        lambda layer: gradient.get(group_of(layer), 0))


def pattern_groups(members: Sequence[int], edge: int = EDGE_MEMBERS) -> list[tuple[int, ...]]:
    """``members`` (one class, sorted) cut into the groups that share a pattern
    (module docstring): ``edge`` alone at each end, then groups of 2^k."""
    if len(members) <= 2 * edge + 1:
        return [(m,) for m in members]
    inner = list(members[edge:len(members) - edge])
    groups = [(m,) for m in members[:edge]]
    for size in reversed(binary_split(len(inner))):
        groups.append(tuple(inner[:size]))
        inner = inner[size:]
    groups += [(m,) for m in members[len(members) - edge:]]
    return groups


def binary_split(n: int) -> list[int]:
    """Sizes 1, 2, 4, ... and a remainder, summing to ``n``, such that every
    count from 0 to ``n`` is the sum of some of them (30 -> 1, 2, 4, 8, 15):
    any number of members can take a pattern apart from the rest."""
    sizes, power = [], 1
    while sum(sizes) + power <= n:
        sizes.append(power)
        power *= 2
    if n > sum(sizes):
        sizes.append(n - sum(sizes))
    return sizes


def tie_blocks(model: CostModel, *, edge: int = EDGE_MEMBERS) -> Tying:
    """The tying of ``model``'s block classes (module docstring)."""
    classes = model_classes(model)
    by_layer: dict[int, list[UnitCost]] = {}
    for u in model.units:
        if u.layer is not None:
            by_layer.setdefault(u.layer, []).append(u)
    alias = {u.key: u.key for u in model.units}
    shared = []
    for members in classes:
        for group in pattern_groups(members, edge):
            if len(group) < 2:
                continue
            shared.append(group)
            lead = by_layer[group[0]]
            for layer in group[1:]:
                for rep, u in zip(lead, by_layer[layer], strict=True):
                    alias[u.key] = rep.key
    return Tying(alias=alias, classes=tuple(classes), groups=tuple(shared))
