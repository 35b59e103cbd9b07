"""The memory / time model shared by the ILP and the re-simulation of its answer.

A plan's memory is the predicted peak of the whole training step above what
the process held before it (weights, optimizer state): what is alive at the
worst moment of forward and backward. Measured on the bench's GRPO step (CPU,
``small`` at 2 x 2048 tokens) the peak falls in one of two places:

- the loss's backward, with every kept activation still alive: kept + the
  graph's outputs (the logits, held by the caller) + the loss's own peak (its
  log-softmax temporaries and the gradient of the outputs being formed). This
  is store-all's peak;
- the backward of one segment (a layer, or ``outside``): kept + outputs + the
  gradient of the outputs backward started from (freed after the head's
  backward unless a tied weight's sum keeps it: ``StepTerms.output_grad_bytes``)
  + the segment's rebuilt
  units and workspace (``transient`` below) + the gradients backward itself
  holds there (the widest activation's gradient, or the partial gradient of
  a weight several ops read if larger, and the one flowing between
  layers; a recompute workspace is freed before they are made, so the
  segment holds the larger of the two) + the weights' gradients accumulated
  so far. This is GC's peak.

So, with ``StepTerms`` (``stepterms.py``) giving the parts the trace's units do not:

    peak = max(kept + outputs + loss + held,
               max over segments g of kept - freed(g) + transient(g) + step(g),
               kept - freed(end) + outputs + d_outputs(end) + held + every weight
               gradient + a tied weight's second partial)
    step(g) = outputs + d_outputs(g) + grad_workspace(g) + held + weight
              gradients of g and of every segment backward reaches before g
    d_outputs(g) = outputs in the head's backward (``outside``); after it, 0,
              or outputs where a tied weight (embedding = lm_head) is summed
              at the end of backward
    freed(g) = kept bytes of the layers backward has finished before g (every
              layer's at the end; ``outside``'s never, conservatively)

``held`` is every weight's gradient when the update accumulates them over
microbatches, else 0: a compiled backward returns its new gradients only at
its end, so they sit beside the accumulated ``.grad`` until then (measured on
the actor update: 10.3 MB of new gradients beside 15.8 MB accumulated at
GC's allocator peak). Backward frees a saved activation after its last use,
as autograd and Inductor's backward both do (measured: a compiled 4-layer
stack's backward releases each layer's saved inputs as it passes the layer),
so the layers backward has finished hold nothing: counting their kept bytes
through the whole backward over-predicted that update's GC peak by 9%.

Every term but ``loss`` comes from the trace; ``loss`` is a multiple of the
outputs' bytes the caller measures for its loss (``bench.measure.loss_side``,
3.0 for token log-probs + the GRPO loss in fp32) or 0 when the loss is not
known (the backend's default).

The activation part (``transient`` and ``kept``):

    kept      = sum of stored unit bytes + sum of compressed bytes
    transient = what backward holds at once to recover units. Backward runs
                one segment at a time and, inside it, from the last unit to
                the first (``segments.Segment``). A recomputed or decoded unit is
                rebuilt for its latest reader's backward and freed once
                backward is past itself; a recomputed unit is rebuilt earlier
                when a recomputed reader is, since that recomputation reads
                it (``segments.rebuilt_from``). At each cut p of segment g backward holds
                    alive(g, p) = bytes of the units of g rebuilt at p
                  + the larger of g's recompute workspace (the largest of its
                    recomputed units') and its gradient workspace
                  + g's other backward terms (``StepTerms``);
                transient = the largest of these, or the loss's peak.
    memory    = kept + transient

This is how Inductor's backward runs a plan: AOTAutograd's partitioner places
each recomputed node just before its first use in backward, and a buffer is
freed after its last use. Holding all of a segment's rebuilt units at once
instead, as this model did before, over-predicted HiLoRe's measured peak by
7.8% and uniform int8's by 13.8% on the bench's ``small`` step; with windows
the two are within 1.2% and 2.1% (GC and store-all, which rebuild all or
nothing, do not change). Only the cuts where a segment's rebuilt bytes can peak
are checked (``segments.Segment.peak_cuts``). Units outside the layer stack (layer
None) form one segment, ``outside``.

Rules (``rule_violations``):
- recomputation is bitwise exact, so it never reads a compressed input;
- recompute chains stay inside one layer: a recomputed unit reads units of
  other layers only if they are stored. Otherwise recomputing layer L's input
  recomputes layer L-1, which recomputes L-2, ... at the start of backward,
  and everything rebuilt stays live: store-all memory, which this model
  could not see.

Time of a plan: recompute seconds of recomputed units plus encode + decode
seconds of compressed units (stored units cost nothing extra).

Another shape than the traced one: sizes are the trace's sympy expressions
evaluated there; seconds are scaled linearly by the unit's bytes ratio (both
recompute and codecs are bandwidth- or FLOP-bound in the unit's size, except
attention's quadratic part, which this underestimates for longer sequences).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..tracefile import Trace
from ..vocabulary import COMPRESS_PREFIX, RECOMPUTE, STORE, group_of
from .risk import sensitivity
from .segments import Segment, backward_segments, by_segment, rebuilt_from
from .stepterms import PeakParts, StepTerms, gc_worst, size_at, step_terms


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecAtShape:
    """One codec applied to one unit, at the planned shape."""

    bytes: int
    time_s: float
    sensitivity: float
    #: True when ``sensitivity`` is the rel_l2 proxy, not a calibrated value.
    proxy: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitCost:
    """A recovery unit's sizes and costs at the planned shape."""

    key: str
    layer: int | None
    kind: str
    bytes: int
    recompute_transient: int
    recompute_time_s: float
    recomputable: bool
    recompute_from: tuple[str, ...]
    #: Allowed and usable codecs only, by name.
    codecs: Mapping[str, CodecAtShape]
    #: The trace's ``read_until`` (None: not recorded; see ``backward_segments``).
    read_until: str | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """The options open to this unit: store, each codec, recompute if allowed."""
        compress = tuple(COMPRESS_PREFIX + c for c in self.codecs)
        return (STORE, *compress, *((RECOMPUTE,) if self.recomputable else ()))

    def kept_bytes(self, option: str) -> int:
        if option == STORE:
            return self.bytes
        if option == RECOMPUTE:
            return 0
        return self.codecs[option.removeprefix(COMPRESS_PREFIX)].bytes

    def time_s(self, option: str) -> float:
        if option == STORE:
            return 0.0
        if option == RECOMPUTE:
            return self.recompute_time_s
        return self.codecs[option.removeprefix(COMPRESS_PREFIX)].time_s


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """All units' costs at one shape; what both the ILP and ``simulate`` read."""

    batch: int
    seq_len: int
    units: tuple[UnitCost, ...]
    #: GC's and store-all's predicted step peaks (the references of ``x-gc``
    #: and ``x-store`` budgets), under the same model as every plan.
    gc_bytes: int
    store_bytes: int
    step: StepTerms = field(default_factory=StepTerms)
    #: GC's predicted peak when eager autograd runs the step (``StepTerms.eager``):
    #: the trainer's GC against which a compiled step is often measured.
    gc_eager_bytes: int | None = None
    #: Units by key, derived from ``units`` (a lookup table, not state).
    by_key: Mapping[str, UnitCost] = field(init=False, repr=False, compare=False)
    #: The backward segments with their units' windows, derived from ``units``.
    segments: tuple[Segment, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_key", {u.key: u for u in self.units})
        object.__setattr__(self, "segments", backward_segments(self.units))

    def unit(self, key: str) -> UnitCost:
        return self.by_key[key]


def cost_model(trace: Trace, *, batch: int, seq_len: int, codecs: Sequence[str],
               loss_ratio: float = 0.0, accumulate_gradients: bool = False) -> CostModel:
    """Evaluate ``trace`` at (batch, seq_len), keeping only the allowed codecs.

    ``loss_ratio``: the loss's own peak as a multiple of the graph's outputs'
    bytes (module docstring); 0 leaves the loss out.
    """
    layers = len({u.layer for u in trace.units if u.layer is not None})
    units = []
    for u in trace.units:
        size = size_at(u.bytes, batch, seq_len)
        # Seconds scale with bytes (see module docstring); a zero-byte unit keeps its time.
        scale = size / u.bytes_at_trace if u.bytes_at_trace > 0 else 1.0
        unit_codecs = {}
        for name in codecs:
            cost = u.codecs.get(name)
            if cost is None or not cost.usable:
                continue
            sens, proxy = sensitivity(u, name, layers)
            unit_codecs[name] = CodecAtShape(
                bytes=size_at(cost.bytes, batch, seq_len), time_s=cost.time_s * scale,
                sensitivity=sens, proxy=proxy,
            )
        units.append(UnitCost(
            key=u.key, layer=u.layer, kind=u.kind, bytes=size,
            recompute_transient=size_at(u.recompute_transient, batch, seq_len),
            recompute_time_s=u.recompute_time_s * scale, recomputable=u.recomputable,
            recompute_from=u.recompute_from, codecs=unit_codecs, read_until=u.read_until,
        ))
    units = tuple(units)
    segments = by_segment(units)
    gc_kept, gc_rebuilt, layer_inputs = gc_parts(segments, size_at(trace.gc_bytes, batch, seq_len))
    # The gradient flowing between layers has a layer input's size, and GC
    # keeps one layer input per layer.
    flowing = layer_inputs // max(1, len(gc_rebuilt))
    step = step_terms(trace, segments, batch=batch, seq_len=seq_len, flowing=flowing, loss_ratio=loss_ratio,
                      accumulate_gradients=accumulate_gradients)
    stored = {g: sum(u.bytes for u in us) for g, us in segments.items()}
    flowing_per_layer = {g: flowing for g in gc_rebuilt}
    return CostModel(
        batch=batch, seq_len=seq_len, units=units,
        gc_bytes=gc_kept + gc_worst(gc_rebuilt, step, flowing_per_layer),
        store_bytes=sum(stored.values()) + step.floor(stored), step=step,
        gc_eager_bytes=gc_kept + gc_worst(gc_rebuilt, step.eager(), flowing_per_layer),
    )


def gc_parts(segments: Mapping[str, Sequence[UnitCost]],
              gc_activations: int) -> tuple[int, dict[str, tuple[int, int]], int]:
    """(bytes GC keeps, per layer: (bytes GC rebuilds there, its largest workspace), layer inputs' bytes).

    The trace's ``gc_bytes`` is layer inputs + outside + the largest layer +
    the largest workspace (``tracer.gc_bytes_expr``); the layer inputs are
    what is left when the rest, known from the units, is taken off.
    """
    outside = sum(u.bytes for u in segments.get("outside", []))
    layers = {g: us for g, us in segments.items() if g != "outside"}
    rebuilt = {g: (sum(u.bytes for u in us), max(u.recompute_transient for u in us)) for g, us in layers.items()}
    largest = max((held for held, _ in rebuilt.values()), default=0)
    workspace = max((u.recompute_transient for us in segments.values() for u in us), default=0)
    inputs = max(0, gc_activations - outside - largest - workspace)
    return inputs + outside, rebuilt, inputs


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Memory and time of one plan under the model."""

    memory_bytes: int
    kept_bytes: int
    transient_bytes: int
    time_s: float
    #: Where the peak falls and its parts besides kept bytes (``transient_bytes`` in all).
    peak: PeakParts | None = None


def kept_by_segment(model: CostModel, decisions: Mapping[str, str]) -> dict[str, int]:
    """Bytes ``decisions`` keep per backward segment (stored + compressed)."""
    return {segment.name: sum(u.kept_bytes(decisions[u.key]) for u in segment.units) for segment in model.segments}


def peak_parts(model: CostModel, decisions: Mapping[str, str]) -> PeakParts:
    """The moment the step holds the most besides kept bytes (module docstring):
    the loss, the end of backward, or some cut of a segment with the units
    rebuilt there, the segment's workspace and its backward terms, less the
    kept bytes of the segments backward has finished."""
    kept = kept_by_segment(model, decisions)
    worst = max(model.step.phases(kept), key=lambda p: p.total)
    for segment in model.segments:
        parts = rebuilt_peak(model, segment, decisions, kept)
        if parts is not None and parts.total > worst.total:
            worst = parts
    return worst


def rebuilt_peak(model: CostModel, segment: Segment, decisions: Mapping[str, str],
                 kept: Mapping[str, int]) -> PeakParts | None:
    """The worst cut of ``segment``'s backward with the units ``decisions`` rebuild
    there alive (the first such cut on a tie), or None when it rebuilds nothing;
    ``kept``: the plan's kept bytes per segment (``kept_by_segment``)."""
    rebuilt = [i for i, u in enumerate(segment.units) if decisions[u.key] != STORE]
    if not rebuilt and all(decisions[u.key] == STORE for u, _, _ in segment.carried):
        return None
    first = rebuilt_from(segment, decisions)
    workspace = max((u.recompute_transient for u in segment.units if decisions[u.key] == RECOMPUTE), default=0)
    freed = model.step.freed(segment.name, kept)
    worst = None
    for cut in segment.peak_cuts:
        alive = (sum(segment.units[i].bytes for i in rebuilt if i < cut <= first[i])
                 + sum(u.bytes for u in segment.carried_at(cut) if decisions[u.key] != STORE))
        parts = model.step.segment(segment.name, rebuilt=alive, workspace=workspace, freed=freed)
        if worst is None or parts.total > worst.total:
            worst = parts
    return worst


def recovery_transient(model: CostModel, decisions: Mapping[str, str]) -> int:
    """The most bytes the step holds at once besides kept ones (``peak_parts``)."""
    return peak_parts(model, decisions).total


def simulate(model: CostModel, decisions: Mapping[str, str]) -> Prediction:
    """Memory and time of ``decisions`` (a pure function; raises on a broken plan)."""
    problems = rule_violations(model, decisions)
    if problems:
        raise ValueError("plan breaks the model's rules: " + "; ".join(problems[:5]))
    kept = sum(u.kept_bytes(decisions[u.key]) for u in model.units)
    peak = peak_parts(model, decisions)
    time_s = sum(u.time_s(decisions[u.key]) for u in model.units)
    return Prediction(memory_bytes=kept + peak.total, kept_bytes=kept,
                      transient_bytes=peak.total, time_s=time_s, peak=peak)


def rule_violations(model: CostModel, decisions: Mapping[str, str]) -> list[str]:
    """What is wrong with ``decisions``: undecided units, closed options, recompute
    from a compressed input, recompute chains crossing layers (module docstring)."""
    problems = [f"unit {k} is not in the trace" for k in decisions if k not in model.by_key]
    for u in model.units:
        option = decisions.get(u.key)
        if option not in u.options:
            problems.append(f"unit {u.key}: option {option!r} is not one of {list(u.options)}")
            continue
        if option != RECOMPUTE:
            continue
        for v in u.recompute_from:
            source = str(decisions.get(v, ""))
            if source.startswith(COMPRESS_PREFIX):
                problems.append(f"unit {u.key} is recomputed from compressed {v}")
            elif source == RECOMPUTE and group_of(model.unit(v).layer) != group_of(u.layer):
                problems.append(f"unit {u.key} is recomputed from {v}, recomputed in another layer")
    return problems
