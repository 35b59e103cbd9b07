"""How the ILPs of ``ilp.py`` are solved: one bucket at a time where that is
exact, jointly otherwise, from a known plan when CBC finds none in time.

``solve_min_time`` gives the fastest plans within a memory ceiling and the
shared error budget; ``solve_min_memory`` the plans whose largest bucket
memory is least (always feasible: store-all is), which names the smallest
feasible budget.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .cbc import NoPlanInTime, SolverOptions, run_cbc
from .ilp import MIN_TIME_WEIGHT, BucketWeight, JointProblem, expected_time_s, min_memory_problem, min_time_problem
from .memory import CostModel, simulate
from .risk import plan_risk
from .tying import Tying, tie_blocks, untied


#: Up to this many units, the joint problem of buckets whose error budget binds
#: is the full ILP even when block classes are tied. There CBC's heuristics
#: find good plans on the full ILP and poor ones on the tied one: on the 8B
#: roofline trace (32 layers) at cos >= 0.999999, a first plan of 45.9 in
#: 1.2 s against 56.0 (46.4 after 15 s), while one bucket's tied problem (the
#: error budget idle, or each bucket apart) solves as well as the full one.
#: Past it the full joint problem is too big to solve in time anyway.
FULL_JOINT_MAX_UNITS = 1500


def problem_tying(model: CostModel, options: SolverOptions, *, joint: bool = False) -> Tying:
    """The units the ILPs decide together: block classes (``tying.py``), unless
    ``options`` ask for the full ILP, or ``joint`` (the joint problem of several
    buckets) and the model is small enough for the full one (``FULL_JOINT_MAX_UNITS``)."""
    small = joint and len(model.units) <= FULL_JOINT_MAX_UNITS
    return tie_blocks(model) if options.tie_blocks and not small else untied(model)


@dataclass(frozen=True, slots=True, kw_only=True)
class IlpResult:
    """The rounded answer of one ILP and how CBC got there."""

    #: ``{bucket name: {unit key: option}}``.
    decisions: Mapping[str, Mapping[str, str]]
    #: ``optimal`` or ``feasible`` (stopped by the time limit).
    status: str
    seconds: float
    #: The objective of ``decisions``: expected seconds (time ILP) or the
    #: largest bucket's bytes (memory ILP).
    objective: float
    #: CBC's proven lower bound on the objective, same units; None if unknown.
    bound: float | None
    #: The exposure-blind plans this solve already found (``_blind_plans``, solved
    #: where CBC stopped early), for ``planner.buckets_that_pay`` to reuse; None: not solved.
    blind: Mapping[str, Mapping[str, str]] | None = None

    @property
    def gap(self) -> float | None:
        """Relative MIP gap: 0 when proven optimal."""
        if self.bound is None:
            return None
        return max(self.objective - self.bound, 0.0) / max(abs(self.objective), 1e-300)


def _run(problem: JointProblem, options: SolverOptions, scale: float,
         start: Mapping[str, Mapping[str, str]] | None = None, buckets: int | None = None) -> IlpResult | None:
    """Solve; None if infeasible. ``scale`` turns the ILP objective into report units.

    ``start``: a feasible plan per bucket CBC begins from (a MIP start). The
    time limit is per bucket, so the joint problem of n buckets gets n times
    it, as does a problem solved for ``buckets`` buckets at once.
    """
    if start is not None:
        problem.set_start(start)
    buckets = buckets or len(problem.weights)
    run = run_cbc(problem.prob, time_limit_s=options.time_limit_s * buckets, options=options,
                  warm_start=start is not None)
    if run is None:
        return None
    objective = run.objective * scale
    bound = objective if run.optimal else None if run.bound is None else run.bound * scale
    return IlpResult(decisions=problem.decisions(), status="optimal" if run.optimal else "feasible",
                     seconds=run.seconds, objective=objective, bound=bound)


def _plan_or_none(made: tuple[JointProblem, float], options: SolverOptions,
                  buckets: int | None = None) -> IlpResult | None:
    """``_run`` on a made problem (and its objective's scale); None if it is
    infeasible or CBC found no plan in time."""
    problem, scale = made
    try:
        return _run(problem, options, scale=scale, buckets=buckets)
    except NoPlanInTime:
        return None


#: Relative gap at which the one solve of ``_budget_idle`` may stop: on 32
#: alike layers CBC finds its plan in a second or two and then spends its whole
#: time limit failing to prove the last percent (synthetic 32 layers, three
#: codecs: 5.4% proven in 4 s, 1% in about 8 on 2 loaded cores).
IDLE_GAP_REL = 0.01


def _budget_idle(model: CostModel, weights: Sequence[BucketWeight], make: Callable[..., tuple[JointProblem, float]],
                 combine: Callable[[list[float]], float], weigh: Callable[[BucketWeight], float], *,
                 risk_budget: float, options: SolverOptions) -> IlpResult | None:
    """The joint problem in one solve, when its error budget does not bind.

    Without the error budget every bucket's problem is the same one (a
    bucket's weight only scales its objective, by ``weigh``). Its plan, run
    in every bucket, has the error of the exposure-blind plan (the error
    shares sum to 1); if that is within the budget, the plan is best in every
    bucket, so for the joint problem, and it is the blind plan too. One solve
    instead of one per bucket, and of the blind plan's: on a 128-layer trace
    each takes seconds. None where the budget binds (or CBC found nothing).
    """
    one = dataclasses.replace(weights[0], samples=1.0, error=1.0)
    # It replaces one solve per bucket, so it gets their time, and may stop
    # once its plan is proven within IDLE_GAP_REL (stated as the plan's gap).
    patient = dataclasses.replace(options, gap_rel=max(options.gap_rel, IDLE_GAP_REL))
    part = _plan_or_none(make(model, [one], risk_budget=math.inf), patient, buckets=len(weights))
    if part is None:
        return None
    plan = part.decisions[one.name]
    if plan_risk(model, plan, sum(w.error for w in weights)) > risk_budget:
        return None
    decisions = {w.name: dict(plan) for w in weights}
    return IlpResult(decisions=decisions, status=part.status, seconds=part.seconds,
                     objective=combine([weigh(w) * part.objective for w in weights]),
                     bound=None if part.bound is None else combine([weigh(w) * part.bound for w in weights]),
                     blind=decisions)


def _solve_apart(model: CostModel, weights: Sequence[BucketWeight], make: Callable[..., tuple[JointProblem, float]],
                 combine: Callable[[list[float]], float], *, risk_budget: float,
                 options: SolverOptions,
                 weigh: Callable[[BucketWeight], float]) -> IlpResult | None:
    """A joint problem solved one bucket at a time, when that is exact.

    Only the error budget couples the buckets. Each bucket alone, given the
    whole budget, is a relaxation of its part of the joint problem; when the
    plans found that way add up to no more error than the budget together,
    they solve the joint problem, whose objective ``combine``s the buckets'
    (the sum of their times, the largest of their memories) and so does its
    bound. Otherwise (the budget binds) or if a bucket finds nothing, None:
    the caller solves the joint problem. Worth it because CBC branches on the
    alike buckets of a joint problem at once: on the shipped small trace the
    three-bucket min-memory problem stopped at its 12 s limit unproven, while
    each bucket alone is solved in well under a second. Where the budget does
    not bind at all, one solve serves every bucket (``_budget_idle``).
    """
    if len(weights) < 2:
        return None
    idle = _budget_idle(model, weights, make, combine, weigh, risk_budget=risk_budget, options=options)
    if idle is not None:
        return idle
    parts: list[IlpResult] = []
    for w in weights:
        part = _plan_or_none(make(model, [w], risk_budget=risk_budget), options)
        if part is None:
            return None
        parts.append(part)
    decisions = {w.name: part.decisions[w.name] for w, part in zip(weights, parts)}
    if sum(plan_risk(model, decisions[w.name], w.error) for w in weights) > risk_budget:
        return None
    bounds = [part.bound for part in parts]
    return IlpResult(decisions=decisions,
                     status="optimal" if all(part.status == "optimal" for part in parts) else "feasible",
                     seconds=sum(part.seconds for part in parts),
                     objective=combine([part.objective for part in parts]),
                     bound=None if None in bounds else combine(bounds))


def solve_min_time(model: CostModel, *, budget_bytes: int, weights: Sequence[BucketWeight],
                   risk_budget: float, options: SolverOptions,
                   start: Mapping[str, Mapping[str, str]] | None = None) -> IlpResult | None:
    """Fastest plans over the exposure mix within ``budget_bytes`` and the shared
    error budget; None if infeasible. ``decisions`` maps bucket -> unit -> option.

    ``start``: plans known to satisfy every constraint here (the min-memory
    ones, or a smaller budget's). CBC starts cold all the same, because its
    feasibility pump finds better plans than it does from a MIP start; it runs
    from ``start`` only if it found nothing in time, and ``start`` is returned
    if CBC stopped early with a slower plan or found none even from it.
    """
    make = functools.partial(min_time_problem, budget_bytes=budget_bytes, tying=problem_tying(model, options))
    result = _solve_apart(model, weights, make, sum, risk_budget=risk_budget, options=options,
                          weigh=lambda w: max(w.samples, MIN_TIME_WEIGHT))
    if result is None:
        problem, _ = min_time_problem(model, weights, budget_bytes=budget_bytes, risk_budget=risk_budget,
                                      tying=problem_tying(model, options, joint=len(weights) > 1))
        began = time.perf_counter()
        try:
            result = _run(problem, options, scale=problem.second_unit)
        except NoPlanInTime:
            if start is None:
                raise
            try:
                result = _run(problem, options, scale=problem.second_unit, start=start)
            except NoPlanInTime:
                # A loaded machine can leave CBC no time even from the start;
                # the start satisfies every constraint, so it is the plan.
                result = IlpResult(decisions={k: dict(v) for k, v in start.items()}, status="feasible",
                                   seconds=time.perf_counter() - began,
                                   objective=expected_time_s(model, weights, start), bound=None)
    if result is not None and result.status != "optimal":
        # Stopped early: never return plans slower than the known ones, nor
        # than the exposure-blind plan, a point of the same problem.
        blind = result.blind if result.blind is not None else _blind_plans(model, weights, make, risk_budget, options)
        result = _no_worse_than(result, (start, blind), lambda plans: expected_time_s(model, weights, plans))
        result = dataclasses.replace(result, blind=blind)
    return result


def _no_worse_than(result: IlpResult, known: Sequence[Mapping[str, Mapping[str, str]] | None],
                   objective: Callable[[Mapping[str, Mapping[str, str]]], float]) -> IlpResult:
    """The best of ``result`` and the ``known`` plans (None: none) by ``objective``, lower
    being better; on a tie the earlier one (``result`` first) is kept."""
    for plans in known:
        value = None if plans is None else objective(plans)
        if value is not None and value < result.objective:
            result = dataclasses.replace(result, decisions={k: dict(v) for k, v in plans.items()}, objective=value)
    return result


def blind_min_time(model: CostModel, weights: Sequence[BucketWeight], *, budget_bytes: int, risk_budget: float,
                   options: SolverOptions) -> dict[str, dict[str, str]] | None:
    """The exposure-blind plans within ``budget_bytes``: one bucket's fastest plan at
    error share 1, in every bucket; None for one bucket, or where it fits no plan."""
    make = functools.partial(min_time_problem, budget_bytes=budget_bytes, tying=problem_tying(model, options))
    return _blind_plans(model, weights, make, risk_budget, options)


def _blind_plans(model: CostModel, weights: Sequence[BucketWeight], make: Callable[..., tuple[JointProblem, float]],
                 risk_budget: float, options: SolverOptions) -> dict[str, dict[str, str]] | None:
    """One bucket's best plan (by ``make``'s objective: time or memory) at error
    share 1, in every bucket; None for one bucket or none found.

    The error shares sum to 1, so one plan run in every bucket has the error
    it has alone: the exposure-blind plan satisfies the joint problem, and a
    single bucket is solved far faster than the joint one. Where CBC stopped
    on the joint problem with slower plans (the 8B roofline trace with int4:
    52.7 ms of recovery over the mix at a 7.9% gap, the blind plan 51.4),
    the buckets take the blind plan rather than lose to it.
    """
    if len(weights) < 2:
        return None
    whole = dataclasses.replace(weights[0], samples=sum(w.samples for w in weights), error=1.0)
    problem, scale = make(model, [whole], risk_budget=risk_budget)
    try:
        one = _run(problem, options, scale=scale)
    except NoPlanInTime:
        return None
    return None if one is None else {w.name: dict(one.decisions[whole.name]) for w in weights}


def solve_min_memory(model: CostModel, *, weights: Sequence[BucketWeight], risk_budget: float,
                     options: SolverOptions) -> IlpResult:
    """The plans whose largest bucket memory is least, under the same rules and error budget.

    Always feasible: storing every unit satisfies every constraint.
    """
    make = functools.partial(min_memory_problem, tying=problem_tying(model, options))
    result = _solve_apart(model, weights, make, max, risk_budget=risk_budget, options=options,
                          weigh=lambda w: 1.0)
    if result is None:
        problem, scale = min_memory_problem(model, weights, risk_budget=risk_budget,
                                            tying=problem_tying(model, options, joint=len(weights) > 1))
        result = _run(problem, options, scale=scale)
    if result is None:
        raise RuntimeError("CBC reports the min-memory problem infeasible, yet store-all satisfies it")
    if result.status != "optimal":
        # Stopped early: the exposure-blind plan is a point of the same problem,
        # solved alone far faster. On the frontier bench's small trace the joint
        # problem stopped at 170.3 MB where the blind plan needs 165.6 MB, and
        # the bucketed plan was refused a ceiling the blind one met.
        blind = result.blind if result.blind is not None else _blind_plans(model, weights, make, risk_budget, options)
        result = _no_worse_than(result, (blind,),
                                lambda plans: max(simulate(model, d).memory_bytes for d in plans.values()))
    return result
