"""The trace: recovery units and their measured costs (``hilore.trace/v1``).

A trace is what the tracer writes and the solver reads. It knows nothing of
torch.fx: sizes are sympy expressions (as strings) of the symbolic batch ``B``
and sequence length ``S``, costs are seconds with the source that produced
them, so a plan can be made offline, on another machine, for another shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jsonio import FormatError, as_object, optional, read_json, require, write_json_atomic
from .sizeexpr import SHAPE_SYMBOLS, B, S, eval_size, parse_size
from .validate import raise_problems, trace_problems

TRACE_SCHEMA = "hilore.trace/v1"

#: ``Trace.partial_grad_bytes``'s key for the partial gradients of parameters
#: read in several backward segments, alive together at the end of backward.
TIED_PARTIALS = "tied"

# Sizes live in ``sizeexpr``; these names stay importable from here.
__all__ = ["B", "S", "SHAPE_SYMBOLS", "CodecCost", "RecoveryUnit", "TIED_PARTIALS", "Trace", "TRACE_SCHEMA",
           "eval_size", "load_trace", "parse_size", "trace_from_json"]


@dataclass(frozen=True, slots=True)
class CodecCost:
    """What compressing one unit with one codec costs and how far it is off."""

    #: Bytes kept across forward/backward when compressed (payload + scales).
    bytes: str
    #: Encode + decode seconds at the traced shape.
    time_s: float
    #: Relative L2 error ||decode(encode(x)) - x|| / ||x|| on the traced tensor.
    rel_l2: float
    #: Largest absolute elementwise error on the traced tensor.
    max_abs: float
    #: ``"measured"`` or ``"roofline:<device>"``.
    source: str
    #: False when the codec must not be used for this unit (see ``reason``).
    usable: bool = True
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class RecoveryUnit:
    """The saved activations one place of the model produces, decided together."""

    #: Stable across processes and shapes: ``<module fqn>:<op kind>:<index>``.
    key: str
    #: Decoder layer index, or None outside the layer stack (embedding, head).
    layer: int | None
    #: Role inside its layer, e.g. ``mlp.act``, ``attn.sdpa``, ``norm``.
    kind: str
    #: The aten op that produces it, e.g. ``mm``, ``mul``.
    op: str
    dtype: str
    #: Bytes kept when stored, as a sympy expression of B and S.
    bytes: str
    #: Bytes at the traced shape (the expression evaluated there).
    bytes_at_trace: int
    #: Keys of the units its recomputation reads (the rest are model inputs).
    recompute_from: tuple[str, ...]
    #: Bytes that recomputing it needs at once besides its own output.
    recompute_transient: str
    #: Seconds to recompute it from ``recompute_from`` at the traced shape.
    recompute_time_s: float
    recompute_flops: int
    recompute_source: str
    #: False for random ops without saved seeds, side effects or mutation.
    recomputable: bool = True
    not_recomputable_reason: str | None = None
    #: Key of the first unit made after this unit's last forward reader, or
    #: ``READ_PAST_UNITS``: backward needs this unit from that unit's backward
    #: down to its own. None in traces that predate it (the memory model then
    #: takes the last unit whose recomputation reads it).
    read_until: str | None = None
    codecs: dict[str, CodecCost] = field(default_factory=dict)
    #: Calibrated gradient sensitivity per codec: relative gradient error per
    #: unit of exposure when only this unit is compressed. Empty until calibrated.
    sensitivity: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Trace:
    """Everything the solver needs about one model's saved activations."""

    #: Identifies the model graph; a plan carries it to refuse the wrong model.
    fingerprint: str
    model: str
    #: The shape the costs were measured at.
    batch: int
    seq_len: int
    device: str
    #: ``"measured"`` or ``"roofline:<device>"``.
    cost_source: str
    units: tuple[RecoveryUnit, ...]
    #: Bytes that per-layer gradient checkpointing keeps (layer inputs plus what
    #: lies outside the layers) plus one layer's recompute transient.
    gc_bytes: str
    #: Bytes the default min-cut partition keeps (everything stored).
    store_bytes: str
    num_layers: int
    torch_version: str = ""
    graph_breaks: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: Bytes of the graph's outputs (the caller holds them through backward and
    #: backward starts from their gradient); "0" in traces that predate it.
    output_bytes: str = "0"
    #: Bytes of the trained parameters (so of their gradients) per backward
    #: segment: ``"layer <i>"``, ``"outside"`` (read after the layers: the
    #: head) or ``"inputs"`` (read before them: the embedding, whose gradient
    #: backward makes last); empty in traces that predate it.
    param_bytes: dict[str, int] = field(default_factory=dict)
    #: Per backward segment, the bytes of its largest parameter that several
    #: forward ops read (a chunked lm_head): backward holds one partial
    #: gradient of that size beside the sum. Under ``TIED_PARTIALS``: the
    #: parameters read in several segments (an embedding tied to the
    #: lm_head), whose partial from the segment backward meets first is alive
    #: beside the others at the end of backward. Empty where none is (and in
    #: traces that predate it).
    partial_grad_bytes: dict[str, int] = field(default_factory=dict)
    #: Block classes (``blockclasses``): layers whose units are the same up to
    #: the layer index, ``{"c0": (0,), "c1": (1, 2, ...)}`` (names prefixed
    #: ``g<i>/`` for a graph after a break). Profiling measured each class's
    #: first layer and gave every member its costs. Empty in traces that
    #: predate it (the solver finds classes from the units all the same).
    block_classes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Bytes of the model's frozen parameters (a LoRA model's base weights):
    #: held through the step but never given a gradient or optimizer state.
    #: None where not recorded (older traces, graphs traced without their model).
    frozen_param_bytes: int | None = None
    #: The dtype of the graph's largest differentiated output (the logits),
    #: which a loss run after the graph upcasts (``solver.lossmodel``); ""
    #: where not recorded.
    output_dtype: str = ""

    def unit(self, key: str) -> RecoveryUnit:
        for u in self.units:
            if u.key == key:
                return u
        raise KeyError(f"no recovery unit {key!r} in trace of {self.model}")

    def to_json(self) -> dict[str, Any]:
        payload = dataclasses.asdict(self)
        return {"schema": TRACE_SCHEMA, **payload}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the trace atomically as ``hilore.trace/v1`` JSON.

        The payload is first read back as ``load_trace`` would read the file,
        so a trace that could not be loaded is never written (FormatError).
        """
        payload = json.loads(json.dumps(self.to_json()))
        trace_from_json(payload, where=f"trace for {path}")
        return write_json_atomic(path, payload)


def _number(obj: dict[str, Any], key: str, where: str) -> float:
    """A JSON number (not a boolean); range checks are ``validate``'s."""
    return float(require(obj, key, (int, float), where))


def _codec_cost(obj: Any, where: str) -> CodecCost:
    obj = as_object(obj, where)
    return CodecCost(
        bytes=require(obj, "bytes", str, where),
        time_s=_number(obj, "time_s", where),
        rel_l2=_number(obj, "rel_l2", where),
        max_abs=_number(obj, "max_abs", where),
        source=require(obj, "source", str, where),
        usable=optional(obj, "usable", bool, where, True),
        reason=optional(obj, "reason", (str, type(None)), where, None),
    )


def _unit(obj: Any, where: str) -> RecoveryUnit:
    obj = as_object(obj, where)
    key = require(obj, "key", str, where)
    where = f"{where}[{key}]"
    # Any JSON value: ``validate`` says what a layer must be (an index or null).
    layer = obj.get("layer")
    codecs = require(obj, "codecs", dict, where)
    sensitivity = optional(obj, "sensitivity", dict, where, {})
    return RecoveryUnit(
        key=key,
        layer=layer,
        kind=require(obj, "kind", str, where),
        op=require(obj, "op", str, where),
        dtype=require(obj, "dtype", str, where),
        bytes=require(obj, "bytes", str, where),
        bytes_at_trace=require(obj, "bytes_at_trace", int, where),
        recompute_from=tuple(require(obj, "recompute_from", list, where)),
        recompute_transient=require(obj, "recompute_transient", str, where),
        recompute_time_s=_number(obj, "recompute_time_s", where),
        recompute_flops=require(obj, "recompute_flops", int, where),
        recompute_source=require(obj, "recompute_source", str, where),
        recomputable=require(obj, "recomputable", bool, where),
        not_recomputable_reason=optional(obj, "not_recomputable_reason", (str, type(None)), where, None),
        read_until=optional(obj, "read_until", (str, type(None)), where, None),
        codecs={n: _codec_cost(c, f"{where}.codecs.{n}") for n, c in codecs.items()},
        sensitivity={n: _number(sensitivity, n, f"{where}.sensitivity") for n in sensitivity},
    )


def trace_from_json(payload: dict[str, Any], where: str = "trace") -> Trace:
    """Build and validate a Trace from parsed JSON; a FormatError names the wrong field.

    Every size is parsed with the whitelisted grammar of ``sizeexpr`` (never
    evaluated as Python) and checked at the traced shape; see ``validate``.
    """
    payload = as_object(payload, where)
    if payload.get("schema") != TRACE_SCHEMA:
        raise FormatError(f"{where}: schema is {payload.get('schema')!r}, expected {TRACE_SCHEMA!r}")
    units = tuple(
        _unit(u, f"{where}.units[{i}]") for i, u in enumerate(require(payload, "units", list, where))
    )
    trace = Trace(
        fingerprint=require(payload, "fingerprint", str, where),
        model=require(payload, "model", str, where),
        batch=require(payload, "batch", int, where),
        seq_len=require(payload, "seq_len", int, where),
        device=require(payload, "device", str, where),
        cost_source=require(payload, "cost_source", str, where),
        units=units,
        gc_bytes=require(payload, "gc_bytes", str, where),
        store_bytes=require(payload, "store_bytes", str, where),
        num_layers=require(payload, "num_layers", int, where),
        torch_version=optional(payload, "torch_version", str, where, ""),
        graph_breaks=tuple(optional(payload, "graph_breaks", list, where, [])),
        notes=tuple(optional(payload, "notes", list, where, [])),
        output_bytes=optional(payload, "output_bytes", str, where, "0"),
        param_bytes=optional(payload, "param_bytes", dict, where, {}),
        partial_grad_bytes=optional(payload, "partial_grad_bytes", dict, where, {}),
        block_classes={name: tuple(layers) if isinstance(layers, list) else layers
                       for name, layers in optional(payload, "block_classes", dict, where, {}).items()},
        frozen_param_bytes=optional(payload, "frozen_param_bytes", (int, type(None)), where, None),
        output_dtype=optional(payload, "output_dtype", str, where, ""),
    )
    raise_problems(trace_problems(trace, where))
    return trace


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a ``hilore.trace/v1`` file."""
    return trace_from_json(read_json(path, TRACE_SCHEMA), where=str(path))
