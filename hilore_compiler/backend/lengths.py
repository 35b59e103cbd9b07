"""The sequence lengths a graph's plans hold over, and the plans for them.

A graph compiled for one length is planned at that length; a dynamic one
over a range (``planned_range``) that widens by powers of two as longer or
shorter calls arrive. The plans come from the user (``given_plans``, re-solved
from their trace where they do not cover the range) or from the solver
(``solve_lengths``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..passes.apply import PlanMismatchError
from ..planfile import Plan
from ..planload import load_plan
from ..tracefile import Trace, load_trace
from .options import BackendOptions
from .report import say


def solve_lengths(trace: Trace, options: BackendOptions, batch: int, seq_range: tuple[int, int]) -> tuple[Plan, ...]:
    """The plans the options ask for over ``seq_range``: one per length bucket, shortest first.

    One length gives one plan, solved exactly as a static graph's; a range
    gives range plans (``solver.lengths``), split into at most
    ``options.length_buckets`` where that pays.
    """
    from ..solver import DEFAULT_RISK_BUDGET
    from ..solver.cbc import reporting
    from ..solver.lengths import solve_length_buckets

    risk = DEFAULT_RISK_BUDGET if options.risk_budget is None else options.risk_budget
    # A long CBC run says how it is doing (verbose only); the planner's other lines stay quiet here.
    with reporting(lambda line: say(options, f"solver: {line}")):
        return solve_length_buckets(trace, seq_range, options.memory_budget, max_buckets=options.length_buckets,
                                    length_mix=options.length_mix, risk_budget=risk, buckets=options.buckets,
                                    codecs=list(options.codecs), batch=batch, loss_ratio=options.loss_ratio,
                                    gc_peak_bytes=options.gc_peak_bytes)


def ceiling_at(trace: Trace, options: BackendOptions, batch: int, seq_len: int) -> int:
    """The memory ceiling ``options.memory_budget`` sets at one shape, in bytes
    (an ``x-gc`` budget: GC's predicted peak at that shape times x)."""
    from ..solver import parse_budget
    from ..solver.planner import prepare

    _, model = prepare(trace, codecs=[], batch=batch, seq_len=seq_len, loss_ratio=options.loss_ratio)
    return parse_budget(options.memory_budget).bytes_at(gc_bytes=model.gc_bytes, store_bytes=model.store_bytes)


def planned_range(options: BackendOptions, seq_len: int, seen: tuple[int, int] | None = None) -> tuple[int, int]:
    """The lengths a graph's plans hold over: the options' bounds where given, else those seen.

    A call outside ``seen`` widens it to the next power of two beyond the
    call's length (down to the one below it for a shorter call), so a run
    whose lengths creep up re-solves about log2(range) times, not every step.
    """
    if seen is None:
        lo = hi = seq_len
    else:
        lo, hi = seen
        if seq_len > hi:
            hi = 1 << (seq_len - 1).bit_length()
        if seq_len < lo:
            lo = 1 << (seq_len.bit_length() - 1)
    if options.min_seq_len is not None:
        lo = min(options.min_seq_len, lo)
    if options.max_seq_len is not None:
        hi = max(options.max_seq_len, hi)  # a longer call widens it as above: planned, and said
    return lo, max(lo, hi)


def beyond_range(options: BackendOptions, seq_len: int) -> str | None:
    """What to say of a call longer than ``options.max_seq_len`` (planned all the same), or None."""
    limit = options.max_seq_len
    if limit is None or seq_len <= limit:
        return None
    return (f"hilore: a call of sequence length {seq_len} is beyond max_seq_len {limit}; it is planned "
            "(the memory ceiling checked at its length), but raise max_seq_len to plan such lengths from the start")


class PlanShapeError(PlanMismatchError):
    """A given plan was made for another batch or other lengths than a call's, and no trace
    is at hand to re-solve it from: the graph is compiled by plain Inductor (``strict`` raises)."""


def given_trace(options: BackendOptions, plans: Sequence[Plan]) -> Trace | None:
    """The trace to re-solve the user's plans from: ``options.trace`` (a ``Trace`` or a path),
    else the one a plan from ``solve`` carries; None when neither is at hand."""
    given = options.trace
    trace = load_trace(given) if given is not None and not isinstance(given, Trace) else given
    if trace is None:
        trace = next((p.trace for p in plans if p.trace is not None), None)
    if trace is not None and trace.fingerprint != plans[0].fingerprint:
        where = "the trace given" if given is None or isinstance(given, Trace) else f"trace {given}"
        raise PlanMismatchError(
            f"{where} (fingerprint {trace.fingerprint}) is not the plan's model (fingerprint "
            f"{plans[0].fingerprint}): pass options={{'trace': ...}} with the trace the plan was made from"
        )
    return trace


def given_plans(options: BackendOptions, batch: int, seq_range: tuple[int, int]) -> tuple[Plan, ...]:
    """The user's plans (one per length bucket) when they hold over ``seq_range`` at ``batch``;
    else re-solved from their trace (``given_trace``); ``PlanShapeError`` without one."""
    given = options.plan if isinstance(options.plan, tuple) else (options.plan,)
    plans = tuple(sorted((p if isinstance(p, Plan) else load_plan(p) for p in given), key=lambda p: p.length_range))
    if len({p.fingerprint for p in plans}) > 1:
        raise PlanMismatchError("the length-bucket plans given were made for different models (fingerprints "
                                f"{sorted({p.fingerprint for p in plans})}): give the plans of one trace")
    lo, hi = seq_range
    if all(p.batch == batch for p in plans) and _covered(plans, lo, hi):
        return plans
    where = f"sequence {hi}" if lo == hi else f"sequences {lo} to {hi}"
    trace = given_trace(options, plans)
    if trace is None:
        made = ", ".join("{}-{}".format(*p.length_range) for p in plans)
        raise PlanShapeError(
            f"the plan was made for batch {plans[0].batch}, sequence lengths {made} but this graph runs batch "
            f"{batch}, {where}, and no trace is at hand to re-solve it: pass options={{'trace': TRACE}} (the "
            "Trace or its JSON file) to re-solve it for these shapes, or make plans that cover them with "
            "`hilore plan TRACE --batch B --seq-len LO:HI`"
        )
    say(options, f"re-solving the plan for batch {batch}, {where} from its trace")
    return solve_lengths(trace, options, batch, seq_range)


def _covered(plans: Sequence[Plan], lo: int, hi: int) -> bool:
    """Whether the plans' length ranges (sorted) cover every length from ``lo`` to ``hi``."""
    reached = lo - 1
    for plan in plans:
        start, end = plan.length_range
        if start > reached + 1:
            break
        reached = max(reached, end)
    return reached >= hi
