"""The partitioner Inductor calls: apply one bucket's decisions, then min-cut.

Handed to Inductor through ``compile_fx(..., config_patches=
{"custom_partitioner_fn": PlanPartitioner(...)})``, so all of Inductor's
joint-graph passes and codegen stay as they are and no global config changes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from ..passes.annotate import UnitNodes, annotate_units, is_activation
from ..passes.apply import apply_decisions
from ..passes.capture import saved_output_names


@dataclass(slots=True)
class PartitionRecord:
    """What one partitioner call did, kept for inspection."""

    bucket: str
    units: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    #: Bytes of the tensors the partitioned forward graph saves for backward.
    saved_bytes: int = 0
    default_saved_bytes: int = 0
    #: FLOPs of the partitioned backward graph (recomputed matmuls included).
    backward_flops: int = 0
    seconds: float = 0.0


def saved_tensor_bytes(fw: fx.GraphModule, num_fwd_outputs: int, joint: fx.GraphModule) -> int:
    """Bytes of the activations a forward graph hands to backward.

    Graph inputs and values hoisted from backward (``is_activation`` false in
    the joint graph) are not counted: no plan changes them.
    """
    saved = saved_output_names(fw, num_fwd_outputs)
    total = 0
    for node in joint.graph.nodes:
        if node.name in saved and is_activation(node):
            total += node.meta["val"].numel() * node.meta["val"].element_size()
    return total


def graph_flops(gm: fx.GraphModule) -> int:
    """FLOPs of one run of ``gm``, from its nodes' shapes (nothing is run).

    Uses FlopCounterMode's formulas per op; an op replayed with its forward
    RNG state (``run_with_rng_state``) counts as the op it wraps.
    """
    from torch.utils._pytree import tree_map_only
    from torch.utils.flop_counter import flop_registry

    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target, args = node.target, node.args
        if target is getattr(torch.ops.higher_order, "run_with_rng_state", None):
            target, args = args[1], args[2:]
        formula = flop_registry.get(getattr(target, "overloadpacket", None))
        if formula is None:
            continue
        vals, kwargs = tree_map_only(fx.Node, lambda n: n.meta["val"], (args, node.kwargs))
        out = node.meta["val"]
        total += formula(*vals, **kwargs, out_val=out)
    return total


def default_units(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> tuple[list[UnitNodes], int]:
    """Recovery units of ``joint`` as the default min-cut partition saves them."""
    fw, _ = min_cut_rematerialization_partition(copy.deepcopy(joint), joint_inputs, **kwargs)
    saved = saved_output_names(fw, kwargs["num_fwd_outputs"])
    return annotate_units(joint, saved), saved_tensor_bytes(fw, kwargs["num_fwd_outputs"], joint)


class PlanPartitioner(CustomPartitionerFn):
    """Min-cut partition of the joint graph after one bucket's plan is applied.

    ``decisions`` maps unit keys to options; a graph whose units differ from
    the plan's is refused by ``apply_decisions`` (``PlanMismatchError``),
    never partitioned by guess.
    """

    def __init__(self, bucket: str, decisions: Mapping[str, str],
                 plan_digest: str, records: list[PartitionRecord]):
        self.bucket, self.decisions = bucket, dict(decisions)
        self.plan_digest, self.records = plan_digest, records

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        start = time.perf_counter()
        record = PartitionRecord(bucket=self.bucket)
        units, record.default_saved_bytes = default_units(gm, joint_inputs, **kwargs)
        record.units, record.counts = len(units), apply_decisions(gm, units, self.decisions)
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        record.saved_bytes = saved_tensor_bytes(fw, kwargs["num_fwd_outputs"], gm)
        record.backward_flops = graph_flops(bw)
        record.seconds = time.perf_counter() - start
        self.records.append(record)
        return fw, bw

    def __deepcopy__(self, memo: dict) -> PlanPartitioner:
        # Inductor deep-copies its config (this object included) to key its
        # cache; the partitioner is a function object whose records are an
        # out-channel, so the copy must be the object itself.
        return self

    def uuid(self) -> str:
        # Inductor's FX graph cache keys on this: it changes with the plan and
        # bucket, or a cached graph of another plan would be served.
        payload = json.dumps([self.plan_digest, self.bucket, __file__], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()
