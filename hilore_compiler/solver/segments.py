"""Backward's order over the recovery units: segments, the cuts inside them, and when each unit is alive.

Backward runs one segment at a time (a layer, or ``outside``) and, inside
it, from the last unit to the first. A rebuilt unit (recomputed or decoded)
is alive from the cut where backward first needs it down to itself; these
windows are what the memory model (``memory``) sums at each cut and the ILP
(``ilp``) constrains, so both read them from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..vocabulary import RECOMPUTE, group_of

if TYPE_CHECKING:
    from .memory import UnitCost


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """One backward segment's units in forward order, and when backward needs each.

    Backward walks the units from the last to the first. At cut ``p``
    (1 <= p <= n) it runs the backward of the ops that make unit ``p`` (cut n:
    those after the last unit), which read units before ``p``. So a unit is
    needed at the cuts between the last one whose backward reads it and
    itself (``window``).
    """

    name: str
    units: tuple[UnitCost, ...]
    #: Per unit: the last cut that needs it (n: read past the segment's units;
    #: see ``backward_segments``).
    needed_until: tuple[int, ...]
    #: Per unit: the indices of the segment's units whose recomputation reads it.
    readers: tuple[tuple[int, ...], ...]
    #: Units of other segments that backward rebuilds before it reaches their
    #: own (``carried_units``), each with the first and last cut here that
    #: hold it when it is not stored.
    carried: tuple[tuple[UnitCost, int, int], ...] = ()

    def window(self, i: int) -> range:
        """The cuts at which unit ``i`` is needed for its own readers' gradients."""
        return range(i + 1, self.needed_until[i] + 1)

    @property
    def peak_cuts(self) -> tuple[int, ...]:
        """The cuts where the segment's rebuilt bytes can peak, whatever the plan.

        A unit is alive over the cuts from just after itself to where it is
        rebuilt, one of the ``needed_until`` (``rebuilt_from`` only moves it to a
        reader's), a carried unit over cuts ending at its last one, and a sum
        of such intervals peaks at one of their ends: moving right from
        anywhere else loses no interval.
        """
        return tuple(sorted({*self.needed_until, *(last for _, _, last in self.carried)}))

    def carried_at(self, cut: int) -> tuple[UnitCost, ...]:
        """The other segments' units this cut holds when they are not stored."""
        return tuple(u for u, first, last in self.carried if first <= cut <= last)


def backward_segments(units: Sequence[UnitCost]) -> tuple[Segment, ...]:
    """Group ``units`` (in trace order, i.e. forward order) by segment, with their windows.

    A unit is needed down from the cut of its ``read_until`` unit (the last
    cut, ``len(units)``, when that unit is in another segment or made after
    every unit). Traces that do not record ``read_until`` take the latest unit
    of the segment whose recomputation reads it instead, which overstates the
    window when forward derives much from it that nobody saves (every
    log-prob chunk's logits feed the loss's one saved ratio).
    """
    grouped = by_segment(units)
    carried = carried_units(units, grouped)
    segments = []
    for name, us in grouped.items():
        index = {u.key: i for i, u in enumerate(us)}
        readers: list[list[int]] = [[] for _ in us]
        for j, v in enumerate(us):
            for key in v.recompute_from:
                if key in index:
                    readers[index[key]].append(j)
        needed = tuple(
            (max(r) if r else len(us)) if u.read_until is None else index.get(u.read_until, len(us))
            for u, r in zip(us, readers)
        )
        segments.append(Segment(name=name, units=tuple(us), needed_until=needed,
                                readers=tuple(tuple(r) for r in readers), carried=carried.get(name, ())))
    return tuple(segments)


def carried_units(units: Sequence[UnitCost],
                  grouped: Mapping[str, Sequence[UnitCost]]) -> dict[str, tuple[tuple[UnitCost, int, int], ...]]:
    """Per segment: the units of other segments alive in its backward when not
    stored, each with the cuts that hold it (``Segment.carried``).

    A unit read by another segment's unit (its ``read_until`` there) is rebuilt
    or decoded where backward first needs it and lives until backward is past
    the unit itself. Backward runs the units in reverse forward order, so it is
    alive at every cut, in any other segment, of the units forward made after
    it up to its reader. A Hugging Face Llama's attention mask is layer 0's
    unit read by every layer; recomputed, it was counted in layer 0's backward
    only, and the plan measured 10% over its prediction. ``outside`` holds units
    at both ends of forward and between layers, hence cuts, not whole segments.
    (Its own segment already holds it to the end: ``backward_segments``.)
    """
    order = {u.key: i for i, u in enumerate(units)}
    carried: dict[str, list[tuple[UnitCost, int, int]]] = {}
    for u in units:
        last = order.get(u.read_until or "")
        if last is None:
            continue
        own = group_of(u.layer)
        for g, us in grouped.items():
            between = [p for p, v in enumerate(us) if order[u.key] < order[v.key] <= last]
            if g != own and between:
                carried.setdefault(g, []).append((u, max(between[0], 1), max(between[-1], 1)))
    return {g: tuple(c) for g, c in carried.items()}


def rebuilt_from(segment: Segment, decisions: Mapping[str, str]) -> list[int]:
    """Per unit of ``segment``: the first cut backward meets with it rebuilt.

    A decoded unit is decoded for its latest reader; a recomputed one also as
    soon as a recomputed reader is rebuilt, since that recomputation reads it.
    """
    first = list(segment.needed_until)
    for i in reversed(range(len(segment.units))):
        if decisions[segment.units[i].key] == RECOMPUTE:
            for j in segment.readers[i]:
                if decisions[segment.units[j].key] == RECOMPUTE:
                    first[i] = max(first[i], first[j])
    return first


def by_segment(units: Sequence[UnitCost]) -> dict[str, list[UnitCost]]:
    """``units`` grouped by backward segment (``vocabulary.group_of``), each in forward order."""
    segments: dict[str, list[UnitCost]] = {}
    for u in units:
        segments.setdefault(group_of(u.layer), []).append(u)
    return segments
