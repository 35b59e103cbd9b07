"""Partition: min-cut of a joint graph after a plan's decisions are applied.

The backend's partitioner and calibration both call ``partition_with_decisions``,
so a pass never reaches into the backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition

from .annotate import UnitNodes, annotate_units
from .apply import apply_decisions
from .capture import default_partition, merge_duplicates


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
                             **kwargs: Any) -> Partition:
    """Annotate ``joint``'s recovery units, apply ``decisions``, min-cut it.

    ``saved_names``: the default partition's saved values when the caller
    knows them already (they define the units); otherwise min-cut runs once
    more on a light copy to learn them.
    """
    merge_duplicates(joint)
    if saved_names is None:
        saved_names = default_partition(joint, joint_inputs, **kwargs)[2]
    units = annotate_units(joint, saved_names)
    counts = apply_decisions(joint, units, decisions)
    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    return Partition(fw, bw, units, counts)
