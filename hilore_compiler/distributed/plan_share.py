"""One plan per graph on every rank: rank 0 plans, the others read its plan from the group's store.

Timings differ between processes, so ranks that each profiled and solved a
graph could run different plans. Under a multi-rank ``torch.distributed``
run the backend therefore lets rank 0 trace, profile and solve, and every
other rank runs rank 0's plans.

Why the process group's key-value store and not a broadcast: a compile is
not a step every rank takes together. Under verl's packing each rank's
micro-batch lengths differ, so dynamo's static first compile and its
dynamic recompile happen at different calls on different ranks, and a
collective issued from inside a compile could pair with another rank's
FSDP all-gather and hang or corrupt it. A keyed store exchange pairs
nothing: rank 0 sets a key when its plans exist; another rank that needs
them polls for that key alone, and plans on its own, with one warning, where
waiting would not pay. A backend never stops training because of planning.

How long a rank waits. Ranks step together (FSDP's collectives pair up every
block), so a rank waiting inside a compile holds rank 0 at its next
collective; rank 0 makes the plan only if it compiles the same graph at the
same call. That holds for the first compile (every rank's first call), not
always for a recompile (dynamo's dynamic graph comes at each rank's second
length, which may be another micro-batch on each rank). So rank 0 first sets
a ``planning`` key when it starts on a graph, and a rank waits for the plan
only once it sees that key: up to ``START_GRACE_S`` for it to appear, then
up to ``share_timeout_s`` (profiling takes a while) for the plans. It polls
(``check``) rather than blocks in the store's ``wait``: a blocked client holds
the connection that other threads of the process share with it.

Keys are ``hilore/plan-share/<structure key>/...`` (``cachekey.structure_key``:
the same on every rank for the same graph, whatever its device index or
lengths). Under each, rank 0 (the only writer) sets

- ``plans``: JSON list of plan sets, each the plans solved for one batch,
  length range and length-bucket count (``PlanSet``), appended as it solves;
- ``trace``: JSON ``{"trace": trace | null, "error": message | null, "empty": bool}``,
  set after the first plan set, so a rank that sees it finds that set too;
  ``empty``: the graph's backward saves nothing, so there is nothing to plan
  (an FSDP root graph around the sharded blocks, say);
- ``planning``: set when rank 0 starts planning the graph (see above).

Nothing here stops a step: a record that cannot be read, a store that fails,
anything unexpected, and the rank plans the graph on its own, said once.

A rank takes a plan set that covers its own batch and lengths; with none, it
solves rank 0's trace for its lengths (the same inputs to the solver, so the
same plan unless the solver's time limit cut a solve short). Where every rank
plans over one range (``max_seq_len`` and ``min_seq_len`` set, as the verl
engine sets them from verl's token budget), every rank runs rank 0's plans.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..planfile import Plan
from ..planload import plan_from_json
from ..tracefile import Trace, trace_from_json

#: Prefix of every key this module sets in the process group's store.
PREFIX = "hilore/plan-share/"

#: Seconds between two looks at the store while waiting: one round trip each,
#: so a few a second cost nothing, and rank 0 takes seconds to plan a graph.
POLL_S = 0.25

#: How long a rank waits for rank 0 to start planning a graph. Compiling the
#: same call, rank 0 gets there within seconds of any other rank (dynamo
#: traces the same code on both); a rank that has seen no sign of it by then
#: is not in step with a compile of rank 0's, and would only hold rank 0 at
#: its next collective.
START_GRACE_S = 30.0

#: Set once rank 0 started a graph and did not finish it within
#: ``share_timeout_s``: later graphs only look, never wait, so a rank stalls
#: for a slow or stuck rank 0 once, not once per graph.
_gave_up = False
#: Whether this process said that it plans a graph on its own (said once).
_warned = False


@dataclass(frozen=True, slots=True)
class PlanSet:
    """The plans rank 0 solved for one batch, length range and length-bucket count."""

    batch: int
    seq_range: tuple[int, int]
    length_buckets: int
    plans: tuple[Plan, ...]

    def covers(self, batch: int, seq_range: tuple[int, int], length_buckets: int) -> bool:
        """Whether these plans hold for ``batch`` over ``seq_range`` (solved the same way)."""
        lo, hi = seq_range
        return (self.batch == batch and self.length_buckets == length_buckets
                and self.seq_range[0] <= lo and hi <= self.seq_range[1])

    def to_json(self) -> dict[str, Any]:
        return {"batch": self.batch, "seq_range": list(self.seq_range), "length_buckets": self.length_buckets,
                "plans": [p.to_json() for p in self.plans]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PlanSet:
        lo, hi = obj["seq_range"]
        plans = tuple(plan_from_json(p, where="plan shared by rank 0") for p in obj["plans"])
        return cls(int(obj["batch"]), (int(lo), int(hi)), int(obj["length_buckets"]), plans)


@dataclass(frozen=True, slots=True)
class Shared:
    """What rank 0 published for one graph: its trace (or why it has none) and its plan sets."""

    trace: Trace | None
    error: str | None
    sets: tuple[PlanSet, ...]
    #: Rank 0 found nothing to plan in this graph (its backward saves nothing).
    empty: bool = False

    def find(self, batch: int, seq_range: tuple[int, int], length_buckets: int) -> PlanSet | None:
        """The first plan set that holds for ``batch`` over ``seq_range``, or None."""
        return next((s for s in self.sets if s.covers(batch, seq_range, length_buckets)), None)


class PlanShare:
    """One graph's keys in the process group's store, as this rank sees them."""

    def __init__(self, store: Any, rank: int, key: str, timeout_s: float):
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.key = key
        self._trace_key, self._plans_key = f"{PREFIX}{key}/trace", f"{PREFIX}{key}/plans"
        self._planning_key = f"{PREFIX}{key}/planning"

    @property
    def plans_here(self) -> bool:
        """Whether this rank plans and publishes (rank 0) rather than reads."""
        return self.rank == 0

    def peek(self) -> Shared | None:
        """What rank 0 has published for this graph so far, without waiting; None: nothing yet,
        or a record this rank cannot use (said once: it then plans the graph on its own)."""
        try:
            if not self.store.check([self._trace_key]):
                return None
            record = json.loads(self.store.get(self._trace_key))
            trace = None if record.get("trace") is None else trace_from_json(record["trace"],
                                                                            "trace shared by rank 0")
            return Shared(trace, record.get("error"), self._plan_sets(), empty=bool(record.get("empty")))
        except Exception as error:  # a shared plan is an optimisation: never a reason to stop
            _say_alone(f"rank 0's record of this graph could not be read ({type(error).__name__}: "
                       f"{_first_line(error)}): rank {self.rank} plans it on its own")
            return None

    def announce(self) -> None:
        """Rank 0: say that it is planning this graph now, so that the other ranks wait for it."""
        if not self.plans_here:
            return
        try:
            self.store.set(self._planning_key, "1")
        except Exception as error:  # the others then plan on their own after START_GRACE_S
            _say_alone(f"announcing this graph's planning failed ({type(error).__name__}: {_first_line(error)})")

    def wait(self) -> Shared | None:
        """Rank 0's record of this graph, waited for while rank 0 is planning it (see the module
        docstring); None, said once per process, when this rank must plan it on its own."""
        if self.plans_here:
            return self.peek()
        try:
            return self._wait()
        except Exception as error:  # the store failed (rank 0 gone, a closed connection): plan here
            _say_alone(f"waiting for rank 0's plan of this graph failed ({type(error).__name__}: "
                       f"{_first_line(error)}): rank {self.rank} plans it on its own")
            return None

    def _wait(self) -> Shared | None:
        global _gave_up
        start, started = time.monotonic(), False
        while not self.store.check([self._trace_key]):
            waited = time.monotonic() - start
            if _gave_up:
                return None
            started = started or self.store.check([self._planning_key])
            if not started and waited > min(START_GRACE_S, self.timeout_s):
                _say_alone(f"rank 0 is not planning this graph now (it compiles it at another call, or "
                           f"not at all): rank {self.rank} plans it on its own")
                return None
            if waited > self.timeout_s:
                _gave_up = True
                _say_alone(f"rank 0 did not finish planning a graph within {self.timeout_s:g} s: rank "
                           f"{self.rank} plans it, and later graphs rank 0 has not yet planned, on its own")
                return None
            time.sleep(POLL_S)
        return self.peek()

    def publish(self, trace: Trace | None, plan_set: PlanSet | None = None, error: str | None = None) -> None:
        """Rank 0: add ``plan_set`` to this graph's sets, then record the trace (first one kept).
        A trace without units is recorded as ``empty``: nothing to plan, nothing to send."""
        if not self.plans_here:
            return
        try:
            if plan_set is not None:
                sets = [s.to_json() for s in self._plan_sets()] + [plan_set.to_json()]
                self.store.set(self._plans_key, json.dumps(sets))
            if not self.store.check([self._trace_key]):
                empty = trace is not None and not trace.units
                record = {"trace": None if trace is None or empty else trace.to_json(), "error": error,
                          "empty": empty}
                self.store.set(self._trace_key, json.dumps(record))
        except Exception as error:  # the others then wait out their timeout and plan on their own
            _say_alone(f"publishing this graph's plans failed ({type(error).__name__}: {_first_line(error)})")

    def _plan_sets(self) -> tuple[PlanSet, ...]:
        if not self.store.check([self._plans_key]):
            return ()
        return tuple(PlanSet.from_json(obj) for obj in json.loads(self.store.get(self._plans_key)))


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0][:200]


def _say_alone(what: str) -> None:
    """Warn, once per process, that this rank plans a graph without rank 0's plans."""
    global _warned
    if _warned:
        return
    _warned = True
    from ..backend.report import HiLoReWarning

    warnings.warn(f"hilore: {what}, so its plans may differ from rank 0's (options['share_timeout_s'] "
                  "is how long a rank waits once rank 0 started; share_plans=False plans on every rank)",
                  HiLoReWarning, stacklevel=4)


def process_store() -> tuple[Any, int] | None:
    """The default process group's store and this rank, when more than one rank runs; else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # a group without a store: plan on every rank
        return None
    return store, dist.get_rank()


def plan_share(key: str, timeout_s: float) -> PlanShare | None:
    """The exchange of the graph keyed ``key`` (``cachekey.structure_key``), or None in one process."""
    found = process_store()
    return None if found is None else PlanShare(found[0], found[1], key, timeout_s)


def plan_set(plans: Sequence[Plan], batch: int, seq_range: tuple[int, int], length_buckets: int) -> PlanSet:
    """The record of plans solved for ``batch`` over ``seq_range`` with ``length_buckets``."""
    return PlanSet(batch, (int(seq_range[0]), int(seq_range[1])), length_buckets, tuple(plans))
