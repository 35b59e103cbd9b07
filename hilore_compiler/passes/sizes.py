"""Sizes of graph values as sympy expressions of the batch ``B`` and sequence ``S``.

With dynamic dims, dynamo names the batch and sequence of the first input
with fresh symbols (``s23``, ``s27``, ...); here they are renamed to the
trace's ``B`` and ``S`` so every size reads the same in every process.
"""

from __future__ import annotations

from collections.abc import Iterable

import sympy
import torch
import torch.fx as fx

from .annotate import distinct_storage
from ..tracefile import B, S, eval_size


def _expr(dim: int | torch.SymInt) -> sympy.Expr:
    if isinstance(dim, torch.SymInt):
        return dim.node.expr
    return sympy.Integer(int(dim))


def shape_symbols(graph: fx.Graph) -> dict[sympy.Symbol, sympy.Symbol]:
    """Map dynamo's batch and sequence symbols to B and S.

    They are the first two dims of the token ids (a 2-D integer input); a
    graph after a graph break may instead start from hidden states
    (B, S, C), whose first two dims are then used. Other inputs of the same
    leading sizes (an attention mask) carry symbols of their own that dynamo
    only guards equal: they map to B and S too.
    """
    tensors = [n.meta["val"] for n in graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2]
    tensors.sort(key=lambda v: not (v.dim() == 2 and not v.is_floating_point()))
    lead = next((v.shape[:2] for v in tensors if any(isinstance(_expr(d), sympy.Symbol) for d in v.shape[:2])), None)
    if lead is None:
        return {}
    hints = [size_hint(d) for d in lead]
    mapping = {}
    for val in tensors:
        if [size_hint(d) for d in val.shape[:2]] != hints:
            continue
        for dim, name in zip(val.shape[:2], (B, S)):
            if isinstance(_expr(dim), sympy.Symbol):
                mapping.setdefault(_expr(dim), name)
    return mapping


def size_hint(dim: int | torch.SymInt) -> int:
    """A size's value at this compile, read without adding a shape guard."""
    return dim.node.hint if isinstance(dim, torch.SymInt) else int(dim)


def nbytes_expr(node: fx.Node, symbols: dict[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    """Bytes of the tensor ``node`` produces (numel x element size)."""
    val = node.meta["val"]
    numel = sympy.Integer(1)
    for dim in val.shape:
        numel *= _expr(dim)
    return sympy.expand((numel * val.element_size()).subs(symbols))


def shape_expr(node: fx.Node, symbols: dict[sympy.Symbol, sympy.Symbol]) -> tuple[sympy.Expr, ...]:
    """``node``'s shape with the graph's size symbols renamed by ``symbols`` (to ``B`` and ``S``)."""
    return tuple(sympy.expand(_expr(d).subs(symbols)) for d in node.meta["val"].shape)


def total_nbytes(nodes: Iterable[fx.Node], symbols: dict[sympy.Symbol, sympy.Symbol]) -> sympy.Expr:
    """Bytes of the memory ``nodes`` hold: a view and its base count once."""
    return sum((nbytes_expr(n, symbols) for n in distinct_storage(nodes)), sympy.Integer(0))


def largest(exprs: Iterable[sympy.Expr], batch: int, seq_len: int) -> sympy.Expr:
    """The expression with the largest value at (batch, seq_len); 0 if none."""
    return max(exprs, key=lambda e: eval_size(e, batch, seq_len), default=sympy.Integer(0))
