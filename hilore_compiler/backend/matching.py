"""Matching a plan's decisions to the recovery units of one joint graph.

Plans name units by stable keys. A model with graph breaks has a plan whose
keys carry a graph prefix (``g1/``, ``g2/``, ...); each dynamo graph takes the
prefix whose keys it holds. Units without a decision keep Inductor's own
choice, plan units not in the graph are ignored; the caller says so (or
raises under ``strict``). A plan whose unit sizes disagree with the graph's
for most of the units it shares was made for another model and is refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx as fx

from ..passes.annotate import UnitNodes, distinct_storage
from ..passes.apply import PlanMismatchError
from ..passes.sizes import size_hint
from ..planfile import Plan

_PREFIX = re.compile(r"^(g\d+/)")


@dataclass(frozen=True, slots=True)
class GraphDecisions:
    """One bucket's decisions for the units of one graph, and what did not match."""

    bucket: str | None
    decisions: dict[str, str] = field(default_factory=dict)
    #: Plan units (of the chosen graph prefix) that are not in this graph.
    unknown: tuple[str, ...] = ()
    #: Units of this graph the plan has no decision for.
    missing: tuple[str, ...] = ()

    @classmethod
    def none(cls) -> GraphDecisions:
        """No plan: every unit keeps Inductor's own choice."""
        return cls(bucket=None)

    def mismatch_message(self) -> str:
        return (f"the plan does not match this graph: {len(self.unknown)} plan units are not in the "
                f"graph (e.g. {list(self.unknown[:3])}), {len(self.missing)} graph units have no "
                f"decision (e.g. {list(self.missing[:3])}). Make the plan from a trace of this model "
                "(hilore trace, then hilore plan)")


def default_bucket(plan: Plan) -> str:
    """The bucket that runs outside any ``exposure`` block: the most exposed one."""
    solved = [b for b in plan.buckets if not b.skip]
    if not solved:
        raise PlanMismatchError("the plan has no bucket with decisions (only 'zero' or none): re-run hilore plan")
    return max(solved, key=lambda b: b.bucket.exposure).bucket.name


def _split(key: str) -> tuple[str, str]:
    match = _PREFIX.match(key)
    return (match.group(1), key[match.end():]) if match else ("", key)


def unit_nbytes(unit: UnitNodes) -> int:
    """Bytes of a unit's saved memory in this graph (a dynamic graph's: at the compiled call's sizes)."""
    return nodes_nbytes(unit.saved)


def nodes_nbytes(nodes: Iterable[fx.Node]) -> int:
    """Bytes of the memory ``nodes`` hold, each storage once.

    Symbolic sizes count at their hints, read without adding a shape guard
    (``int()`` of a SymInt would specialise the graph to this size).
    """
    total = 0
    for node in distinct_storage(nodes):
        val = node.meta["val"]
        total += math.prod(size_hint(d) for d in val.shape) * val.element_size()
    return total


def match_plan(plan: Plan, bucket: str | None, units: list[UnitNodes], batch: int, seq_len: int) -> GraphDecisions:
    """``bucket``'s decisions (None: the default bucket) for ``units``."""
    bucket = bucket or default_bucket(plan)
    by_prefix: dict[str, dict[str, str]] = {}
    for key, option in plan.bucket(bucket).decisions:
        prefix, rest = _split(key)
        by_prefix.setdefault(prefix, {})[rest] = option
    graph = {u.key: u for u in units}
    # The graph's prefix: the one sharing most keys with it ("" first on ties).
    prefix = max(sorted(by_prefix), key=lambda p: len(graph.keys() & by_prefix[p].keys()), default="")
    planned = by_prefix.get(prefix, {})
    shared = sorted(graph.keys() & planned.keys())
    if graph and planned and 2 * len(shared) < min(len(graph), len(planned)):
        # Not even half the units in common: a plan for another model, not a partial fit.
        raise PlanMismatchError(GraphDecisions(bucket, {}, tuple(sorted(planned)), tuple(sorted(graph)))
                                .mismatch_message())
    if (plan.batch, plan.seq_len) == (batch, seq_len):
        shared = _same_sizes(plan, prefix, shared, graph)
    return GraphDecisions(
        bucket=bucket,
        decisions={k: planned[k] for k in shared},
        unknown=tuple(prefix + k for k in sorted(planned.keys() - graph.keys())),
        missing=tuple(sorted(graph.keys() - set(shared))),
    )


#: How far a fused attention unit's bytes may differ between the device a plan
#: was made on and the graph's: kernels save the same output but their own
#: bookkeeping beside it (CUDA's flash and memory-efficient kernels an RNG
#: seed and offset, memory-efficient a log-sum-exp padded to 32 rows, the
#: CPU's neither). At head size 16 the log-sum-exp is 1/17 of the unit in
#: fp32 and 1/9 in bf16, and padding at most doubles it from 32 rows on: 1/4
#: lets that through and still refuses a unit of another width (head sizes
#: change by 2x).
ATTENTION_SIZE_SLACK = 0.25


def sizes_agree(planned: int, actual: int, key: str) -> bool:
    """Whether a plan's unit and the graph's are one tensor: equal bytes, or
    for fused attention (key op ``sdpa``) within ``ATTENTION_SIZE_SLACK``."""
    if planned == actual:
        return True
    return key.rsplit(":", 2)[-2] == "sdpa" and abs(planned - actual) <= ATTENTION_SIZE_SLACK * max(planned, actual)


def _same_sizes(plan: Plan, prefix: str, shared: list[str], graph: dict[str, UnitNodes]) -> list[str]:
    """The shared keys whose sizes agree; refuses a plan for another model."""
    planned = {u.key: u.bytes for u in plan.units}
    actual = {k: unit_nbytes(graph[k]) for k in shared}
    differ = [k for k in shared if not sizes_agree(planned.get(prefix + k, actual[k]), actual[k], k)]
    if shared and len(differ) * 2 >= len(shared):
        key = differ[0]
        raise PlanMismatchError(
            f"the plan was made for another model: {len(differ)} of the {len(shared)} units it shares with "
            f"this graph differ in size (e.g. {prefix + key}: {planned[prefix + key]} bytes in the plan, "
            f"{actual[key]} in this graph). Make the plan from a trace of this model"
        )
    differing = set(differ)
    return [k for k in shared if k not in differing]
