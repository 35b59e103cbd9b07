"""Where a graph's plan comes from: given, cached, or made on the joint graph.

One graph, one truth: a zero-config plan is made inside Inductor's
partitioner call, on the very joint graph that is then partitioned (trace,
profile, solve, apply), so the units planned are the units applied. The plan
and its trace are cached on disk under a key of the graph's code, input
shapes and the planning options, so the next process starts from the plan
(``PlanCache``). A given plan is matched to the graph's units by key
(``matching``); a plan made for another shape is re-solved from its trace.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..passes.annotate import UnitNodes, annotate_units
from ..passes.apply import PlanMismatchError
from ..passes.capture import GraphCapture, capture_joint, lifted_args
from ..planfile import Plan, load_plan
from ..tracefile import Trace, load_trace
from .cache import PlanCache
from .matching import GraphDecisions, match_plan
from .options import BackendOptions

#: Bumped when traces or plans made by older code must not be reused.
CACHE_VERSION = "2"


class HiLoReWarning(UserWarning):
    """The backend fell back to Inductor's own choice for something it could not plan."""


class DynamicShapeError(ValueError):
    """Dynamo made the graph dynamic; plans are per static shape."""


def graph_shape(example_inputs: Sequence[Any]) -> tuple[int, int]:
    """(batch, sequence) of a graph: the plan's shape.

    The first 2-D integer input (token ids) when there is one, else the first
    two dims of the first non-parameter tensor input (hidden states of a
    per-block compile, images of a CNN), else (1, 1). Refuses dynamic graphs.
    """
    if any(isinstance(x, torch.SymInt) for x in example_inputs):
        raise DynamicShapeError(
            "hilore plans per static shape, but dynamo made this graph dynamic after seeing "
            "a second shape: compile with torch.compile(model, backend='hilore', dynamic=False)"
        )
    inputs = [x for x in example_inputs if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)]
    for x in inputs:
        if x.dim() == 2 and not x.is_floating_point():
            return int(x.shape[0]), int(x.shape[1])
    for x in inputs:
        if x.dim() >= 1:
            return int(x.shape[0]), int(x.shape[1]) if x.dim() >= 2 else 1
    return 1, 1


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """Hash of hilore's own source: a cached plan made by other code is stale."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> str:
    """Key of a zero-config plan: graph code, input shapes, planning options, hilore's code."""
    planning = [options.memory_budget, options.risk_budget, list(options.codecs), options.buckets,
                options.loss_ratio, options.gc_peak_bytes]
    return _key(gm, example_inputs, planning)


def trace_key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> str:
    """Key of a zero-config trace: ``cache_key`` without the options that only the solver reads.

    Plans for other budgets, buckets or loss sides of the same graph are
    solved from one trace, so they weigh the same measured costs: profiling
    again would give each plan its own timing noise (a 2-core CPU's spread
    moves decisions between near-equal options).
    """
    return _key(gm, example_inputs, ["trace", list(options.codecs)])


def _key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: list[Any]) -> str:
    shapes = [(tuple(x.shape), str(x.dtype), str(x.device)) for x in example_inputs if isinstance(x, torch.Tensor)]
    text = json.dumps([CACHE_VERSION, code_digest(), torch.__version__, gm.code, repr(shapes), options],
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def solve_for(trace: Trace, options: BackendOptions, batch: int, seq_len: int) -> Plan:
    """The plan the options ask for, solved from ``trace`` at (batch, seq_len)."""
    from ..solver import DEFAULT_RISK_BUDGET, solve

    risk = DEFAULT_RISK_BUDGET if options.risk_budget is None else options.risk_budget
    return solve(trace, budget=options.memory_budget, risk_budget=risk, buckets=options.buckets,
                 codecs=list(options.codecs), batch=batch, seq_len=seq_len, loss_ratio=options.loss_ratio,
                 gc_peak_bytes=options.gc_peak_bytes)


def say(options: BackendOptions, message: str) -> None:
    """Progress on stderr when ``options.verbose``."""
    if options.verbose:
        import sys

        print(f"hilore: {message}", file=sys.stderr, flush=True)


def fall_back(options: BackendOptions, error: Exception, what: str) -> None:
    """Raise ``error`` under ``strict``; otherwise say once that Inductor decides ``what``."""
    if options.strict:
        raise error
    warnings.warn(f"hilore: {error}; {what} falls back to Inductor's own choice "
                  "(options={'strict': True} raises instead)", HiLoReWarning, stacklevel=3)


def given_plan(options: BackendOptions, batch: int, seq_len: int) -> Plan:
    """The user's plan, re-solved from ``options.trace`` if made for another shape."""
    plan = options.plan if isinstance(options.plan, Plan) else load_plan(options.plan)
    if (plan.batch, plan.seq_len) == (batch, seq_len):
        return plan
    if options.trace is None:
        raise PlanMismatchError(
            f"the plan was made for batch {plan.batch}, sequence {plan.seq_len} but this graph "
            f"runs batch {batch}, sequence {seq_len}: pass options={{'trace': TRACE}} to "
            "re-solve it for this shape, or run `hilore plan TRACE --batch B --seq-len S`"
        )
    trace = load_trace(options.trace)
    if trace.fingerprint != plan.fingerprint:
        raise PlanMismatchError(
            f"trace {options.trace} (fingerprint {trace.fingerprint}) is not the plan's "
            f"model (fingerprint {plan.fingerprint})"
        )
    say(options, f"re-solving the plan for batch {batch}, sequence {seq_len} from {options.trace}")
    return solve_for(trace, options, batch, seq_len)


def trace_capture(capture: GraphCapture, options: BackendOptions, batch: int, seq_len: int, name: str) -> Trace:
    """Annotate and profile one captured joint graph into a trace."""
    from ..passes.tracer import TraceConfig, trace_captures

    config = TraceConfig(model_name=name, codecs=tuple(options.codecs), verbose=False)
    return trace_captures([capture], batch, seq_len, config)


def trace_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions,
                batch: int, seq_len: int, name: str) -> Trace:
    """Trace and profile one dynamo graph on the inputs it was compiled for
    (the joint graph as Inductor's partitioner receives it)."""
    from ..passes.capture import capture_graph_module

    return trace_capture(capture_graph_module(gm, example_inputs), options, batch, seq_len, name)


class GraphPlanner:
    """Plans one dynamo graph; its partitioners ask it for each bucket's decisions.

    The plan is known before the compile when it is given or cached;
    otherwise the first partitioner call makes it on its joint graph. Every
    later call (one per distinct bucket plan) re-derives the units from the
    default partition's saved values, learnt once per joint graph.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions):
        self.options = options
        self.real_args = lifted_args(gm, example_inputs)
        self.batch, self.seq_len = graph_shape(example_inputs)
        self.plan: Plan | None = None
        self.trace: Trace | None = None
        #: False once planning failed or found nothing: Inductor then decides.
        self.planning = True
        self.cache: PlanCache | None = None
        self._saved: dict[str, set[str]] = {}
        if options.plan is not None:
            self.plan = given_plan(options, self.batch, self.seq_len)
        else:
            self.cache = PlanCache.open(options.cache_dir, cache_key(gm, example_inputs, options), options,
                                        trace_key=trace_key(gm, example_inputs, options))
            self.plan = self.cache.load_plan()

    @property
    def plan_known(self) -> bool:
        return self.plan is not None

    def prepare(self, joint: fx.GraphModule, joint_inputs: Sequence[object], bucket: str | None,
                **kwargs: Any) -> tuple[list[UnitNodes], GraphDecisions]:
        """The units of ``joint`` and ``bucket``'s decisions for them (None: the default bucket)."""
        digest = hashlib.sha256(joint.code.encode()).hexdigest()
        make_plan = self.plan is None and self.planning
        if make_plan or digest not in self._saved:
            capture = capture_joint(joint, joint_inputs, self.real_args, record_values=make_plan, **kwargs)
            self._saved[digest] = capture.saved_names
            if make_plan:
                self._make_plan(capture)
        units = annotate_units(joint, self._saved[digest])
        if self.plan is None:
            return units, GraphDecisions.none()
        decisions = match_plan(self.plan, bucket, units, self.batch, self.seq_len)
        if decisions.unknown or decisions.missing:
            fall_back(self.options, PlanMismatchError(decisions.mismatch_message()),
                      f"{len(decisions.missing)} unit(s) of this graph without a decision")
        return units, decisions

    def _make_plan(self, capture: GraphCapture) -> None:
        """Trace, profile and solve the captured joint graph (zero config)."""
        options = self.options
        try:
            name = f"graph-{self.cache.key[:8]}" if self.cache else "graph"
            self.trace = self.cache.load_trace() if self.cache else None
            if self.trace is None:
                # Profiling runs real tensors: Inductor's fake mode must be off.
                with unset_fake_temporarily():
                    self.trace = trace_capture(capture, options, self.batch, self.seq_len, name)
                if self.trace.units and self.cache:
                    self.cache.save_trace(self.trace)
            if not self.trace.units:
                self.planning = False
                say(options, "the graph's backward saves nothing: nothing to plan")
                return
            self.plan = solve_for(self.trace, options, self.batch, self.seq_len)
        except Exception as error:  # planning never stops training: see fall_back
            if options.strict:
                raise
            self.planning = False
            fall_back(options, RuntimeError(f"could not plan this graph ({type(error).__name__}: {error})"),
                      "every unit")
            return
        where = self.cache.save_plan(self.plan) if self.cache else None
        say(options, f"traced {len(self.trace.units)} recovery units and solved a {options.memory_budget} "
                     f"plan with {len(self.plan.buckets)} buckets"
                     + (f"; plan: {where} (inspect: hilore show)" if where else ""))
