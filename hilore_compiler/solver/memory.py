"""The memory / time model shared by the ILP and the re-simulation of its answer.

Memory of a plan (activation bytes only, what the trace's units hold):

    kept      = sum of stored unit bytes + sum of compressed bytes
    transient = what backward holds at once to recover units. Backward runs
                one layer at a time; a recomputed or decoded value is rebuilt
                before its first backward use and lives until its last, so
                while recovering unit w of layer g backward holds
                    held(g) = full bytes of the units of layer g that are
                              recomputed or compressed (decoded copies)
                  + recompute_transient(w) if w is recomputed (its workspace)
                transient = the largest of these over all units w.
    memory    = kept + transient

held(g) is a conservative upper bound of the per-unit transient "bytes(u) +
recompute_transient(u) + bytes of u's recomputed inputs": those inputs lie in
u's layer (see the rules below), so they are part of held(g). It also makes the
model agree with the trace's gc_bytes (layer inputs + outside + one layer).
Counting decoded copies in held(g), rather than one decoded copy on top of
it, overestimates a little; in exchange every term is a plain sum, which keeps
CBC's relaxation tight (with the single-copy max, a 23-unit trace took CBC
20 s instead of 0.05 s). Units outside the layer stack (layer None) form one
group, ``outside``.

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

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..tracefile import Trace, eval_size, parse_size
from ..vocabulary import COMPRESS_PREFIX, RECOMPUTE, STORE, codec_of
from .risk import sensitivity


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
    gc_bytes: int
    store_bytes: int
    #: Units by key, derived from ``units`` (a lookup table, not state).
    by_key: Mapping[str, UnitCost] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_key", {u.key: u for u in self.units})

    def unit(self, key: str) -> UnitCost:
        return self.by_key[key]


@functools.lru_cache(maxsize=4096)
def _size(expr: str, batch: int, seq_len: int) -> int:
    """Evaluate a size expression; cached because a trace repeats few distinct ones."""
    return eval_size(parse_size(expr), batch, seq_len)


def cost_model(trace: Trace, *, batch: int, seq_len: int, codecs: Sequence[str]) -> CostModel:
    """Evaluate ``trace`` at (batch, seq_len), keeping only the allowed codecs."""
    layers = len({u.layer for u in trace.units if u.layer is not None})
    units = []
    for u in trace.units:
        size = _size(u.bytes, batch, seq_len)
        # Seconds scale with bytes (see module docstring); a zero-byte unit keeps its time.
        scale = size / u.bytes_at_trace if u.bytes_at_trace > 0 else 1.0
        unit_codecs = {}
        for name in codecs:
            cost = u.codecs.get(name)
            if cost is None or not cost.usable:
                continue
            sens, proxy = sensitivity(u, name, layers)
            unit_codecs[name] = CodecAtShape(
                bytes=_size(cost.bytes, batch, seq_len), time_s=cost.time_s * scale,
                sensitivity=sens, proxy=proxy,
            )
        units.append(UnitCost(
            key=u.key, layer=u.layer, kind=u.kind, bytes=size,
            recompute_transient=_size(u.recompute_transient, batch, seq_len),
            recompute_time_s=u.recompute_time_s * scale, recomputable=u.recomputable,
            recompute_from=u.recompute_from, codecs=unit_codecs,
        ))
    return CostModel(
        batch=batch, seq_len=seq_len, units=tuple(units),
        gc_bytes=_size(trace.gc_bytes, batch, seq_len),
        store_bytes=_size(trace.store_bytes, batch, seq_len),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """Memory and time of one plan under the model."""

    memory_bytes: int
    kept_bytes: int
    transient_bytes: int
    time_s: float


def group_of(layer: int | None) -> str:
    """The backward segment a unit is recovered in: its layer, or ``outside``."""
    return "outside" if layer is None else f"layer {layer}"


def recovery_transient(model: CostModel, decisions: Mapping[str, str]) -> int:
    """The most bytes backward holds at once to recover units (see module docstring)."""
    held: dict[str, int] = {}
    for u in model.units:
        if decisions[u.key] != STORE:  # recomputed or decoded in backward
            held[group_of(u.layer)] = held.get(group_of(u.layer), 0) + u.bytes
    workspace: dict[str, int] = {}
    for u in model.units:
        if decisions[u.key] == RECOMPUTE:
            group = group_of(u.layer)
            workspace[group] = max(workspace.get(group, 0), u.recompute_transient)
    return max((held[g] + workspace.get(g, 0) for g in held), default=0)


def simulate(model: CostModel, decisions: Mapping[str, str]) -> Prediction:
    """Memory and time of ``decisions`` (a pure function; raises on a broken plan)."""
    problems = rule_violations(model, decisions)
    if problems:
        raise ValueError("plan breaks the model's rules: " + "; ".join(problems[:5]))
    kept = sum(u.kept_bytes(decisions[u.key]) for u in model.units)
    transient = recovery_transient(model, decisions)
    time_s = sum(u.time_s(decisions[u.key]) for u in model.units)
    return Prediction(memory_bytes=kept + transient, kept_bytes=kept,
                      transient_bytes=transient, time_s=time_s)


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


def plan_risk(model: CostModel, decisions: Mapping[str, str], mass_share: float) -> float:
    """A bucket's share of the update's squared relative gradient error (``risk.py``):
    mass_share^2 x the sum over compressed units of sensitivity^2."""
    total = 0.0
    for u in model.units:
        codec = codec_of(decisions[u.key])
        if codec is not None:
            total += u.codecs[codec].sensitivity ** 2
    return mass_share**2 * total
