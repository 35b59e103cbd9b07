"""The step's predicted memory phase by phase: what ``hilore show PLAN --plot`` draws.

The memory model (``memory.py``) predicts one number per plan, its peak. The
same terms, read phase by phase in the order the step runs them, give the
curve that peak sits on:

- forward, segment by segment (the layers in order, ``outside`` before and
  after them): the kept bytes made so far;
- the loss: every kept byte, the outputs and the loss's own peak;
- backward, segment by segment (``outside`` first, then the layers from the
  last): the kept bytes not yet freed plus the segment's worst moment, the
  larger of its backward with nothing rebuilt and its worst cut with the
  plan's rebuilt units alive (``memory.rebuilt_peak``);
- the end of backward: what is left kept, the outputs and their gradient,
  every weight's gradient.

Every phase is one of those ``memory.peak_parts`` takes its maximum over, or
(forward) below the loss's, so a timeline's maximum is the plan's predicted
``memory_bytes`` exactly; GC's and store-all's are ``gc_bytes`` and
``store_bytes``. Torch-free, like the rest of the solver.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..planfile import TIMELINE_GC as GC
from ..planfile import TIMELINE_STORE_ALL as STORE_ALL
from ..planfile import MemoryTimeline
from ..tracefile import Trace
from ..vocabulary import STORE, group_of
from .memory import CostModel, gc_parts, kept_by_segment, rebuilt_peak
from .segments import Segment, by_segment
from .stepterms import size_at

#: A series: (phase, bytes alive there) in the order the step runs.
Series = list[tuple[str, int]]


def forward_phases(model: CostModel, kept_of: Callable[[str], int]) -> Series:
    """Forward, one phase per run of consecutive units of one segment, with the
    kept bytes made by its end; ``kept_of(unit key)``: what that unit adds."""
    series: Series = []
    total, current, last_layer = 0, None, None
    for u in model.units:
        group = group_of(u.layer)
        if group != current:
            name = f"forward of {group}"
            if u.layer is None:
                name += " (before the layers)" if last_layer is None else f" (after layer {last_layer})"
            series.append((name, total))
            current = group
        total += kept_of(u.key)
        series[-1] = (series[-1][0], total)
        last_layer = last_layer if u.layer is None else u.layer
    held = model.step.held_gradient_bytes
    return [(name, kept + held) for name, kept in series]


def backward_order(model: CostModel) -> list[Segment]:
    """The segments in the order backward meets them: ``outside`` (the head) first,
    then the layers from the last one."""
    outside = [s for s in model.segments if s.name == group_of(None)]
    layers = [s for s in model.segments if s.name != group_of(None)]
    return outside + sorted(layers, key=lambda s: s.units[0].layer, reverse=True)


def plan_series(model: CostModel, decisions: Mapping[str, str]) -> Series:
    """The predicted memory of ``decisions`` at each phase of the step (module docstring)."""
    kept = kept_by_segment(model, decisions)
    total = sum(kept.values())
    loss, end, *_ = model.step.phases(kept)
    series = forward_phases(model, lambda key: model.unit(key).kept_bytes(decisions[key]))
    series.append(("loss", total + loss.total))
    for segment in backward_order(model):
        floor = model.step.segment(segment.name, freed=model.step.freed(segment.name, kept)).total
        rebuilt = rebuilt_peak(model, segment, decisions, kept)
        series.append((f"backward of {segment.name}", total + max(floor, rebuilt.total if rebuilt else floor)))
    series.append(("end of backward", total + end.total))
    return series


def gc_series(trace: Trace, model: CostModel) -> Series:
    """GC's predicted memory at each phase: the layer inputs and everything
    outside kept, one layer rebuilt at a time in backward (``memory.gc_parts``)."""
    kept_total, rebuilt, inputs = gc_parts(by_segment(model.units),
                                           size_at(trace.gc_bytes, model.batch, model.seq_len))
    flowing = inputs // max(1, len(rebuilt))
    kept = {g: flowing for g in rebuilt}
    step = model.step
    seen: set[str] = set()

    def kept_of(key: str) -> int:
        unit = model.unit(key)
        if unit.layer is None:
            return unit.bytes
        first = group_of(unit.layer) not in seen
        seen.add(group_of(unit.layer))
        return flowing if first else 0  # a layer keeps its input only

    loss, end, *_ = step.phases(kept)
    series = forward_phases(model, kept_of)
    series.append(("loss", kept_total + loss.total))
    for segment in backward_order(model):
        held, workspace = rebuilt.get(segment.name, (0, 0))
        parts = step.segment(segment.name, rebuilt=held, workspace=workspace, freed=step.freed(segment.name, kept))
        series.append((f"backward of {segment.name}", kept_total + parts.total))
    series.append(("end of backward", kept_total + end.total))
    return series


def memory_timeline(trace: Trace, model: CostModel, plans: Mapping[str, Mapping[str, str]]) -> MemoryTimeline:
    """GC's, store-all's and each of ``plans``' (``{bucket: decisions}``) memory, phase by phase."""
    series = {GC: gc_series(trace, model), STORE_ALL: plan_series(model, {u.key: STORE for u in model.units}),
              **{name: plan_series(model, decisions) for name, decisions in plans.items()}}
    phases = tuple(name for name, _ in series[GC])
    return MemoryTimeline(phases=phases, bytes={name: tuple(b for _, b in s) for name, s in series.items()})
