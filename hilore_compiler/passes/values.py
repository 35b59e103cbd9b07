"""The forward values of a captured joint graph, which profiling re-runs regions on.

Measured costs need real values: the forward part of the joint graph is run
once on the real inputs (or, where they cannot be matched, random stand-ins
of the same shapes) and the values a recompute region may read are kept.
Roofline costs need shapes alone: ``meta_values`` makes meta tensors from
the graph's own metadata, with nothing run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .annotate import is_backward, storage_root
from .sizes import size_hint

#: What the recorder hands nodes it does not run (tangents and backward).
_NOT_RUN = object()


class _ForwardRecorder(fx.Interpreter):
    """Runs the forward part of a joint graph once; keeps the values named in ``keep``.

    The joint graph rather than the partitioned forward: a recompute region
    may read a view that the default partition computes only in backward.
    """

    def __init__(self, joint: fx.GraphModule, keep: set[str], store: dict[str, Any]):
        super().__init__(joint)
        # A saved view's storage is what a recompute region may read instead
        # (a BatchNorm's rsqrt behind its saved squeeze): keep it too.
        nodes = {n.name: n for n in joint.graph.nodes}
        self.keep = keep | {storage_root(nodes[k]).name for k in keep if k in nodes}
        self.store = store

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "output" or is_backward(n) or any(self.env[a] is _NOT_RUN for a in n.all_input_nodes):
            return _NOT_RUN
        out = super().run_node(n)
        # Views cost no memory and let a region read "another view of a saved value".
        is_view = isinstance(n.target, torch._ops.OpOverload) and n.target.is_view
        if n.op == "placeholder" or n.name in self.keep or is_view:
            self.store[n.name] = out.detach() if isinstance(out, torch.Tensor) else out
        return out


def _matches(fake: object, real: object) -> bool:
    """Whether ``real`` can stand for the fake input ``fake``: same dtype, device and (hinted) shape."""
    if isinstance(fake, torch.Tensor):
        return (isinstance(real, torch.Tensor) and fake.dtype == real.dtype and fake.device == real.device
                and [size_hint(d) for d in fake.shape] == list(real.shape))
    return not isinstance(real, torch.Tensor)


def _stand_in(fake: object) -> object:
    """A real value shaped like ``fake``: random floats, zeros for integers
    (always a valid index), the hint of a symbolic int."""
    if isinstance(fake, torch.Tensor):
        shape = [size_hint(d) for d in fake.shape]
        if fake.is_floating_point():
            return torch.randn(shape, dtype=fake.dtype, device=fake.device)
        return torch.zeros(shape, dtype=fake.dtype, device=fake.device)
    return size_hint(fake) if isinstance(fake, torch.SymInt) else fake


def primal_values(primals: Sequence[object], real_args: Sequence[object] | None) -> tuple[list[object], bool]:
    """Real values for the joint graph's primal inputs, and whether they are stand-ins.

    AOTAutograd's primals are the module's lifted parameters and buffers
    followed by the dynamo graph's inputs, unless it deduplicated or merged
    aliased inputs; then (or without ``real_args``) random stand-ins of the
    right shapes are used, which time the same and only shift codec errors.
    """
    if real_args is not None and len(real_args) == len(primals) and all(map(_matches, primals, real_args)):
        return [a.detach() if isinstance(a, torch.Tensor) else size_hint(a) if isinstance(a, torch.SymInt) else a
                for a in real_args], False
    return [_stand_in(p) for p in primals], True


def record_forward_values(joint: fx.GraphModule, joint_inputs: Sequence[object],
                          real_args: Sequence[object] | None, keep: set[str]) -> tuple[dict[str, Any], bool]:
    """Run ``joint``'s forward once and return the values of ``keep`` (saved names), their
    storage, views and graph inputs, and whether the inputs were random stand-ins
    (``primal_values``): enough to re-run any recompute region."""
    values: dict[str, Any] = {}
    # The partitioner runs under Inductor's fake mode: real values need it off.
    with unset_fake_temporarily(), torch.no_grad():
        primals, synthetic = primal_values(joint_inputs[0], real_args)
        tangents = [_NOT_RUN] * len(joint_inputs[1])
        _ForwardRecorder(joint, keep, values).run(*primals, *tangents, enable_io_processing=False)
    return values, synthetic


def meta_values(joint: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like each forward value of ``joint`` (symbolic
    sizes at their hints): what roofline costs read, with nothing run.

    A graph of fake CUDA tensors cannot be run on this machine, and a meta
    one need not be: roofline costs and synthetic codec errors need shapes
    and dtypes only.
    """
    values = {}
    for node in joint.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and not is_backward(node):
            values[node.name] = torch.empty_strided([size_hint(d) for d in val.shape],
                                                    [size_hint(d) for d in val.stride()],
                                                    dtype=val.dtype, device="meta")
        elif isinstance(val, torch.SymInt):
            values[node.name] = size_hint(val)
    return values
