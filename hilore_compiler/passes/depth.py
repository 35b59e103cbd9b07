"""A deep model's trace from a few of its layers: capture ``CAPTURED_LAYERS``, rename to full depth.

Capturing the joint graph costs time in proportion to depth (dynamo and
AOTAutograd walk every op of every layer): Qwen2.5-3B's 36 layers took 150 s
of a 2-core CPU's 180 s trace. But the layers of a decoder stack are one
block class (``blockclasses``) but for the first and the last: the tracer
already profiles one layer per class and gives its costs to the others. So
a trace of the model cut to four layers holds everything a full trace does:

- cut layer 0 is the first layer (it reads the embedding);
- cut layer 1 is every middle layer whose predecessor is the first;
- cut layer 2 is every middle layer after a middle layer;
- cut layer 3 is the last layer (the final norm and head read it).

``DepthMap`` says which cut layer stands for each layer of the full model,
and renames unit keys and the keys they reference (``recompute_from``,
``read_until``), so that full layer ``i`` made from cut layer ``t`` reads
full layer ``i - 1`` where ``t`` read ``t - 1`` (and layer 0's attention
mask where ``t`` read it: ``_moved``).
The result equals a full-depth trace unit for unit (``tests/test_depth.py``
compares them), except its fingerprint, which names the extension.

It is only right when the cut's layers 1 and 2 are one block class (no
alternating layer types): ``extend_units`` raises ``DepthError`` otherwise,
and the caller captures every layer instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..tracefile import RecoveryUnit
from ..vocabulary import READ_PAST_UNITS

#: Layers captured to stand for a deeper stack (first, two middle, last).
CAPTURED_LAYERS = 4

#: The layer index in a unit key: the first all-digit path component
#: (``annotate._LAYER_RE``), followed by the rest of the module path or the op.
_LAYER_IN_KEY = re.compile(r"(^|\.)(\d+)(?=[.:])")


class DepthError(ValueError):
    """The captured layers cannot stand for the full stack (the caller captures it all)."""


@dataclass(frozen=True, slots=True)
class DepthMap:
    """Which captured layer stands for each layer of a ``full``-layer stack."""

    full: int
    captured: int = CAPTURED_LAYERS

    def __post_init__(self) -> None:
        if self.captured != CAPTURED_LAYERS or self.full <= self.captured:
            raise ValueError(f"a depth map extends {CAPTURED_LAYERS} captured layers to more, "
                             f"not {self.captured} to {self.full}")

    def template(self, layer: int) -> int:
        """The captured layer whose units full layer ``layer`` repeats."""
        if layer < 2:
            return layer
        return self.captured - 1 if layer == self.full - 1 else 2


def key_layer(key: str) -> int | None:
    """The layer index a unit key names, or None outside the layer stack."""
    match = _LAYER_IN_KEY.search(key)
    return int(match.group(2)) if match else None


def with_layer(key: str, layer: int) -> str:
    """``key`` naming layer ``layer`` instead of its own."""
    return _LAYER_IN_KEY.sub(lambda m: f"{m.group(1)}{layer}", key, count=1)


def _place(cut_layer: int, depth: DepthMap) -> int:
    """Where a captured layer is in the full stack when named from afar: the first two
    and the last have one place; a middle layer has many."""
    if cut_layer < 2:
        return cut_layer
    if cut_layer == depth.captured - 1:
        return depth.full - 1
    raise DepthError(f"a unit names captured layer {cut_layer} from afar: which of the full stack's "
                     "middle layers it means is unknown")


def _moved(unit: RecoveryUnit, depth: DepthMap, layer: int | None) -> RecoveryUnit:
    """``unit`` renamed for full layer ``layer`` (None: outside the stack), and every key it names.

    A key of the unit's own layer or a neighbour moves with it (full layer
    ``layer - 1`` is read where the captured ``t - 1`` was); a key of a layer
    further off names what that layer made for all (the first layer's
    attention mask, read by every layer) and goes to that layer's one place.
    """
    template = None if layer is None else depth.template(layer)

    def move(key: str) -> str:
        named = key_layer(key)
        if named is None:
            return key
        if template is not None and abs(named - template) <= 1:
            return with_layer(key, named + layer - template)
        return with_layer(key, _place(named, depth))

    read_until = unit.read_until
    if read_until is not None and read_until != READ_PAST_UNITS:
        read_until = move(read_until)
    return dataclasses.replace(unit, key=move(unit.key), layer=layer,
                               recompute_from=tuple(move(k) for k in unit.recompute_from), read_until=read_until)


def extend_units(units: Sequence[RecoveryUnit], depth: DepthMap,
                 classes: Mapping[str, Sequence[int]]) -> list[RecoveryUnit]:
    """The units of the full stack from those of the captured one, in forward order.

    Raises:
        DepthError: the captured middle layers are not one block class, the
            units are not in layer order, or a renamed reference names no unit.
    """
    class_of = {layer: name for name, members in classes.items() for layer in members}
    if class_of.get(1) is None or class_of.get(1) != class_of.get(2):
        raise DepthError(f"captured layers 1 and 2 are not one block class ({dict(classes)}): the stack's "
                         "layers differ (alternating layer types?)")
    layers = [u.layer for u in units]
    first = next(i for i, layer in enumerate(layers) if layer is not None)
    last = max(i for i, layer in enumerate(layers) if layer is not None)
    head, body, tail = units[:first], units[first:last + 1], units[last + 1:]
    if any(u.layer is None for u in body) or [u.layer for u in body] != sorted(u.layer for u in body):
        raise DepthError("units outside the layer stack sit between its layers")
    by_layer: dict[int, list[RecoveryUnit]] = {}
    for u in body:
        by_layer.setdefault(u.layer, []).append(u)
    extended = [_moved(u, depth, None) for u in head]
    for layer in range(depth.full):
        extended += [_moved(u, depth, layer) for u in by_layer[depth.template(layer)]]
    extended += [_moved(u, depth, None) for u in tail]
    _check_references(extended)
    return extended


def _check_references(units: Sequence[RecoveryUnit]) -> None:
    keys = {u.key for u in units}
    for u in units:
        missing = [k for k in (*u.recompute_from, u.read_until) if k not in keys | {None, READ_PAST_UNITS}]
        if missing:
            raise DepthError(f"{u.key} would read {missing[0]}, which the full stack does not have")


def extend_by_layer(values: Mapping[str, int], depth: DepthMap, group_of) -> dict[str, int]:
    """A per-segment table (``param_bytes``: ``"layer <i>"``, ``"outside"``, ``"inputs"``)
    for the full stack: each layer gets its template's entry."""
    out = {k: v for k, v in values.items() if not k.startswith("layer ")}
    for layer in range(depth.full):
        template = values.get(group_of(depth.template(layer)))
        if template is not None:
            out[group_of(layer)] = template
    return out


def extend_classes(classes: Mapping[str, Sequence[int]], depth: DepthMap) -> dict[str, tuple[int, ...]]:
    """Block classes of the full stack: each layer joins its template's class."""
    class_of = {layer: name for name, members in classes.items() for layer in members}
    out: dict[str, list[int]] = {}
    for layer in range(depth.full):
        out.setdefault(class_of[depth.template(layer)], []).append(layer)
    return {name: tuple(members) for name, members in out.items()}


def _layer_signature(layer: Any) -> tuple:
    """What makes two decoder layers build the same units: every submodule's path, type,
    parameter shapes, dtypes and trainability, and its plain settings (a sliding window)."""
    signature = []
    for path, module in layer.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(module).items()
                                if not k.startswith("_") and k != "layer_idx"
                                and isinstance(v, (bool, int, float, str, type(None)))))
        params = tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in module.named_parameters(recurse=False))
        signature.append((path, type(module).__name__, params, settings))
    return tuple(signature)


def stack_differs(layers: Sequence[Any], layer_types: Sequence[str] | None = None) -> str | None:
    """Why a stack's middle layers cannot all be made from one captured layer, or None if they can.

    ``layers``: the model's decoder layers (on the meta device, say); ``layer_types``: the
    config's per-layer attention types, where it has them.
    """
    if len(layers) <= CAPTURED_LAYERS:
        return f"{len(layers)} layers: captured as they are"
    if layer_types is not None and len(set(layer_types)) > 1:
        return f"its layer types differ ({', '.join(sorted(set(layer_types)))})"
    # The cut's layer 3 stands for the last layer: it must be built like it too.
    reference = _layer_signature(layers[1])
    for i, layer in enumerate(layers[1:], 1):
        if _layer_signature(layer) != reference:
            return f"layer {i} is built unlike layer 1"
    return None
