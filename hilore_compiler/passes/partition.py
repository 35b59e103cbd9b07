"""Partition: min-cut of a joint graph, with and without a plan applied.

``default_saved_names`` learns what Inductor's own min-cut partition saves
(the saved activations that become recovery units); ``partition_with_decisions``
tags the joint graph as a plan says and lets min-cut partition it. Both the
backend's partitioner and calibration call these, so a pass never reaches
into the backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .annotate import UnitNodes, annotate_units
from .apply import apply_decisions
from .capture import saved_output_names


def light_copy(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``joint``'s graph that shares its module and constants.

    ``copy.deepcopy`` would copy the tensor constants a joint graph holds
    (Hugging Face cache code leaves real ``_tensor_constant`` tensors there),
    which fails under Inductor's fake mode; min-cut only rewrites the graph,
    so a new graph over the same module is all it needs.
    """
    graph = fx.Graph()
    output, output_node = graph.graph_copy(joint.graph, {}, return_output_node=True)
    graph.output(output).meta = dict(output_node.meta)
    return fx.GraphModule(joint, graph)


def default_saved_names(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> set[str]:
    """Names of the forward values Inductor's default min-cut saves for backward."""
    fw, _ = min_cut_rematerialization_partition(light_copy(joint), joint_inputs, **kwargs)
    return saved_output_names(fw, kwargs["num_fwd_outputs"])


@dataclass(slots=True)
class Partition:
    """The forward and backward graphs min-cut made after a plan was applied."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    units: list[UnitNodes]
    #: How many units got each option (``store``, ``recompute``, ``compress``).
    counts: dict[str, int]


def partition_with_decisions(joint: fx.GraphModule, joint_inputs: Sequence[object],
                             decisions: Mapping[str, str], *, saved_names: set[str] | None = None,
                             prefix: str = "", **kwargs: Any) -> Partition:
    """Annotate ``joint``'s recovery units, apply ``decisions``, min-cut it.

    Units without a decision keep Inductor's own choice; callers decide what a
    mismatch means before calling (see ``apply.match_decisions``).
    """
    if saved_names is None:
        saved_names = default_saved_names(joint, joint_inputs, **kwargs)
    units = annotate_units(joint, saved_names, prefix)
    counts = apply_decisions(joint, units, decisions)
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    return Partition(fw, bw, units, counts)
