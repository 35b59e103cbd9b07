"""Emitters: run one op sequence either eagerly or into a torch.fx graph.

Every codec writes its encode/decode once, as calls ``e.op(target, *args)``.
The eager emitter runs the op on tensors; the graph emitter inserts a
``call_function`` node and fills its ``meta["val"]`` by running the same op on
the inputs' fake (or meta) values. One source for both paths is what makes the
eager reference and the rewritten joint graph agree bit for bit.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol, Sequence, Union

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils import _pytree as pytree

#: ``node.meta`` key the graph emitter stamps on every node it inserts, with
#: value ``"<codec>.encode"`` or ``"<codec>.decode"``, so later passes and
#: ``hilore show`` can tell codec ops from model ops.
from ..vocabulary import CODEC_META_KEY  # noqa: E402  (the shared word, re-exported)

#: A tensor (eager) or an fx node (graph).
Value = Union[torch.Tensor, torch.fx.Node]


class Emitter(Protocol):
    """Where a codec's ops go: eager tensors or an fx graph."""

    def op(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Value:
        """Apply ``target`` (an aten/prims overload) to ``args``."""
        ...

    def val(self, x: Value) -> torch.Tensor:
        """The tensor behind ``x`` (itself, or the node's ``meta["val"]``)."""
        ...


class EagerEmitter:
    """Runs each op at once on real tensors."""

    def op(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Value:
        return target(*args, **kwargs)

    def val(self, x: Value) -> torch.Tensor:
        assert isinstance(x, torch.Tensor), f"eager emitter got {type(x).__name__}"
        return x


class GraphEmitter:
    """Inserts each op at ``graph``'s current insertion point.

    The caller chooses the point (``graph.inserting_after(node)`` or
    ``inserting_before``); the nodes go there in program order and the point
    then sits after the last of them, so an encode followed by a decode in
    the same ``with`` block stays in order. Each new
    node gets ``meta["val"]`` (computed on the inputs' ``meta["val"]``, under
    their fake mode when they are FakeTensors), ``meta["tensor_meta"]`` and
    ``meta[CODEC_META_KEY]`` = ``tag``. ``inputs`` are the nodes the ops
    will read; their ``meta["val"]`` must be set.
    """

    def __init__(self, graph: torch.fx.Graph, tag: str, inputs: Sequence[torch.fx.Node]) -> None:
        self.graph = graph
        self.tag = tag
        # Ops without tensor inputs (scalar_tensor) must run in the inputs'
        # fake mode too, or they would make a real tensor among fake ones.
        fakes = [v for v in map(self.val, inputs) if isinstance(v, FakeTensor)]
        self.fake_mode = fakes[0].fake_mode if fakes else None

    def op(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Value:
        val_args, val_kwargs = pytree.tree_map_only(
            torch.fx.Node, lambda n: n.meta["val"], (args, kwargs)
        )
        with _maybe_enter(self.fake_mode):
            val = target(*val_args, **val_kwargs)
        node = self.graph.call_function(target, args, kwargs)
        # Move the insertion point past the new node, like a cursor: under
        # the caller's ``inserting_after(n)`` each node would otherwise land
        # right after ``n``, in reverse order. Outside a ``with``,
        # ``inserting_after`` sets the point at once; the caller's own
        # ``with`` block restores its point when it exits.
        self.graph.inserting_after(node)
        node.meta["val"] = val
        if isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
        node.meta[CODEC_META_KEY] = self.tag
        return node

    def val(self, x: Value) -> torch.Tensor:
        if not isinstance(x, torch.fx.Node):
            raise TypeError(f"graph emitter expects fx nodes, got {type(x).__name__}")
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(
                f"node {x.name!r} has no tensor meta['val']; the codec graph builders "
                "need it to know shape, dtype and device (run shape/fake propagation first)"
            )
        return val


def _maybe_enter(mode: Any) -> contextlib.AbstractContextManager:
    """Enter ``mode`` unless it is None or already the active fake mode."""
    if mode is None:
        return contextlib.nullcontext()
    active = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return contextlib.nullcontext() if active is mode else mode
