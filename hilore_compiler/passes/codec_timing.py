"""What a codec costs in a compiled step: its Inductor-compiled encode and
decode, timed once per process.

The step runs a codec as Inductor kernels, so that is what is timed. Memory
traffic alone (read the tensor, write the payload, and back) undercounts the
compute the kernels add: the row-wise absmax reductions, and int4's nibble
packing, which makes int4 dearer than int8 although its payload is half as
large. Compiled alone at ``small``'s shapes on one CPU thread, fp32 int8 costs
1.4-1.7x its traffic and int4 1.9-3.4x; bf16 int8 2.6-2.7x, int4 3.2-3.8x
(a study removed in 9ccfacb: ``git show 9ccfacb^:bench/codec_cost.py``). Pricing by traffic made the planner prefer int4
where int8 was faster.

Each (codec, dtype, row length, device) is timed once on a probe set of
tensors larger than a CPU's last-level cache, so it streams from memory as a
saved activation does in backward; a unit's price is its bytes times that
rate. The codecs are row-wise, so the row length (the last dimension) is what
changes their kernels; the number of rows only scales them.

Each codec's encode and decode are compiled once per (dtype, device) with
symbolic sizes, and serve every row length their shape guards admit (int4's
nibble packing, for one, guards on an even row): a Qwen2 layer has saved
tensors of four row lengths, and a C++ compile per length and codec was 16
compiles, 16 s of a 24-layer Qwen2.5-0.5B first compile. The kernels are
Inductor's dynamic-shape kernels, which the step's static ones may outrun a
little; the rate is still timed per row length.

Compiled with ``make_fx`` + ``compile_fx``, not ``torch.compile``: the tracer
runs inside the hilore backend, where dynamo would count every probe shape as
a recompile of one function and stop at its recompile limit.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from .. import codecs as codec_registry

log = logging.getLogger(__name__)

#: A codec is timed on this many distinct probe tensors in turn, each of
#: ``CODEC_PROBE_BYTES``: 32 MB together, past a VM's share of the last-level
#: cache, so each call streams from memory as a saved activation does in
#: backward. Each is the size of a typical unit (``small``'s are 4-11 MB); one
#: large probe would be timed mostly on page faults, as allocations over
#: glibc's 32 MB mmap ceiling are mapped afresh at every call.
CODEC_PROBES, CODEC_PROBE_BYTES = 8, 4 << 20
#: Untimed calls, then timed calls whose median is kept (as ``copy_bandwidth``).
PROBE_WARMUP, PROBE_REPEATS = 1, 5


@functools.cache
def codec_seconds_per_byte(name: str, dtype: torch.dtype, row: int, device: torch.device) -> float | None:
    """Seconds a compiled encode plus decode of codec ``name`` takes per byte of
    a ``dtype`` tensor whose rows hold ``row`` elements, on ``device``.

    None, with one warning, where the codec cannot be compiled here (no C++
    compiler, say): the caller then prices by traffic.
    """
    try:
        return _measure(codec_registry.get_codec(name), dtype, row, device)
    except Exception as error:  # pricing never stops tracing: the traffic price stands in
        _warn_once(f"could not compile codec {name} for {dtype} rows of {row} on {device} "
                   f"({type(error).__name__}: {error}); pricing it by memory traffic instead")
        return None


def _measure(codec: codec_registry.Codec, dtype: torch.dtype, row: int, device: torch.device) -> float:
    rows = max(1, CODEC_PROBE_BYTES // (row * dtype.itemsize))
    probes = [torch.randn(rows, row, device=device).to(dtype) for _ in range(CODEC_PROBES)]  # (rows, row) each
    encode_s, decode_s = encode_decode_seconds(codec, probes, repeats=PROBE_REPEATS * CODEC_PROBES)
    seconds = encode_s + decode_s
    if not math.isfinite(seconds) or seconds <= 0:
        raise RuntimeError(f"timed {seconds} s")
    return seconds / (probes[0].numel() * probes[0].element_size())


def encode_decode_seconds(codec: codec_registry.Codec, probes: list[torch.Tensor], *,
                          repeats: int) -> tuple[float, float]:
    """Median seconds of ``codec``'s compiled encode and of its compiled decode, each
    call on the next of ``probes`` (same shape and dtype) in turn."""
    from .profile import ProfileConfig, _median_seconds

    dtype = probes[0].dtype
    encode = _compiled((codec.name, "encode", dtype), lambda x: codec.encode_unchecked(x), probes[0])
    encoded = [tuple(encode(x)) for x in probes]
    decode = _compiled((codec.name, "decode", dtype), lambda p: (codec.decode(p, dtype),), encoded[0])
    timing = ProfileConfig(warmup=PROBE_WARMUP, repeats=repeats)
    raw_inputs, encoded_inputs = itertools.cycle(probes), itertools.cycle(encoded)
    return (_median_seconds(lambda: encode(next(raw_inputs)), timing),
            _median_seconds(lambda: decode(next(encoded_inputs)), timing))


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A function compiled for symbolic sizes, and the shapes it serves."""

    fn: Callable[..., Any]
    shape_env: ShapeEnv
    #: The symbolic tensors it was traced on, flattened: its guards are over their sizes.
    fakes: tuple[FakeTensor, ...]

    def serves(self, args: Sequence[Any]) -> bool:
        """Whether the guards recorded while tracing and compiling hold for ``args``."""
        return self.shape_env.evaluate_guards_for_args(list(self.fakes), pytree.tree_leaves(args))


#: (codec, "encode" or "decode", dtype) -> its compiles so far, each for the shapes its guards admit.
_COMPILES: dict[tuple[str, str, torch.dtype], list[_Compiled]] = {}


def _compiled(key: tuple[str, str, torch.dtype], fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``fn`` compiled by Inductor for inputs shaped like ``args``: a compile made
    for another row length when its guards admit these shapes, else a new one."""
    compiles = _COMPILES.setdefault(key, [])
    for compiled in compiles:
        if compiled.serves(args):
            return compiled.fn
    compiles.append(_compile_symbolic(fn, args))
    return compiles[-1].fn


def _compile_symbolic(fn: Callable[..., Any], args: Sequence[Any]) -> _Compiled:
    """``fn`` traced to aten with every size of ``args`` symbolic and compiled by Inductor."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake_args = pytree.tree_map_only(torch.Tensor, lambda a: mode.from_tensor(a, symbolic_context=(
        StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * a.dim()))), tuple(args))
    fakes = tuple(pytree.tree_leaves(fake_args))
    # The backend that profiles runs inside dynamo's compile, whose tracing
    # context holds the model's fake mode: this compile has its own.
    with tracing(TracingContext(mode)), torch.no_grad():
        gm = make_fx(fn, tracing_mode="symbolic")(*fake_args)
        return _Compiled(compile_fx(gm, list(fake_args)), mode.shape_env, fakes)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
