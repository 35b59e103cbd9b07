"""The ``hilore`` torch.compile backend: one Inductor variant per exposure bucket.

``torch.compile(model, backend="hilore", options={...})`` resolves here through
the ``torch_dynamo_backends`` entry point. For each dynamo graph the backend
gets a plan (given, cached, or made now: trace, profile, solve), compiles the
graph once per distinct bucket plan with Inductor and a ``PlanPartitioner``,
and returns a callable that runs the variant of the current
``exposure(bucket)``. One dynamo graph, no recompiles, autograd intact.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from .partitioner import PartitionRecord, PlanPartitioner
from ..planfile import Plan
from .options import BackendOptions
from .runtime import current_bucket



@dataclass(slots=True)
class CompiledGraph:
    """What the backend made of one dynamo graph, kept for inspection."""

    plan: Plan
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
        from .planning import plan_for_graph

        start = time.perf_counter()
        plan, trace = plan_for_graph(gm, example_inputs, self.options)
        records: list[PartitionRecord] = []
        variants, variant_of, by_digest = {}, {}, {}
        for bucket in plan.buckets:
            if bucket.skip:
                continue
            name, decisions = bucket.bucket.name, dict(bucket.decisions)
            digest = _digest(plan.fingerprint, decisions)
            if digest not in by_digest:
                # Buckets with identical decisions share one compiled variant.
                by_digest[digest] = name
                partitioner = PlanPartitioner(name, decisions, digest, records)
                variants[name] = _compile_variant(gm, example_inputs, partitioner)
            variant_of[name] = by_digest[digest]
        solved = [b for b in plan.buckets if not b.skip]
        default = max(solved, key=lambda b: b.bucket.exposure).bucket.name
        for bucket in plan.buckets:
            # The skip bucket (and any without a variant) runs the default's.
            variant_of.setdefault(bucket.bucket.name, variant_of[default])
        compiled = CompiledGraph(plan, variants, variant_of, records, time.perf_counter() - start, default)
        self.graphs.append(compiled)
        return _dispatcher(compiled)


def _digest(fingerprint: str, decisions: Mapping[str, str]) -> str:
    text = fingerprint + "".join(f"{k}={v};" for k, v in sorted(decisions.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _compile_variant(gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: PlanPartitioner):
    from torch._inductor.compile_fx import compile_fx

    # compile_fx traces the module again; a copy keeps variants independent.
    return compile_fx(copy.deepcopy(gm), list(example_inputs),
                      config_patches={"custom_partitioner_fn": partitioner})


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
    del LAST_BACKENDS[:-8]
    return backend(gm, example_inputs)


#: The most recent backends made by name, for inspection in notebooks and tests.
LAST_BACKENDS: list[HiLoReBackend] = []
