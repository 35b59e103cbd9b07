"""Where a graph's plan comes from: given, cached, or made on the joint graph.

One graph, one truth: a zero-config plan is made inside Inductor's
partitioner call, on the very joint graph that is then partitioned (trace,
profile, solve, apply), so the units planned are the units applied. The plan
and its trace are cached on disk under a key of the graph, its inputs, the
compiler settings and versions and the planning options (``cachekey``), so
the next process starts from the plan (``PlanCache``). A given plan is matched to the graph's units by key
(``matching``); a plan made for another shape is re-solved from its trace (``lengths``). Under a multi-rank
``torch.distributed`` run rank 0 plans each graph and the other ranks run its plans
(``distributed/plan_share``), read by a key of the graph's structure that every rank shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..distributed.plan_share import PlanShare, Shared, plan_set, plan_share
from ..passes.annotate import UnitNodes, annotate_units
from ..passes.apply import PlanMismatchError
from ..passes.capture import GraphCapture, capture_joint, lifted_args
from ..planfile import Plan
from ..tracefile import Trace
from ..vocabulary import GC_SAVES_NOTHING
from .cache import PlanCache, StaleCacheError
# cache_key, trace_key, graph_shape: importable from here too, as harnesses and tests do.
from .cachekey import cache_key, structure_key, trace_key  # noqa: F401
from .lengths import beyond_range, ceiling_at, given_plans, given_trace, planned_range, solve_lengths
from .matching import GraphDecisions, match_plan
from .options import BackendOptions
# HiLoReWarning, say, fall_back: importable from here too, as tests do.
from .report import HiLoReWarning, fall_back, say  # noqa: F401
from .shapes import graph_shape, is_dynamic, shape_at, shape_slot  # noqa: F401


def trace_capture(capture: GraphCapture, options: BackendOptions, batch: int, seq_len: int, name: str) -> Trace:
    """Annotate and profile one captured joint graph into a trace (its measured times rounded
    by the tracer, so that fresh processes planning this graph agree)."""
    from ..passes.tracer import TraceConfig, trace_captures

    config = TraceConfig(model_name=name, codecs=tuple(options.profiled_codecs), verbose=False,
                         cost_model=options.cost_model)
    return trace_captures([capture], batch, seq_len, config)


def trace_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions,
                batch: int, seq_len: int, name: str) -> Trace:
    """Trace and profile one dynamo graph on the inputs it was compiled for
    (the joint graph as Inductor's partitioner receives it)."""
    from ..passes.capture import capture_graph_module

    return trace_capture(capture_graph_module(gm, example_inputs), options, batch, seq_len, name)


class PreparedGraph(NamedTuple):
    """A joint graph's units, the decisions for them, and min-cut's partition of it."""

    units: list[UnitNodes]
    decisions: GraphDecisions
    #: (forward, backward) as min-cut partitioned the graph when it was
    #: captured, before any decision; None where this planner did not capture it.
    default_partition: tuple[fx.GraphModule, fx.GraphModule] | None


class GraphPlanner:
    """Plans one dynamo graph; its partitioners ask it for each bucket's decisions.

    The plans are known before the compile when given or cached; otherwise
    the first partitioner call makes them on its joint graph. A static graph
    has one plan; a dynamic one has a plan per length bucket over the
    lengths it was planned for (``seq_range``), and ``plans_for`` re-solves
    them from the trace when a call falls outside. Every later partitioner
    call (one per distinct bucket plan) re-derives the units from the
    default partition's saved values, learnt once per joint graph.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions):
        self.options = options
        self.real_args = lifted_args(gm, example_inputs)
        self.dynamic = is_dynamic(example_inputs)
        self.slot = shape_slot(example_inputs)
        #: The compiled call's shape: costs are measured, and units matched, here.
        self.batch, self.seq_len = shape_at(example_inputs, self.slot)
        #: The batch and lengths the plans hold for.
        self.planned_batch = self.batch
        # Zero-config plans hold over the options' lengths, static graphs' too: one
        # graph per length then gets the decisions of one range plan, checked at its longest.
        given_static = options.plan is not None and not self.dynamic
        self.seq_range = (self.seq_len, self.seq_len) if given_static else planned_range(options, self.seq_len)
        self._said_beyond = False
        self._said_kept = False
        #: Seconds spent per planning phase (``capture``, ``profiling``, ``solving``), for ``verbose``.
        self.seconds: dict[str, float] = defaultdict(float)
        self._say_beyond(self.seq_len)
        self.plans: tuple[Plan, ...] = ()
        self.trace: Trace | None = None
        #: False once planning failed or found nothing: Inductor then decides.
        self.planning = True
        self.cache: PlanCache | None = None
        #: This graph's keys in the process group's store; None in one process or with ``share_plans`` off.
        self.share: PlanShare | None = None
        #: Where the plans came from: "given", "cache", "made" here, or "rank 0" (its plans or its trace).
        self.source = "given" if options.plan is not None else "made"
        self._published: tuple[Plan, ...] | None = None
        #: Per joint graph (its code's digest): the names min-cut saves, and min-cut's
        #: partition of it (``default_partition``), both from its capture.
        self._saved: dict[str, set[str]] = {}
        self._partitions: dict[str, tuple[fx.GraphModule, fx.GraphModule]] = {}
        if options.plan is not None:
            self.plans = given_plans(options, self.batch, self.seq_range)
            if self.dynamic:
                # The plans hold over their own ranges, wider than the call's length.
                self.seq_range = (self.plans[0].length_range[0], self.plans[-1].length_range[1])
        else:
            self.cache = PlanCache.open(options.cache_dir, cache_key(gm, example_inputs, options), options,
                                        trace_key=trace_key(gm, example_inputs, options))
            if options.share_plans:
                self.share = plan_share(structure_key(gm, example_inputs, options), options.share_timeout_s)
            shared = self.share.peek() if self.share else None
            if shared is not None:  # rank 0 planned this graph already: its plans, if they hold here
                self._adopt(shared, solve=False)
            elif self.share is None or self.share.plans_here:  # the others never run their own cached plans
                if self.share is not None:
                    self.share.announce()
                self.plans, self.source = self.cache.load_plans(), "cache"
        #: Whether the plans (or the trace they are solved from) came from the
        #: cache: then a mismatch with the graph is a stale entry, not an error.
        self.from_cache = self.source == "cache" and bool(self.plans)

    @property
    def plan(self) -> Plan | None:
        """The plan of the compiled call's length (the longest length bucket's when none holds it)."""
        return self.plan_at(self.seq_len)

    def plan_at(self, seq_len: int) -> Plan | None:
        if not self.plans:
            return None
        from ..solver.lengths import plan_for_length

        return plan_for_length(self.plans, seq_len) or self.plans[-1]

    def plans_for(self, batch: int, seq_len: int) -> bool:
        """Re-solve the plans when a call's shape lies outside what they hold for; True if they changed.

        Only a dynamic graph with its trace at hand (made here, cached, or
        given) re-solves; the others keep their plans.
        """
        lo, hi = self.seq_range
        if not self.dynamic or (batch <= self.planned_batch and lo <= seq_len <= hi):
            return False
        if not self._load_trace():
            self._say_kept(batch, seq_len)
            self.keep_plans(batch, seq_len)  # nothing to re-solve from
            return False
        self.planned_batch = max(batch, self.planned_batch)
        self.seq_range = planned_range(self.options, seq_len, self.seq_range)
        self._say_beyond(seq_len)
        shared = self.share.peek() if self.share else None
        if shared is not None and self._adopt(shared, solve=False):
            return True
        say(self.options, "re-solving for batch {} and sequences {} to {} from the trace".format(
            self.planned_batch, *self.seq_range))
        self.plans = solve_lengths(self.trace, self.options, self.planned_batch, self.seq_range)
        self.publish()
        return True

    @property
    def _solving(self) -> BackendOptions:
        """The options plans are solved with: a static graph runs one length, so one range plan."""
        return self.options if self.dynamic else dataclasses.replace(self.options, length_buckets=1)

    @property
    def _foreign(self) -> bool:
        """Whether the plans (or their trace) came from the cache or rank 0: a mismatch with the
        graph is then theirs, not the user's, and the graph is planned afresh here."""
        return self.from_cache or self.source == "rank 0"

    def _adopt(self, shared: Shared, *, solve: bool) -> bool:
        """Take rank 0's plans of this graph; True once planning is settled.

        A plan set that holds for this batch and range is taken as it is;
        with none, and ``solve``, rank 0's trace is solved for this range (the
        same solver inputs as rank 0 would have). Rank 0 reads its own records
        this way too: a graph of the same structure met again (another length
        of a static graph, another backend with the same options) runs the
        same plans.
        """
        if shared.empty:  # rank 0's graph saves nothing for backward: nothing to plan on any rank
            self.planning, self.source = False, "rank 0"
            return True
        if shared.trace is not None:
            self.trace = shared.trace
        found = shared.find(self.planned_batch, self.seq_range, self._solving.length_buckets)
        if found is not None:
            self.plans = self._published = found.plans
            self.planned_batch, self.seq_range, self.source = found.batch, found.seq_range, "rank 0"
            return True
        if not solve or shared.trace is None:
            return False
        self.source = "rank 0"
        if not shared.trace.units:
            self.planning = False
            return True
        self.plans = solve_lengths(shared.trace, self._solving, self.planned_batch, self.seq_range)
        self.publish()
        return True

    def publish(self) -> None:
        """Rank 0: put this graph's plans, and the trace they are solved from, in the group's store.

        Called once the plans are made, and (for cached plans, which could
        be stale) once they compiled; a no-op on other ranks, in one process,
        and for plans already there.
        """
        if self.share is None or not self.share.plans_here or self._published is self.plans:
            return
        self._published = self.plans
        trace = self.trace if self.trace is not None or self.cache is None else self.cache.load_trace()
        found = plan_set(self.plans, self.planned_batch, self.seq_range, self._solving.length_buckets)
        self.share.publish(trace, found if self.plans else None)

    def publish_failure(self, error: BaseException) -> None:
        """Rank 0: tell the ranks waiting for this graph's plans that none will come (they plan alone)."""
        if self.share is not None:
            self.share.publish(None, error=f"{type(error).__name__}: {error}")

    def _say_beyond(self, seq_len: int) -> None:
        """Warn, once per graph, that a call is longer than ``max_seq_len``."""
        message = beyond_range(self.options, seq_len)
        if message and not self._said_beyond:
            self._said_beyond = True
            warnings.warn(message, HiLoReWarning, stacklevel=4)

    def _say_kept(self, batch: int, seq_len: int) -> None:
        """Warn, once per graph, that a call outside the given plans' shapes runs them unchecked."""
        if self._said_kept:
            return
        self._said_kept = True
        lo, hi = self.seq_range
        warnings.warn(f"hilore: the plan was made for batch {self.planned_batch}, sequence lengths {lo}-{hi} but "
                      f"this call runs batch {batch}, sequence {seq_len}, and no trace is at hand to re-solve it: "
                      "its decisions run as they are, the memory ceiling unchecked at this shape (pass "
                      "options={'trace': TRACE}, the Trace or its JSON file, to re-solve it)",
                      HiLoReWarning, stacklevel=4)

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the block's wall time to ``seconds[phase]``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def keep_plans(self, batch: int, seq_len: int) -> None:
        """Let the plans stand for this shape too, so that later calls stop asking to re-solve."""
        lo, hi = self.seq_range
        self.planned_batch, self.seq_range = max(batch, self.planned_batch), (min(lo, seq_len), max(hi, seq_len))

    def ceiling_at(self, batch: int, seq_len: int) -> int | None:
        """The memory ceiling at one shape (``ceiling_at``), or None without a trace."""
        return ceiling_at(self.trace, self.options, batch, seq_len) if self._load_trace() else None

    def _load_trace(self) -> bool:
        """Whether the trace to re-solve from is at hand (made here, cached, or given)."""
        if self.trace is None and self.cache is not None:
            self.trace = self.cache.load_trace()
        if self.trace is None and self.plans and (self.options.plan is not None or self.options.trace is not None):
            self.trace = given_trace(self.options, self.plans)
        return self.trace is not None

    def prepare(self, joint: fx.GraphModule, joint_inputs: Sequence[object], plan: Plan | None, bucket: str | None,
                **kwargs: Any) -> PreparedGraph:
        """The units of ``joint`` (its duplicates merged: ``merge_duplicates``), ``bucket``'s
        decisions in ``plan`` (None: the compiled call's plan; bucket None: its default
        bucket) and min-cut's partition of it."""
        digest = hashlib.sha256(joint.code.encode()).hexdigest()
        make_plan = not self.plans and self.planning
        if make_plan or digest not in self._saved:
            # Roofline costs read shapes alone: nothing runs (``values.meta_values``).
            measured = self.options.cost_model == "measured"
            with self._timed("capture"):
                # The partitioner merged the joint graph's duplicates before it came here.
                capture = capture_joint(joint, joint_inputs, self.real_args,
                                        record_values=make_plan and measured, merged=True, **kwargs)
            self._saved[digest] = capture.saved_names
            self._partitions[digest] = capture.fw, capture.bw
            if make_plan:
                self._make_plan(capture)
        units = annotate_units(joint, self._saved[digest])
        plan = plan or self.plan
        if plan is None:
            return PreparedGraph(units, GraphDecisions.none(), self._partitions.get(digest))
        try:
            decisions = match_plan(plan, bucket, units, self.batch, self.seq_len)
            if self._foreign and (decisions.unknown or decisions.missing):
                raise PlanMismatchError(decisions.mismatch_message())
        except PlanMismatchError as error:
            if self._foreign:  # the cache's or rank 0's, not the user's: ``HiLoReBackend`` plans afresh
                raise StaleCacheError(str(error)) from error
            raise
        if decisions.unknown or decisions.missing:
            fall_back(self.options, PlanMismatchError(decisions.mismatch_message()),
                      f"{len(decisions.missing)} unit(s) of this graph without a decision")
        return PreparedGraph(units, decisions, self._partitions.get(digest))

    def _make_plan(self, capture: GraphCapture) -> None:
        """Trace, profile and solve the captured joint graph (zero config)."""
        options = self.options
        try:
            shared = self.share.wait() if self.share else None  # rank 0 never waits
            if shared is not None and self._adopt(shared, solve=True):
                say(options, "running rank 0's plan of this graph" if self.plans else "rank 0 found nothing to plan")
                return
            self.source = "made"
            name = f"graph-{self.cache.key[:8]}" if self.cache else "graph"
            self.trace = self.cache.load_trace() if self.cache else None
            self.from_cache = self.trace is not None
            if self.trace is None:
                # Profiling runs real tensors: Inductor's fake mode must be off.
                with self._timed("profiling"), unset_fake_temporarily():
                    self.trace = trace_capture(capture, options, self.batch, self.seq_len, name)
                if self.trace.units and self.cache:
                    self.cache.save_trace(self.trace)
            if not self.trace.units:
                self.planning = False
                self.publish()  # the other ranks need not wait for it
                say(options, "the graph's backward saves nothing: nothing to plan")
                return
            with self._timed("solving"):
                self.plans = solve_lengths(self.trace, self._solving, self.batch, self.seq_range)
        except Exception as error:  # planning never stops training: see fall_back
            self.publish_failure(error)  # the other ranks need not wait: they plan on their own
            if options.strict:
                raise
            self.planning = False
            fall_back(options, RuntimeError(f"could not plan this graph ({type(error).__name__}: {error})"),
                      "every unit")
            return
        if not self.from_cache:  # a cached trace may not fit: published once the plans compiled
            self.publish()
        where = self.cache.save_plans(self.plans) if self.cache else None
        lengths = "" if self.seq_range[0] == self.seq_range[1] else " for sequences {} to {}".format(*self.seq_range) + (
            f" in {len(self.plans)} length buckets" if len(self.plans) > 1 else "")
        say(options, f"traced {len(self.trace.units)} recovery units and solved a {options.memory_budget} "
                     f"plan with {len(self.plans[0].buckets)} buckets{lengths}"
                     + (f"; plan: {where} (inspect: hilore show)" if where else ""))
        for note in self.plans[-1].notes:
            if note.startswith(GC_SAVES_NOTHING):  # a ceiling that is not one: said once, when planned
                say(options, note)
