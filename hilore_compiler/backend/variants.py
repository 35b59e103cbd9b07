"""The compiled variants of one dynamo graph and the callable that picks one per call.

A variant is the graph compiled by Inductor with one set of decisions. Each
(length bucket, exposure bucket) runs one; (length, exposure) pairs with
identical decisions share it. The dispatcher reads the current
``exposure(bucket)`` and, for a dynamic graph, the call's batch and sequence
from its inputs, so switching buckets or lengths never recompiles in dynamo.

A dynamic graph that meets a call outside the lengths its plans hold for
re-solves them from the trace (``GraphPlanner.plans_for``) and compiles the
variants whose decisions are new right there, inside the tracing context
dynamo compiled the graph in (as AOTAutograd compiles a lazy backward), so
the new variant takes the same symbolic inputs and guards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..passes.capture import light_copy
from ..planfile import Plan
from .matching import default_bucket
from .partitioner import PartitionRecord, PlanPartitioner
from .planning import GraphPlanner
from .report import HiLoReWarning
from .runtime import current_bucket
from .shapes import shape_at

if TYPE_CHECKING:
    from .compiler import CompiledGraph


def compile_variant(gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: PlanPartitioner | None):
    """``gm`` compiled by Inductor, partitioned by ``partitioner`` (None: Inductor's own)."""
    from torch._inductor.compile_fx import compile_fx

    patches = {} if partitioner is None else {"custom_partitioner_fn": partitioner}
    # compile_fx may rewrite the graph it is given: each variant gets its own
    # graph, over the very parameters and constants of ``gm`` (light_copy).
    return compile_fx(light_copy(gm), list(example_inputs), config_patches=patches)


class VariantTable:
    """The variants of one graph, by decisions, and which runs each (length, exposure) bucket."""

    def __init__(self, compiled: CompiledGraph, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 planner: GraphPlanner, records: list[PartitionRecord]) -> None:
        self.compiled, self.gm, self.planner, self.records = compiled, gm, planner, records
        self.example_inputs = list(example_inputs)
        self.by_decisions: dict[tuple, str] = {}
        # What a variant compiled after dynamo returned needs: the tracing
        # context (fake mode, shape env, symbolic inputs) and the grad mode.
        from torch._guards import CompileContext, TracingContext

        self._tracing = TracingContext.try_get()
        self._compile_context = CompileContext.try_get()
        self._grad = torch.is_grad_enabled()
        self._warned = False

    def seed(self, plan: Plan, bucket: str, variant: Callable[..., Any]) -> None:
        """Register the variant already compiled for ``plan``'s ``bucket``."""
        self.by_decisions[tuple(plan.bucket(bucket).decisions)] = bucket
        self.compiled.variants[bucket] = variant

    def compile_all(self, *, late: bool = False) -> None:
        """Map every (length bucket, exposure bucket) to a variant, compiling the new decisions."""
        compiled, plans = self.compiled, self.planner.plans
        compiled.plans = plans
        compiled.length_variant_of = {}
        for index, plan in enumerate(plans):
            default = default_bucket(plan)
            for bucket in plan.buckets:
                if bucket.skip:
                    continue
                name = bucket.bucket.name
                decisions = tuple(bucket.decisions)
                if decisions not in self.by_decisions:
                    variant = name if index == 0 and name not in compiled.variants else _variant_name(plan, name)
                    self.by_decisions[decisions] = variant
                    partitioner = PlanPartitioner(self.planner, plan, name, self.records)
                    compiled.variants[variant] = self._compile(partitioner, late)
                compiled.length_variant_of[index, name] = self.by_decisions[decisions]
            for bucket in plan.buckets:
                # The skip bucket (and any without a variant) runs the default's.
                compiled.length_variant_of.setdefault((index, bucket.bucket.name),
                                                      compiled.length_variant_of[index, default])
        current = self.planner.plan
        here = next((i for i, p in enumerate(plans) if p is current), len(plans) - 1)
        compiled.plan = plans[here]
        compiled.variant_of = {name: v for (i, name), v in compiled.length_variant_of.items() if i == here}

    def _compile(self, partitioner: PlanPartitioner, late: bool) -> Callable[..., Any]:
        if not late:
            return compile_variant(self.gm, self.example_inputs, partitioner)
        from torch._guards import compile_context, tracing

        with compile_context(self._compile_context), tracing(self._tracing), torch.set_grad_enabled(self._grad):
            return compile_variant(self.gm, self.example_inputs, partitioner)

    def resolve(self, batch: int, seq_len: int) -> None:
        """Re-solve for a call outside the planned shapes and compile what is new.

        A failure keeps the plans that were (said once): planning never stops training.
        """
        try:
            if self.planner.plans_for(batch, seq_len):
                self.compile_all(late=True)
                self.compiled.resolves += 1
        except Exception as error:  # planning never stops training
            if self.planner.options.strict:
                raise
            self.planner.keep_plans(batch, seq_len)
            if not self._warned:
                self._warned = True
                warnings.warn(f"hilore: could not re-plan for batch {batch}, sequence {seq_len} "
                              f"({type(error).__name__}: {error}); such calls run the longest length "
                              "bucket's plan", HiLoReWarning, stacklevel=3)

    def dispatcher(self) -> Callable[..., Any]:
        """The callable dynamo runs: the variant of the current exposure bucket and length."""
        compiled, planner = self.compiled, self.planner
        dynamic, slot = planner.dynamic, planner.slot

        def run(*args: Any) -> Any:
            bucket = current_bucket() or compiled.default_bucket
            index = 0
            if dynamic:
                batch, seq_len = shape_at(args, slot)
                lo, hi = planner.seq_range
                if batch > planner.planned_batch or not lo <= seq_len <= hi:
                    self.resolve(batch, seq_len)
                index = next((i for i, p in enumerate(compiled.plans) if p.covers(seq_len)), len(compiled.plans) - 1)
            try:
                source = compiled.length_variant_of[index, bucket]
            except KeyError:
                raise KeyError(f"exposure bucket {bucket!r} is not in the plan; buckets: "
                               f"{sorted({b for _, b in compiled.length_variant_of})}") from None
            return compiled.variants[source](*args)
        return run


def _variant_name(plan: Plan, bucket: str) -> str:
    """A variant's name: its bucket, and its length range where that tells it apart."""
    lo, hi = plan.length_range
    return f"{bucket}@{lo}-{hi}"

