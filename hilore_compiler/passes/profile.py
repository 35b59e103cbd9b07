"""Profile: what each recovery unit costs to store, compress or recompute.

Measured costs run on the tensors of a real forward pass: each unit's
recompute region is extracted into its own graph and re-run from the saved
values it reads (warm-up, repeats, median); each codec encodes and decodes
the real saved tensor for its error, and its time is that of its encode and
decode compiled by Inductor, as the step runs them (``codec_timing``; not the
eager round trip, whose half-dozen separate kernels cost many times more). Roofline
costs estimate the same from FLOPs and bytes with a device's published peaks
(``costmodel``), so a trace for a GPU can be made on a machine without one,
even for a model on the meta device.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from .. import codecs as codec_registry
from .costmodel import DeviceSpec, device_spec, op_seconds
from ..sizeexpr import format_size
from ..vocabulary import DEFAULT_CODECS
from ..tracefile import CodecCost, RecoveryUnit, eval_size
from .annotate import UnitNodes, frontier_keys
from .codec_timing import CODEC_PROBE_BYTES, CODEC_PROBES, codec_seconds_per_byte
from .sizes import largest, nbytes_expr, shape_expr, total_nbytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """How costs are measured."""

    #: ``"measured"`` (run on this machine) or ``"roofline:<device>"``.
    cost_model: str = "measured"
    #: Untimed runs before timing, to fill caches and allocator pools.
    warmup: int = 1
    #: Timed runs; the median is kept because 2 shared cores are noisy.
    repeats: int = 5
    #: The codecs profiled: the backend's and every command's default (``vocabulary``).
    codecs: tuple[str, ...] = DEFAULT_CODECS
    batch: int = 1
    seq_len: int = 1


def region_graph(unit: UnitNodes) -> tuple[fx.GraphModule, list[str]]:
    """A standalone graph that recomputes ``unit``'s saved values from its inputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []
    region = set(unit.region)
    for node in unit.region:
        for arg in node.all_input_nodes:
            if arg not in region and arg not in env:
                env[arg] = graph.placeholder(arg.name)
                env[arg].meta = dict(arg.meta)
                inputs.append(arg.name)
    for node in unit.region:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in unit.saved))
    return fx.GraphModule(torch.nn.Module(), graph), inputs


def _synchronize() -> None:
    # GPU kernels run asynchronously: a wall-clock sample must wait for them.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _median_seconds(fn: Callable[[], Any], config: ProfileConfig) -> float:
    for _ in range(config.warmup):
        fn()
    samples = []
    for _ in range(config.repeats):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class _RooflineCounter(fx.Interpreter):
    """Runs a region (on meta or real tensors) summing per-op roofline time."""

    def __init__(self, gm: fx.GraphModule, spec: DeviceSpec):
        super().__init__(gm)
        self.spec, self.seconds, self.flops = spec, 0.0, 0

    def call_function(self, target, args, kwargs):
        if "device" in kwargs:
            # A factory call of the graph's device (cuda, for a fake CUDA
            # graph): made on meta, like every value here, whatever this machine has.
            kwargs = {**kwargs, "device": torch.device("meta")}
        with FlopCounterMode(display=False) as counter:
            out = super().call_function(target, args, kwargs)
        flops = counter.get_total_flops()
        tensors = [a for a in (*args, out) if isinstance(a, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if isinstance(out, torch.Tensor) and out._base is not None:
            nbytes = 0  # a view moves no data
        dtype = out.dtype if isinstance(out, torch.Tensor) else torch.float32
        self.seconds += op_seconds(self.spec, flops, nbytes, dtype)
        self.flops += flops
        return out


def _recompute_cost(unit: UnitNodes, values: dict[str, Any], config: ProfileConfig) -> tuple[float, int, str]:
    gm, inputs = region_graph(unit)
    args = [values[name] for name in inputs]
    if config.cost_model == "measured":
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            gm(*args)
        with torch.no_grad():
            seconds = _median_seconds(lambda: gm(*args), config)
        return seconds, counter.get_total_flops(), "measured"
    counter = _RooflineCounter(gm, device_spec(config.cost_model))
    with torch.no_grad():
        counter.run(*args)
    return counter.seconds, counter.flops, config.cost_model


def _codec_cost(name: str, unit: UnitNodes, values: dict[str, Any], symbols, config: ProfileConfig) -> CodecCost:
    codec = codec_registry.get_codec(name)
    tensors = [values[n.name] for n in unit.encoded]
    reason = _unusable_reason(codec, tensors)
    if reason:
        raw = total_nbytes(unit.saved, symbols)
        return CodecCost(bytes=format_size(raw), time_s=0.0, rel_l2=0.0, max_abs=0.0,
                         source=config.cost_model, usable=False, reason=reason)
    # What the unit keeps when compressed: the payloads of the memories
    # ``passes.apply`` encodes (``UnitNodes.encoded_roots``), and the members no
    # codec takes (``UnitNodes.kept_as_is``) as they are. Time and error are the
    # encoded members'.
    payload = sum(
        (codec.encoded_nbytes_expr(shape_expr(n, symbols), n.meta["val"].dtype) for n in unit.encoded_roots),
        total_nbytes(unit.kept_as_is, symbols),
    )

    def unusable(reason: str) -> CodecCost:
        return CodecCost(bytes=format_size(payload), time_s=0.0, rel_l2=0.0, max_abs=0.0,
                         source=config.cost_model, usable=False, reason=reason)

    try:
        rel, max_abs = _codec_error(codec, tensors)
    except codec_registry.NonFiniteError as e:
        return unusable(str(e))
    if config.cost_model == "measured":
        seconds = _codec_measured_seconds(codec, tensors, payload, config)
    else:
        seconds = _codec_roofline_seconds(tensors, payload, config)
    return CodecCost(bytes=format_size(payload), time_s=seconds, rel_l2=rel, max_abs=max_abs,
                     source=config.cost_model)


def _unusable_reason(codec, tensors: list[torch.Tensor]) -> str | None:
    for t in tensors:
        if not codec.supports(t.dtype):
            return f"{codec.name} does not encode {t.dtype}"
        if t.numel() == 0:  # scalars never get here: they are kept as they are (UnitNodes.encoded)
            return "empty tensor: nothing to save"
    if not codec.available(tensors[0].device if tensors[0].device.type != "meta" else "cpu"):
        return f"{codec.name} is not available on this platform"
    return None


#: Meta tensors (roofline traces of big models) hold no data: the codec's
#: error is then measured on this many standard-normal samples with the
#: unit's row length, which matches activations after normalisation well.
SYNTHETIC_SAMPLES = 1 << 16


#: Real tensors over this many elements have their codec error measured on
#: evenly spaced whole rows of about this many elements: a relative L2 error
#: is a mean over rows, which a spread sample estimates, and a round trip
#: of every activation at real widths (an MLP's 2 x 2048 x 4864) is most of
#: the profiling time. Rows stay whole: the codecs scale per row.
ERROR_SAMPLE_ELEMENTS = 1 << 20


def error_sample(t: torch.Tensor) -> torch.Tensor:
    """``t``, or evenly spaced whole rows of it when it is larger than ``ERROR_SAMPLE_ELEMENTS``."""
    if t.numel() <= ERROR_SAMPLE_ELEMENTS or t.dim() < 2:
        return t
    rows = t.reshape(-1, t.shape[-1])
    step = -(-rows.shape[0] * rows.shape[1] // ERROR_SAMPLE_ELEMENTS)  # ceil
    return rows[::step].contiguous()


def _codec_error(codec, tensors: list[torch.Tensor]) -> tuple[float, float]:
    """Worst relative L2 and max abs error of a round trip over the unit's tensors
    (a sample of whole rows of large ones: ``error_sample``)."""
    rel, max_abs = 0.0, 0.0
    generator = torch.Generator().manual_seed(0)
    for t in tensors:
        if t.device.type == "meta":
            row = t.shape[-1]
            t = torch.randn(max(1, SYNTHETIC_SAMPLES // row), row, generator=generator).to(t.dtype)
        t = error_sample(t)
        err = codec.decode(codec.encode(t), t.dtype).float() - t.float()
        rel = max(rel, float(err.norm() / t.float().norm().clamp_min(1e-30)))
        max_abs = max(max_abs, float(err.abs().max()))
    return rel, max_abs


#: Units smaller than this are priced by traffic: a codec on 128 KB costs tens
#: of microseconds at any plausible bandwidth, so even 3x off it moves a step by
#: well under 1%, while compiling a codec for another row length costs seconds
#: (``codec_timing``). Tiny test models stay under it; ``small``'s units
#: (0.26-11 MB at 256-2048 tokens) are over.
COMPILED_CODEC_MIN_BYTES = 128 << 10


def _codec_measured_seconds(codec, tensors: list[torch.Tensor], payload: sympy.Expr,
                            config: ProfileConfig) -> float:
    """What a codec adds to a compiled step: its compiled encode and decode on
    tensors of these dtypes and row lengths (``codec_timing``), scaled to their
    bytes; the traffic price (``_codec_traffic_seconds``) for a unit too small to
    be worth a compile, or where the codec cannot be compiled.
    """
    if sum(t.numel() * t.element_size() for t in tensors) < COMPILED_CODEC_MIN_BYTES:
        return _codec_traffic_seconds(tensors, payload, config)
    rates = [codec_seconds_per_byte(codec.name, t.dtype, t.shape[-1], t.device) for t in tensors]
    if any(rate is None for rate in rates):
        return _codec_traffic_seconds(tensors, payload, config)
    return sum(rate * t.numel() * t.element_size() for rate, t in zip(rates, tensors))


def _codec_traffic_seconds(tensors: list[torch.Tensor], payload: sympy.Expr, config: ProfileConfig) -> float:
    """The floor of a codec's cost: its memory traffic at this machine's measured
    copy bandwidth, as if fused into the ops around it. Encode reads the tensor
    and writes the payload, decode the reverse. It undercounts the codec's own
    compute (row reductions, int4's nibble packing): ``codec_timing`` says how much.
    """
    raw = sum(t.numel() * t.element_size() for t in tensors)
    moved = 2 * (raw + eval_size(payload, config.batch, config.seq_len))
    return moved / copy_bandwidth(tensors[0].device)


@functools.cache
def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a plain copy moves (read + write) on ``device``; measured once per process.

    Copied as the codecs are timed (``codec_timing``): ``CODEC_PROBES`` tensors of
    ``CODEC_PROBE_BYTES`` in turn, each into a target of its own, 2 x 32 MB in all,
    past a VM's share of the last-level cache, so each copy streams from memory
    as a saved activation does in backward (the unit's own tensor, copied
    repeatedly, would be timed from cache). One 256 MB probe and its target put
    512 MB into the first call, where planning runs: 7.7x the step's own peak on
    a mid-width Qwen2 (``tests/test_memory_check.py``), and device memory on a GPU.
    """
    sources = [torch.ones(CODEC_PROBE_BYTES // 4, device=device) for _ in range(CODEC_PROBES)]
    pairs = itertools.cycle([(source, torch.empty_like(source)) for source in sources])

    def copy() -> None:
        source, target = next(pairs)
        target.copy_(source)

    seconds = _median_seconds(copy, ProfileConfig(warmup=CODEC_PROBES, repeats=5 * CODEC_PROBES))
    return 2 * CODEC_PROBE_BYTES / max(seconds, 1e-9)


def _codec_roofline_seconds(tensors: list[torch.Tensor], payload: sympy.Expr, config: ProfileConfig) -> float:
    # Encode reads the tensor and writes the payload; decode reads the payload
    # and writes the tensor back: twice both sizes of memory traffic.
    spec = device_spec(config.cost_model)
    raw = sum(t.numel() * t.element_size() for t in tensors)
    moved = 2 * (raw + eval_size(payload, config.batch, config.seq_len))
    return op_seconds(spec, 0.0, moved, tensors[0].dtype)


def _materialized(node: fx.Node, unit: UnitNodes) -> bool:
    """True for region values that take memory of their own while recomputing."""
    target = node.target
    is_view = isinstance(target, torch._ops.OpOverload) and target.is_view
    return node not in unit.saved and isinstance(node.meta.get("val"), torch.Tensor) and not is_view


def profile_unit(unit: UnitNodes, values: dict[str, Any], symbols, config: ProfileConfig,
                 *, run: bool = True) -> RecoveryUnit:
    """Measure (or estimate) every option's cost for one recovery unit.

    ``run=False`` measures nothing: sizes only, for a unit that can only be stored.
    """
    size = total_nbytes(unit.saved, symbols)
    # Workspace: the largest single intermediate. Inductor fuses the
    # pointwise chains of a region, so its intermediates are not all alive at
    # once; summing them would overstate what recomputation holds.
    transient = largest((nbytes_expr(n, symbols) for n in unit.region if _materialized(n, unit)),
                        config.batch, config.seq_len)
    seconds, flops, source = _recompute_cost(unit, values, config) if run else (0.0, 0, "not measured")
    codecs = {
        name: _codec_cost(name, unit, values, symbols, config)
        for name in config.codecs if unit.encoded
    }
    dtype = str(unit.saved[0].meta["val"].dtype).removeprefix("torch.")
    return RecoveryUnit(
        key=unit.key, layer=unit.layer, kind=unit.kind, op=unit.op, dtype=dtype,
        bytes=format_size(size), bytes_at_trace=eval_size(size, config.batch, config.seq_len),
        recompute_from=frontier_keys(unit), recompute_transient=format_size(transient),
        recompute_time_s=seconds, recompute_flops=int(flops), recompute_source=source,
        recomputable=unit.recomputable, not_recomputable_reason=unit.not_recomputable_reason,
        codecs=codecs, read_until=unit.read_until,
    )
