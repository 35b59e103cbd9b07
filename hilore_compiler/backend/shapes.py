"""Where a graph's batch and sequence length are read: which input, which dims.

Plans are made for a (batch, sequence) shape; a per-block compile has hidden
states where a whole model has token ids, so the input that carries the shape
is found by kind (``shape_slot``), and a dynamic graph is one whose symbolic
sizes arrive as SymInt inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_dynamic(example_inputs: Sequence[Any]) -> bool:
    """Whether dynamo made the graph dynamic: its symbolic sizes arrive as SymInt inputs."""
    return any(isinstance(x, torch.SymInt) for x in example_inputs)


def shape_slot(example_inputs: Sequence[Any]) -> int | None:
    """Index of the input whose leading dims are the graph's (batch, sequence).

    The first 2-D integer input (token ids) when there is one, else the first
    non-parameter tensor input (hidden states of a per-block compile, images
    of a CNN); None when there is no tensor input.
    """
    slots = [i for i, x in enumerate(example_inputs)
             if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) and x.dim() >= 1]
    ids = [i for i in slots if example_inputs[i].dim() == 2 and not example_inputs[i].is_floating_point()]
    return (ids or slots or [None])[0]


def shape_at(args: Sequence[Any], slot: int | None) -> tuple[int, int]:
    """(batch, sequence) of one call, read from input ``slot`` (``shape_slot``); (1, 1) without one."""
    if slot is None:
        return 1, 1
    shape = args[slot].shape
    return int(shape[0]), int(shape[1]) if len(shape) >= 2 else 1


def graph_shape(example_inputs: Sequence[Any]) -> tuple[int, int]:
    """(batch, sequence) of a graph: the plan's shape (``shape_slot``).

    For a dynamic graph these are the sizes of the call being compiled: its
    costs are measured there, and its plans hold over a range of lengths.
    """
    return shape_at(example_inputs, shape_slot(example_inputs))
