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

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..jsonio import FormatError
from ..passes.annotate import op_name
from ..passes.apply import PlanMismatchError
from ..passes.capture import light_copy
from ..planfile import Plan
from .matching import default_bucket
from .cache import StaleCacheError
from .lengths import PlanShapeError
from .options import BackendOptions
from .partitioner import PartitionRecord, PlanPartitioner
from .planning import GraphPlanner
from .report import HiLoReWarning, fall_back, say
from .variants import VariantTable, compile_variant as _compile_variant


@dataclass(slots=True)
class CompiledGraph:
    """What the backend made of one dynamo graph, kept for inspection."""

    #: The compiled call's plan; None when nothing was planned (no backward,
    #: nothing saved, or a fallback).
    plan: Plan | None
    variants: dict[str, Callable[..., Any]]
    #: Bucket name -> the variant that runs it under ``plan``.
    variant_of: dict[str, str]
    records: list[PartitionRecord]
    compile_seconds: float
    default_bucket: str
    #: Every length bucket's plan, shortest first (a static graph: ``plan`` alone).
    plans: tuple[Plan, ...] = ()
    #: (index in ``plans``, bucket name) -> the variant that runs it.
    length_variant_of: dict[tuple[int, str], str] = field(default_factory=dict)
    #: A dynamic graph's re-solves for calls outside its planned lengths.
    resolves: int = 0
    #: Where the plans came from; ``planner.seq_range`` is what they hold for now.
    planner: GraphPlanner | None = None

    def ceiling_at(self, batch: int, seq_len: int) -> int | None:
        """The memory ceiling the options set at this shape, in bytes (None: no trace at hand)."""
        return self.planner.ceiling_at(batch, seq_len) if self.planner else None

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
            return self._plan_and_compile(gm, example_inputs)
        except PlanShapeError as error:  # a plan for other shapes, nothing to re-solve from: Inductor runs it
            fall_back(self.options, error, "this graph")
            return _compile_variant(gm, example_inputs, None)
        except (PlanMismatchError, FormatError):
            raise  # a plan the user gave that does not fit: their input, their error
        except Exception as error:  # planning never stops training: see fall_back
            cause = _untraceable_cause(error)
            if cause is not None:
                _say_untraceable(cause, gm)
                raise  # as for plain Inductor: dynamo breaks the graph there and runs that part eagerly
            if self.options.strict or _is_dynamo_control_flow(error):
                raise
            fall_back(self.options, RuntimeError(f"compiling with the plan failed ({type(error).__name__}: "
                                                 f"{error})"), "this graph")
            return _compile_variant(gm, example_inputs, None)

    def _plan_and_compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """Plan and compile; a cached plan or trace that does not fit the graph is moved
        aside (said once) and the graph planned afresh, as is one of rank 0's (planned on
        this rank alone): nothing in the cache or from another rank stops training."""
        planner, options = GraphPlanner(gm, example_inputs, self.options), self.options
        try:
            return self._compile(planner, gm, example_inputs)
        except Exception as error:
            stale = _cause(error, StaleCacheError)
            if stale is not None and planner.source == "rank 0":
                warnings.warn(f"hilore: rank 0's plan does not fit this graph here ({stale}); this rank plans "
                              "it on its own", HiLoReWarning, stacklevel=3)
                options = dataclasses.replace(options, share_plans=False)
            elif stale is not None and planner.cache is not None:
                planner.cache.discard(stale)
            else:
                if not _is_dynamo_control_flow(error):  # dynamo compiles this frame again, planning anew
                    planner.publish_failure(error)  # the ranks waiting for this graph plan on their own
                raise
        return self._compile(GraphPlanner(gm, example_inputs, options), gm, example_inputs)

    def _compile(self, planner: GraphPlanner, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        records: list[PartitionRecord] = []
        first = PlanPartitioner(planner, None, None, records)
        compiled_first = _compile_variant(gm, example_inputs, first)
        if first.keyed_by_cache and first.plan_used is None and not records:
            # Inductor served a graph partitioned for a plan hilore's cache no
            # longer holds (its folder cleared, Inductor's kept): plan afresh.
            first = PlanPartitioner(planner, None, None, records, fresh=True)
            compiled_first = _compile_variant(gm, example_inputs, first)
        plan = first.plan_used
        if plan is None or first.bucket_used is None and records:
            # Nothing planned (no backward, nothing saved, or a fallback).
            compiled = CompiledGraph(None, {"inductor": compiled_first}, {}, records,
                                     time.perf_counter() - start, "inductor")
            self.graphs.append(compiled)
            return compiled_first
        planner.publish()  # cached plans go to the other ranks once they compiled (they could be stale)
        default = first.bucket_used or default_bucket(plan)
        compiled = CompiledGraph(plan, {default: compiled_first}, {}, records, 0.0, default, planner=planner)
        table = VariantTable(compiled, gm, example_inputs, planner, records)
        table.seed(plan, default, compiled_first)
        table.compile_all()
        compiled.compile_seconds = time.perf_counter() - start
        say(self.options, compile_breakdown(compiled.compile_seconds, planner.seconds, len(compiled.variants)))
        self.graphs.append(compiled)
        return table.dispatcher()


def compile_breakdown(total_s: float, phases: Mapping[str, float], variants: int) -> str:
    """Where one graph's compile went: hilore's phases, and Inductor's share (the rest)."""
    planned = sum(phases.values())
    parts = [f"{name} {seconds:.1f} s" for name, seconds in phases.items() if seconds >= 0.05]
    inductor = max(total_s - planned, 0.0)
    return (f"compiled this graph in {total_s:.1f} s: " + ", ".join([*parts, f"Inductor {inductor:.1f} s"])
            + f" ({variants} variant{'s' if variants != 1 else ''})")


def _cause(error: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    """The ``kind`` exception in ``error``'s chain of causes (Inductor may wrap it), or None."""
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, kind):
        seen = seen.__cause__ or seen.__context__
    return seen


def _is_dynamo_control_flow(error: Exception) -> bool:
    """Exceptions dynamo raises through backends to restart or skip a frame."""
    from torch._dynamo import exc

    return isinstance(error, (exc.RestartAnalysis, exc.SkipFrame))


def _untraceable_cause(error: BaseException) -> BaseException | None:
    """The error in ``error``'s chain that no backend gets past, or None: the model's own
    code reads tensor values (``.item()``, ``.tolist()``) or makes shapes from them, so
    AOTAutograd cannot trace the graph, with hilore's partitioner or Inductor's."""
    from torch._dynamo import exc

    kinds = getattr(exc, "exceptions_allowed_to_be_fallback", ())
    return _cause(error, kinds) if kinds else None


#: Ops whose output depends on tensor values (and grouped matmuls, whose backward in
#: transformers' MoE reads the group sizes): the warning names the first as the likely place.
_DATA_DEPENDENT_OPS = frozenset({"item", "tolist", "nonzero", "_local_scalar_dense", "unique", "bincount", "histc",
                                 "masked_select", "repeat_interleave"})

#: The causes already said in this process: one warning each.
_SAID_UNTRACEABLE: set[str] = set()


def _say_untraceable(cause: BaseException, gm: fx.GraphModule) -> None:
    """Warn once per cause (``_untraceable_cause``) that the model's own code, not planning,
    keeps this graph from compiling."""
    what = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    if what in _SAID_UNTRACEABLE:
        return
    _SAID_UNTRACEABLE.add(what)
    where = ""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    names = {n: op_name(n) for n in calls}
    for node in sorted(calls, key=lambda n: "grouped_mm" not in names[n]):  # grouped matmuls first
        if "grouped_mm" in names[node] or names[node] in _DATA_DEPENDENT_OPS:
            frames = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()
                      if line.strip().startswith("File ")]
            where = f" near `{names[node]}`" + (f" ({frames[-1]})" if frames else "")
            break
    warnings.warn(f"hilore: the model's own code reads tensor values while this graph is traced ({what}){where}; "
                  "no compiler can trace that, so dynamo breaks the graph there and runs that part eagerly, as it "
                  "does for plain Inductor. This is not a planning failure: the rest of the model is planned",
                  HiLoReWarning, stacklevel=3)


def _has_partitioner_hook() -> bool:
    import torch._inductor.config as inductor_config

    return hasattr(inductor_config, "custom_partitioner_fn")


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
