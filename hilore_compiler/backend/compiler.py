"""The ``hilore`` torch.compile backend: one Inductor variant per exposure bucket.

``torch.compile(model, backend="hilore", options={...})`` resolves here through
the ``torch_dynamo_backends`` entry point. For each dynamo graph the backend
compiles with Inductor and a ``PlanPartitioner``, which gets the plan from a
``GraphPlanner`` (given, cached, or made on the joint graph in that call),
then compiles the graph again for each other distinct bucket plan, and
returns a callable that runs the variant of the current ``exposure(bucket)``.
One dynamo graph, no recompiles, autograd intact. A graph that cannot be
planned is compiled by plain Inductor, with a warning (``strict`` raises).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..jsonio import FormatError
from ..passes.apply import PlanMismatchError
from ..passes.capture import light_copy
from ..planfile import Plan
from .matching import default_bucket
from .options import BackendOptions
from .partitioner import PartitionRecord, PlanPartitioner
from .planning import DynamicShapeError, GraphPlanner, fall_back
from .runtime import current_bucket


@dataclass(slots=True)
class CompiledGraph:
    """What the backend made of one dynamo graph, kept for inspection."""

    #: None when nothing was planned (no backward, nothing saved, or a fallback).
    plan: Plan | None
    variants: dict[str, Callable[..., Any]]
    #: Bucket name -> the bucket whose identical decisions it shares a variant with.
    variant_of: dict[str, str]
    records: list[PartitionRecord]
    compile_seconds: float
    default_bucket: str

    def predicted_saved_bytes(self, bucket: str) -> int:
        return self.plan.bucket(self.variant_of[bucket]).kept_bytes

    def actual_saved_bytes(self, bucket: str) -> int | None:
        """Bytes the compiled forward saves, or None when Inductor's cache
        served the variant (the partitioner did not run in this process)."""
        source = self.variant_of[bucket]
        return next((r.saved_bytes for r in self.records if r.bucket == source), None)


class HiLoReBackend:
    """A dynamo backend object; ``graphs`` keeps what each compile did."""

    def __init__(self, options: Mapping[str, Any] | BackendOptions | None = None):
        self.options = options if isinstance(options, BackendOptions) else BackendOptions.from_mapping(options)
        self.graphs: list[CompiledGraph] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if not _has_partitioner_hook():
            fall_back(self.options, RuntimeError(
                f"torch {torch.__version__} has no custom partitioner hook (hilore needs torch >= 2.9)"), "every graph")
            return _compile_variant(gm, example_inputs, None)
        try:
            planner = GraphPlanner(gm, example_inputs, self.options)
        except DynamicShapeError as error:
            fall_back(self.options, error, "this dynamic graph")
            return _compile_variant(gm, example_inputs, None)
        try:
            return self._compile(planner, gm, example_inputs)
        except (PlanMismatchError, FormatError):
            raise  # a plan the user gave that does not fit: their input, their error
        except Exception as error:  # planning never stops training: see fall_back
            if self.options.strict or _is_dynamo_control_flow(error):
                raise
            fall_back(self.options, RuntimeError(f"compiling with the plan failed ({type(error).__name__}: "
                                                 f"{error})"), "this graph")
            return _compile_variant(gm, example_inputs, None)

    def _compile(self, planner: GraphPlanner, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        records: list[PartitionRecord] = []
        first = PlanPartitioner(planner, None, records)
        compiled_first = _compile_variant(gm, example_inputs, first)
        plan = planner.plan
        if plan is None or first.bucket_used is None and records:
            # Nothing planned (no backward, nothing saved, or a fallback).
            compiled = CompiledGraph(None, {"inductor": compiled_first}, {}, records,
                                     time.perf_counter() - start, "inductor")
            self.graphs.append(compiled)
            return compiled_first
        default = first.bucket_used or default_bucket(plan)
        variants, variant_of, by_decisions = {default: compiled_first}, {}, {}
        by_decisions[tuple(plan.bucket(default).decisions)] = default
        for bucket in plan.buckets:
            if bucket.skip:
                continue
            name, decisions = bucket.bucket.name, tuple(bucket.decisions)
            if decisions not in by_decisions:
                # Buckets with identical decisions share one compiled variant.
                by_decisions[decisions] = name
                variants[name] = _compile_variant(gm, example_inputs, PlanPartitioner(planner, name, records))
            variant_of[name] = by_decisions[decisions]
        for bucket in plan.buckets:
            # The skip bucket (and any without a variant) runs the default's.
            variant_of.setdefault(bucket.bucket.name, variant_of[default])
        compiled = CompiledGraph(plan, variants, variant_of, records, time.perf_counter() - start, default)
        self.graphs.append(compiled)
        return _dispatcher(compiled)


def _is_dynamo_control_flow(error: Exception) -> bool:
    """Exceptions dynamo raises through backends to restart or skip a frame."""
    from torch._dynamo import exc

    return isinstance(error, (exc.RestartAnalysis, exc.SkipFrame))


def _has_partitioner_hook() -> bool:
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, "custom_partitioner_fn")


def _compile_variant(gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: PlanPartitioner | None):
    from torch._inductor.compile_fx import compile_fx

    patches = {} if partitioner is None else {"custom_partitioner_fn": partitioner}
    # compile_fx may rewrite the graph it is given: each variant gets its own
    # graph, over the very parameters and constants of ``gm`` (light_copy).
    return compile_fx(light_copy(gm), list(example_inputs), config_patches=patches)


def _dispatcher(compiled: CompiledGraph) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        bucket = current_bucket() or compiled.default_bucket
        try:
            source = compiled.variant_of[bucket]
        except KeyError:
            raise KeyError(
                f"exposure bucket {bucket!r} is not in the plan; buckets: {list(compiled.variant_of)}"
            ) from None
        return compiled.variants[source](*args)
    return run


def hilore_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Mapping[str, Any] | None = None,
                   mode: str | None = None) -> Callable[..., Any]:
    """The ``"hilore"`` backend as torch.compile calls it by name."""
    backend = HiLoReBackend(options)
    LAST_BACKENDS.append(backend)
    del LAST_BACKENDS[:-LAST_BACKENDS_KEPT]
    return backend(gm, example_inputs)


#: How many backends made by name ``LAST_BACKENDS`` keeps: enough for a model
#: with a few graph breaks, few enough that old compiles' graphs are freed.
LAST_BACKENDS_KEPT = 8

#: The most recent backends made by name, for inspection in notebooks and tests.
LAST_BACKENDS: list[HiLoReBackend] = []
