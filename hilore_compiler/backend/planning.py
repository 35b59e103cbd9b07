"""Where the backend's plan comes from: given, cached, or made on first compile.

Zero config: the first compile traces and profiles the dynamo graph, solves
the embedded default (``1.10x-gc``), and caches trace and plan on disk under a
key of the graph's code, input shapes and the planning options, so the next
process reuses them. A plan made for another shape is re-solved from its
trace when one is given; a plan for another model is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ..passes.apply import PlanMismatchError
from ..planfile import Plan, load_plan
from ..tracefile import Trace, load_trace

if TYPE_CHECKING:
    from .options import BackendOptions

#: Bumped when traces or plans made by older code must not be reused.
CACHE_VERSION = "1"


def graph_shape(example_inputs: Sequence[Any]) -> tuple[int, int]:
    """(batch, sequence) of the first 2-D integer input: the token ids."""
    if any(isinstance(x, torch.SymInt) for x in example_inputs):
        raise ValueError(
            "hilore plans per static (batch, sequence) shape, but dynamo made this graph "
            "dynamic after seeing a second shape: compile with "
            "torch.compile(model, backend='hilore', dynamic=False)"
        )
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point():
            return int(x.shape[0]), int(x.shape[1])
    raise ValueError(
        "hilore plans per (batch, sequence) shape and found no 2-D integer input "
        "(token ids) in this graph's inputs"
    )


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """Hash of hilore's own source: a cached plan made by other code is stale."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> str:
    """Key of a zero-config plan: graph code, input shapes, planning options, hilore's code."""
    shapes = [(tuple(x.shape), str(x.dtype)) for x in example_inputs if isinstance(x, torch.Tensor)]
    planning = [options.memory_budget, options.risk_budget, list(options.codecs), options.buckets]
    text = json.dumps([CACHE_VERSION, code_digest(), torch.__version__, gm.code, repr(shapes), planning],
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _solve(trace: Trace, options: BackendOptions, batch: int, seq_len: int) -> Plan:
    from ..solver import DEFAULT_RISK_BUDGET, solve

    risk = DEFAULT_RISK_BUDGET if options.risk_budget is None else options.risk_budget
    return solve(trace, budget=options.memory_budget, risk_budget=risk, buckets=options.buckets,
                 codecs=list(options.codecs), batch=batch, seq_len=seq_len)


def _say(options: BackendOptions, message: str) -> None:
    if options.verbose:
        print(f"hilore: {message}", file=sys.stderr, flush=True)


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
    _say(options, f"re-solving the plan for batch {batch}, sequence {seq_len} from {options.trace}")
    return _solve(trace, options, batch, seq_len)


def plan_for_graph(gm: fx.GraphModule, example_inputs: Sequence[Any],
                   options: BackendOptions) -> tuple[Plan, Trace | None]:
    """The plan to apply to ``gm``: given, cached, or traced and solved now."""
    batch, seq_len = graph_shape(example_inputs)
    if options.plan is not None:
        return given_plan(options, batch, seq_len), None
    key = cache_key(gm, example_inputs, options)
    cache = Path(options.cache_dir).expanduser()
    plan_path, trace_path = cache / f"{key}.plan.json", cache / f"{key}.trace.json"
    if plan_path.exists():
        _say(options, f"using cached plan {plan_path}")
        return load_plan(plan_path), None
    trace = trace_graph(gm, example_inputs, options, batch, seq_len, name=f"graph-{key[:8]}")
    trace.save(trace_path)
    plan = _solve(trace, options, batch, seq_len)
    plan.save(plan_path)
    _say(options, f"traced {len(trace.units)} recovery units and solved a {options.memory_budget} "
                  f"plan with {len(plan.buckets)} buckets; plan: {plan_path} (inspect: hilore show)")
    return plan, trace


def trace_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions,
                batch: int, seq_len: int, name: str) -> Trace:
    """Trace and profile one dynamo graph on the inputs it was compiled for."""
    from ..passes.capture import capture_graph_module
    from ..passes.tracer import TraceConfig, trace_captures

    capture = capture_graph_module(gm, example_inputs)
    config = TraceConfig(model_name=name, codecs=tuple(options.codecs), verbose=False)
    return trace_captures([capture], batch, seq_len, config)
