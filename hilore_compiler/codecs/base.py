"""The codec interface, its shared rounding helpers and the registry.

A codec is a lossy encoding of a saved activation kept across the
forward/backward boundary. Each one is written once, as an op sequence on an
emitter (see ``_emit``), and so has two faces that agree bit for bit:

- eager ``encode`` / ``decode``: the reference the tracer measures, and the
  place where non-finite input is refused with :class:`NonFiniteError`;
- ``graph_encode`` / ``graph_decode``: the same ops inserted into a decomposed
  AOTAutograd joint graph before Inductor's partitioner.

``encode_unchecked`` runs the graph's semantics on eager tensors (no check, no
host sync; dynamo traces it), for code that encodes outside the hilore graph
(the bench's GC with int8 checkpoints).

Codecs are stateless; one instance per name lives in the registry.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Sequence

import sympy
import torch
import torch.fx

from ._emit import EagerEmitter, Emitter, GraphEmitter, Value

prims = torch.ops.prims

#: The floating dtypes a saved activation can have in the models we compile.
FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

Shape = Sequence["int | sympy.Expr"]


class NonFiniteError(ValueError):
    """A codec was asked to encode a tensor that holds (or would hold) inf/nan.

    Raised by the eager ``encode`` only; the tracer catches it and marks the
    codec unusable for that recovery unit, so the planner stores the unit.
    """

    def __init__(self, codec: str, detail: str) -> None:
        self.codec = codec
        super().__init__(
            f"codec {codec!r}: {detail}; store this unit instead "
            f"(option 'store'), since {codec!r} cannot represent it"
        )


class Codec(abc.ABC):
    """A lossy encoding of one saved activation; subclasses set ``name``.

    Subclasses implement ``_encode``/``_decode`` against an :class:`Emitter`
    using only decomposed aten/prims ops, plus ``encoded_nbytes_expr`` and
    ``error_bound``. Everything else is shared here.
    """

    #: Registry key and the ``<codec>`` of the option ``compress:<codec>``.
    name: ClassVar[str]
    #: Input dtypes this codec encodes (and so may be planned for).
    input_dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    def available(self, device: torch.device | str = "cpu") -> bool:
        """Whether this codec runs on ``device`` (eager and compiled)."""
        return True

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether tensors of ``dtype`` can be encoded (and save bytes)."""
        return dtype in self.input_dtypes

    # ---- eager reference -------------------------------------------------

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Encode ``x``; raises :class:`NonFiniteError` on inf/nan in or out."""
        self._check_dtype(x.dtype)
        with torch.no_grad():
            if not bool(torch.isfinite(x).all()):
                raise NonFiniteError(self.name, "input holds inf or nan")
            parts = tuple(self._encode(EagerEmitter(), x))
            # A finite input can still overflow the encoding (fp32 -> bf16
            # above 3.39e38); refuse it here rather than save an inf.
            for part in parts:
                if part.is_floating_point() and not bool(torch.isfinite(part.float()).all()):
                    raise NonFiniteError(self.name, "a finite input overflowed the encoding")
        return parts

    def encode_unchecked(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Encode ``x`` as the graph does at run time: no finiteness check, so no host
        sync; a non-finite input takes the codec's in-graph fallback (row-wise
        codecs: its row decodes to NaN). Equal to :meth:`encode` on finite input."""
        self._check_dtype(x.dtype)
        with torch.no_grad():
            return tuple(self._encode(EagerEmitter(), x))

    def decode(self, parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Decode ``parts`` (from :meth:`encode`) back to a tensor of ``dtype``."""
        _check_out_dtype(dtype)
        with torch.no_grad():
            return self._decode(EagerEmitter(), tuple(parts), dtype)

    # ---- sizes -----------------------------------------------------------

    def encoded_nbytes(self, shape: Shape, dtype: torch.dtype) -> int:
        """Bytes of the encoded parts of a tensor of ``shape`` and ``dtype``."""
        expr = self.encoded_nbytes_expr(tuple(shape), dtype)
        if expr.free_symbols:
            raise ValueError(f"shape {tuple(shape)} is symbolic; use encoded_nbytes_expr")
        return int(expr)

    @abc.abstractmethod
    def encoded_nbytes_expr(self, shape: Shape, dtype: torch.dtype) -> sympy.Expr:
        """Same as :meth:`encoded_nbytes`; shape entries may be sympy exprs."""

    @abc.abstractmethod
    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Documented per-element bound on ``|decode(encode(x)) - x|`` (float64).

        Valid for finite ``x`` of a supported dtype, decoded to ``x.dtype``.
        """

    # ---- fx graph builders ------------------------------------------------

    def graph_encode(self, graph: torch.fx.Graph, x: torch.fx.Node) -> tuple[torch.fx.Node, ...]:
        """Insert the encode ops for ``x`` at ``graph``'s insertion point.

        ``x.meta["val"]`` must be set (a FakeTensor or meta tensor). Never
        raises on values: non-finite rows follow the module's documented
        runtime fallback.
        """
        emit = GraphEmitter(graph, f"{self.name}.encode", [x])
        self._check_dtype(emit.val(x).dtype)
        return tuple(self._encode(emit, x))  # type: ignore[arg-type]

    def graph_decode(
        self, graph: torch.fx.Graph, parts: Sequence[torch.fx.Node], dtype: torch.dtype
    ) -> torch.fx.Node:
        """Insert the decode ops for ``parts`` (from :meth:`graph_encode`)."""
        _check_out_dtype(dtype)
        emit = GraphEmitter(graph, f"{self.name}.decode", parts)
        return self._decode(emit, tuple(parts), dtype)  # type: ignore[return-value]

    # ---- what a codec implements -------------------------------------------

    @abc.abstractmethod
    def _encode(self, e: Emitter, x: Value) -> tuple[Value, ...]:
        """The encode ops, written once for both emitters."""

    @abc.abstractmethod
    def _decode(self, e: Emitter, parts: tuple[Value, ...], dtype: torch.dtype) -> Value:
        """The decode ops, written once for both emitters."""

    def _check_dtype(self, dtype: torch.dtype) -> None:
        if not self.supports(dtype):
            raise TypeError(
                f"codec {self.name!r} does not encode {dtype}; "
                f"supported: {sorted(map(str, self.input_dtypes))}"
            )


def _check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"codecs decode to one of {sorted(map(str, FLOAT_DTYPES))}, not {dtype}")


def convert(e: Emitter, x: Value, dtype: torch.dtype) -> Value:
    """``x`` as ``dtype`` via ``prims.convert_element_type`` (no-op if equal)."""
    if e.val(x).dtype == dtype:
        return x
    return e.op(prims.convert_element_type.default, x, dtype)


def numel_expr(shape: Shape) -> sympy.Expr:
    """Number of elements of ``shape`` as a sympy expression (1 for ``()``)."""
    return sympy.Mul(*(sympy.sympify(d) for d in shape))


def rounding_bound(dtype: torch.dtype, magnitude: torch.Tensor) -> torch.Tensor:
    """Largest error of rounding a value of ``magnitude`` to ``dtype`` (float64).

    Round-to-nearest-even is off by at most half an ulp: ``eps/2`` relative
    for normal values, half the smallest subnormal (``tiny*eps/2``) below.
    """
    fi = torch.finfo(dtype)
    return magnitude.double() * (fi.eps / 2) + fi.tiny * fi.eps / 2


# ---- registry ------------------------------------------------------------

_REGISTRY: dict[str, Codec] = {}


def register_codec(codec: Codec, *, replace: bool = False) -> Codec:
    """Register ``codec`` under ``codec.name`` and return it.

    A second codec under a taken name is an error unless ``replace=True``.
    """
    if not isinstance(codec, Codec):
        raise TypeError(f"register_codec expects a Codec instance, got {codec!r}")
    if codec.name in _REGISTRY and not replace and _REGISTRY[codec.name] is not codec:
        raise ValueError(f"codec {codec.name!r} is already registered")
    _REGISTRY[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The registered codec called ``name`` (available or not on this machine)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(_REGISTRY) or "none"
        raise ValueError(f"unknown codec {name!r}; known codecs: {known}") from None


def registered_codecs() -> list[str]:
    """Names of every registered codec, available on this machine or not, in registration order."""
    return list(_REGISTRY)


def codec_names(device: torch.device | str = "cpu") -> list[str]:
    """Names of the registered codecs available on ``device``, in registration order."""
    return [name for name, codec in _REGISTRY.items() if codec.available(device)]
