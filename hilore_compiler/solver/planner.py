"""solve(): a trace, a memory budget and an error budget in, checked per-bucket plans out.

One ILP over every exposure bucket (``ilp.py``): the buckets share one error
budget for the whole update (``risk.py``), weighted by a batch's exposure mix
(``mix.py``), so low-mass buckets take the fast, lossy options. The least-memory
plans are solved first (they decide feasibility and name the smallest feasible
budget). The solver's answer is not trusted: each bucket's plan is
re-simulated with the same model (``memory.simulate``) and checked, and so is
the summed risk. The plan's records are written as a fixed plan's are
(``assembly.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..planfile import BucketSpec, Plan, SolverStats
from ..tracefile import Trace
from ..vocabulary import GC_SAVES_NOTHING, STORE, check_codecs
from .assembly import (bucket_plan, bucket_summary, memory_records, mix_exposures, plan_units, planned_shares,
                       skip_bucket)
from .budget import Budget, format_bytes, format_seconds, parse_budget
from .cbc import SolverOptions, check_cbc, reporting
from .limits import Deadline, PlanningLimits, check_units, load_bounded
from .ilp import BucketWeight, expected_time_s
from .solving import blind_min_time, solve_min_memory, solve_min_time
from .lossmodel import modelled_loss_ratio
from .memory import CostModel, Prediction, cost_model, peak_parts, rule_violations, simulate
from .mix import zero_share
from .risk import (
    DEFAULT_NUM_BUCKETS,
    DEFAULT_RISK_BUDGET,
    format_error,
    parse_risk_budget,
    plan_risk,
)

DEFAULT_BUDGET = "1.10x-gc"
#: Re-simulated memory (risk) may exceed the budget (risk budget) by this
#: fraction before the plan is rejected: CBC accepts binaries within 1e-6 of 0
#: or 1, which can shift a sum by about that fraction. Real disagreements
#: between the ILP and the model are far larger.
TOLERANCE = 1e-6

Progress = Callable[[str], None]


class InfeasibleBudgetError(ValueError):
    """No plan fits the memory budget; the message names the smallest that does."""

    def __init__(self, message: str, *, bucket: str, budget_bytes: int, min_budget_bytes: int) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes


def infeasible_cause(error: BaseException) -> InfeasibleBudgetError | None:
    """The InfeasibleBudgetError behind a compile failure (dynamo wraps it), or None."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, InfeasibleBudgetError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def allowed_codecs(trace: Trace, codecs: Sequence[str] | str | None) -> tuple[str, ...]:
    """The codecs the planner may use: all the trace measured, or those named."""
    known = sorted({name for u in trace.units for name in u.codecs})
    if codecs is None:
        return tuple(known)
    if isinstance(codecs, str):
        codecs = [c.strip() for c in codecs.split(",") if c.strip()]
    return check_codecs(codecs, known, f"the trace of {trace.model} measured")


def prepare(trace: Trace | str | os.PathLike, *, codecs: Sequence[str] | str | None,
            batch: int | None, seq_len: int | None, loss_ratio: float | None = None,
            accumulate_gradients: bool = False, limits: PlanningLimits | None = None) -> tuple[Trace, CostModel]:
    """Load the trace if given a path and evaluate its costs at the planned shape; a trace
    with more units than ``limits.max_units`` is refused before either. ``loss_ratio``
    None: the loss modelled from the trace's outputs (``lossmodel``)."""
    limits = limits or PlanningLimits()
    if isinstance(trace, (str, os.PathLike)):
        trace = load_bounded(trace, limits)
    if not isinstance(trace, Trace):
        raise TypeError(f"solve() needs a Trace or a trace file path, got {type(trace).__name__}")
    check_units(len(trace.units), f"the trace of {trace.model}", limits)
    batch = trace.batch if batch is None else batch
    seq_len = trace.seq_len if seq_len is None else seq_len
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if loss_ratio is None:
        loss_ratio = modelled_loss_ratio(trace.output_dtype)
    if not (isinstance(loss_ratio, (int, float)) and math.isfinite(loss_ratio) and loss_ratio >= 0):
        raise ValueError(f"loss_ratio must be a finite number >= 0 (the loss's peak over its input's "
                         f"bytes), got {loss_ratio!r}")
    model = cost_model(trace, batch=batch, seq_len=seq_len, codecs=allowed_codecs(trace, codecs),
                       loss_ratio=float(loss_ratio), accumulate_gradients=bool(accumulate_gradients))
    return trace, model


def verify(model: CostModel, decisions: dict[str, str], *, budget_bytes: int | None) -> Prediction:
    """Re-simulate one bucket's plan; raise if it breaks a rule or the memory budget."""
    problems = rule_violations(model, decisions)
    if problems:
        raise RuntimeError("solver plan breaks the model's rules, the ILP and the memory model "
                           "disagree: " + "; ".join(problems[:3]))
    prediction = simulate(model, decisions)
    if budget_bytes is not None and prediction.memory_bytes > budget_bytes * (1 + TOLERANCE):
        raise RuntimeError(
            f"solver plan needs {prediction.memory_bytes} bytes, over the budget {budget_bytes}: "
            "the ILP and the memory model disagree"
        )
    return prediction


def verify_risk(model: CostModel, plans: Mapping[str, Mapping[str, str]],
                weights: Sequence[BucketWeight], risk_budget: float) -> dict[str, float]:
    """Each bucket's re-computed risk; raise if their sum is over the shared budget."""
    risks = {w.name: plan_risk(model, plans[w.name], w.error) for w in weights}
    if sum(risks.values()) > risk_budget * (1 + TOLERANCE) + 1e-15:
        raise RuntimeError(f"solver plans have error {format_error(sum(risks.values()))}, over the "
                           f"error budget {format_error(risk_budget)}")
    return risks


#: The share of a ceiling that plans keep free for the memory model's error
#: (``ceiling_headroom``): a multiple of GC's measured peak
#: (``gc_peak_bytes``) or of a predicted reference (``1.10x-gc``, zero
#: config) is held to the step's measured peak. A budget in bytes is the
#: user's exact figure, planned to as given. The largest under-prediction measured on a plan: 0.4 MB of 207
#: MB, 0.2%, on ``hilore bench``'s all-int8 plan, which without headroom
#: planned to 0.2% under its ceiling and measured 0.1% over it; at
#: Qwen2.5-0.5B's widths (4 layers, 2 x 2048) the zero-config plan, solved to
#: its ceiling, measured 0.03% over it. 1% keeps five times that free.
CEILING_HEADROOM = 0.01


def _infeasible(model: CostModel, *, budget_text: str, budget_bytes: int, risk_budget: float,
                need: int, least: int, bucket: str, gc_bytes: int) -> InfeasibleBudgetError:
    """The error for an infeasible budget, naming ``need``, the smallest feasible one,
    also as a multiple of ``gc_bytes``, the GC peak that ``x-gc`` budgets are relative to
    (from ``least``, the least predicted peak, with the headroom an ``x-gc`` ceiling keeps)."""
    # Round the ratio up, so that passing it back as a budget is feasible.
    ratio = f", {math.ceil(least / (1 - CEILING_HEADROOM) / gc_bytes * 1000) / 1000:.3f}x-gc" \
        if gc_bytes > 0 else ""
    return InfeasibleBudgetError(
        f"memory budget {budget_text} ({format_bytes(budget_bytes)}) is infeasible for bucket "
        f"{bucket} (error budget {format_error(risk_budget)}) at batch {model.batch}, seq_len "
        f"{model.seq_len}: the smallest feasible budget is {format_bytes(need)} ({need} bytes{ratio})",
        bucket=bucket, budget_bytes=budget_bytes, min_budget_bytes=need,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LeastMemory:
    """The least-memory plans under the rules and the shared error budget."""

    #: ``{bucket: {unit key: option}}``.
    decisions: dict[str, dict[str, str]]
    #: The largest bucket's re-simulated memory, and that bucket.
    memory_bytes: int
    bucket: str
    #: False when CBC stopped before proving it least (then memory_bytes is an upper bound).
    proven: bool
    seconds: float


def least_memory(model: CostModel, *, weights: Sequence[BucketWeight], risk_budget: float,
                 options: SolverOptions) -> LeastMemory:
    """Solve the min-memory ILP and re-simulate its plans."""
    least = solve_min_memory(model, weights=weights, risk_budget=risk_budget, options=options)
    decisions = {name: dict(d) for name, d in least.decisions.items()}
    verify_risk(model, decisions, weights, risk_budget)
    memory = {name: verify(model, d, budget_bytes=None).memory_bytes for name, d in decisions.items()}
    worst = max(memory, key=memory.get)
    return LeastMemory(decisions=decisions, memory_bytes=memory[worst], bucket=worst,
                       proven=least.status == "optimal", seconds=least.seconds)


def solve_buckets(model: CostModel, weights: Sequence[BucketWeight], *, budget_text: str,
                  budget_bytes: int, risk_budget: float, options: SolverOptions, gc_bytes: int | None = None,
                  headroom: float = 0.0, deadline: Deadline | None = None,
                  ) -> tuple[dict[str, dict[str, str]], SolverStats, str | None]:
    """The joint plans (``{bucket: {unit: option}}``), checked, the blind plan's in every
    bucket where distinct ones do not pay (``buckets_that_pay``), with that note or None;
    InfeasibleBudgetError if none fit.

    ``gc_bytes``: the GC peak ``x-gc`` budgets are relative to (default: the
    model's prediction). ``headroom``: the share of ``budget_bytes`` the
    predictions keep free (``CEILING_HEADROOM``); an infeasible
    budget's smallest feasible one includes it. ``deadline``: the end of every
    ILP build and CBC run here (``limits``); each phase's runs share the time left.
    """
    ceiling = math.floor(budget_bytes * (1 - headroom))
    deadline = deadline or Deadline(PlanningLimits().total_time_s)
    # A phase runs each bucket alone, then maybe jointly and the blind plan.
    runs = 2 * len(weights) + 2
    deadline.check("the min-memory ILP")
    least = least_memory(model, weights=weights, risk_budget=risk_budget, options=deadline.share(options, 2 * runs))
    fits = least.memory_bytes <= ceiling
    infeasible = dict(model=model, budget_text=budget_text, budget_bytes=budget_bytes,
                      risk_budget=risk_budget, need=math.ceil(least.memory_bytes / (1 - headroom)),
                      least=least.memory_bytes,
                      bucket=least.bucket, gc_bytes=model.gc_bytes if gc_bytes is None else gc_bytes)
    if not fits and least.proven:
        raise _infeasible(**infeasible)
    deadline.check("the min-time ILP")
    result = solve_min_time(model, budget_bytes=ceiling, weights=weights, risk_budget=risk_budget,
                            options=deadline.share(options, runs), start=least.decisions if fits else None)
    if result is None:
        raise _infeasible(**infeasible)
    plans = {name: dict(d) for name, d in result.decisions.items()}
    for d in plans.values():
        verify(model, d, budget_bytes=ceiling)
    verify_risk(model, plans, weights, risk_budget)
    # One solve for all buckets: each bucket reports the joint problem's stats.
    stats = SolverStats(status=result.status, seconds=least.seconds + result.seconds,
                        objective=result.objective, gap=result.gap)
    if result.blind is None and deadline.remaining() <= 0:
        return plans, stats, None  # no time left to solve the blind plan that buckets are weighed against
    plans, collapsed = buckets_that_pay(model, weights, plans, budget_bytes=ceiling, risk_budget=risk_budget,
                                        options=deadline.share(options, 1), blind=result.blind)
    return plans, stats, collapsed


#: The share of the exposure-blind plan's expected recovery time that
#: distinct plans per exposure bucket must save to be kept. Each distinct plan
#: is one more compiled variant of every graph (compile time, code memory, a
#: dispatch per call); below this the buckets all run the blind plan, which
#: the joint problem allows (the error shares sum to 1). The same price as a
#: length bucket's (``solver.lengths.LENGTH_BUCKET_PRICE``).
EXPOSURE_BUCKET_PRICE = 0.02


def buckets_that_pay(model: CostModel, weights: Sequence[BucketWeight], plans: dict[str, dict[str, str]], *,
                     budget_bytes: int, risk_budget: float, options: SolverOptions,
                     blind: Mapping[str, Mapping[str, str]] | None = None) -> tuple[dict[str, dict[str, str]], str | None]:
    """``plans``, or the exposure-blind plan in every bucket where ``plans`` save
    less than ``EXPOSURE_BUCKET_PRICE`` of its expected time; and a note saying so (or None).

    ``blind``: the blind plans if already solved under the same budget (``IlpResult.blind``)."""
    if len({tuple(sorted(d.items())) for d in plans.values()}) < 2:
        return plans, None
    if blind is None:
        blind = blind_min_time(model, weights, budget_bytes=budget_bytes, risk_budget=risk_budget, options=options)
    if blind is None:
        return plans, None
    joint_s, blind_s = expected_time_s(model, weights, plans), expected_time_s(model, weights, blind)
    if joint_s < blind_s * (1 - EXPOSURE_BUCKET_PRICE):
        return plans, None
    for d in blind.values():
        verify(model, d, budget_bytes=budget_bytes)
    verify_risk(model, blind, weights, risk_budget)
    saved = 1 - joint_s / blind_s if blind_s > 0 else 0.0
    note = (f"one plan in every exposure bucket: distinct plans would save {saved:.1%} of its expected "
            f"recovery time ({format_seconds(joint_s)} against {format_seconds(blind_s)}), under the "
            f"{EXPOSURE_BUCKET_PRICE:.0%} a bucket's compiled variant must pay")
    return {k: dict(v) for k, v in blind.items()}, note


def solve(trace: Trace | str | os.PathLike, memory_budget: str | int | float = DEFAULT_BUDGET,
          risk_budget: float | str | None = DEFAULT_RISK_BUDGET,
          buckets: int | Sequence[BucketSpec | tuple] = DEFAULT_NUM_BUCKETS,
          codecs: Sequence[str] | str | None = None, batch: int | None = None,
          seq_len: int | None = None, *, exposure_mix: Sequence[float] | str | os.PathLike | None = None,
          gradient_exposures: Sequence[float] | None = None, loss_ratio: float | None = None,
          gc_peak_bytes: int | None = None,
          accumulate_gradients: bool = False, options: SolverOptions | None = None,
          progress: Progress | None = None, limits: PlanningLimits | None = None,
          budget: str | int | float | None = None) -> Plan:
    """Plan store / compress / recompute per recovery unit for every exposure bucket, jointly.

    ``memory_budget`` (the backend option's name; ``budget=`` is the same
    argument under its earlier name): ``"6GiB"``, ``"750MB"``, ``123456`` (bytes), ``"1.10x-gc"`` or
    ``"0.5x-store"``; it bounds the step's predicted peak (``memory.py``), and
    ``x-gc`` is relative to GC's predicted peak, or to ``gc_peak_bytes`` when
    given (GC's measured peak). ``loss_ratio``: the loss's own peak as a
    multiple of the graph's outputs' bytes (``bench.measure.loss_side`` measures it;
    0 leaves the loss out; None, the default, models it from the outputs' dtype:
    ``lossmodel``).
    ``risk_budget``: the whole update's squared relative gradient error, or
    ``"cos>=0.999"`` (the default; ``risk.py``). ``buckets``: a count (split
    at the mix's quantiles, ``risk.default_buckets``) or explicit
    ``BucketSpec(name, lo, hi, exposure)`` / 4-tuples. The ``zero`` bucket
    (plan ``skip``) is always added. ``exposure_mix``: plan exposures of a
    typical batch, or a ``hilore.exposure-mix/v1`` file (default: GRPO's, ``mix.py``).
    ``gradient_exposures``: where the mix holds off-policy bounds, each
    sample's expected (on-policy) exposure, which weighs the buckets' error
    (``mix.bucket_shares``). ``codecs``: names the trace measured (default: all). ``batch`` /
    ``seq_len``: plan for another shape than traced. ``accumulate_gradients``:
    the graph runs one microbatch of an update that sums gradients over
    several (``grpo.actor_update``), so every weight's gradient is alive
    through all of it, GC's reference peak included. ``limits``: the most units
    and the total ILP time (``limits.PlanningLimits``; default 20,000 units, 120 s).
    """
    if budget is not None:
        if memory_budget != DEFAULT_BUDGET and memory_budget != budget:
            raise TypeError(f"solve() got memory_budget={memory_budget!r} and budget={budget!r}: give one "
                            "(budget is memory_budget's earlier name)")
        memory_budget = budget
    check_cbc()
    error2 = parse_risk_budget(risk_budget)
    trace, model = prepare(trace, codecs=codecs, batch=batch, seq_len=seq_len, loss_ratio=loss_ratio,
                           accumulate_gradients=accumulate_gradients, limits=limits)
    parsed = parse_budget(memory_budget)
    check_gc_peak(gc_peak_bytes)
    budget_bytes = parsed.bytes_at(gc_bytes=gc_peak_bytes or model.gc_bytes, store_bytes=model.store_bytes)
    return plan_model(trace, model, budget=parsed, budget_bytes=budget_bytes, risk_budget=error2,
                      buckets=buckets, exposure_mix=exposure_mix, gradient_exposures=gradient_exposures,
                      loss_ratio=loss_ratio, gc_peak_bytes=gc_peak_bytes,
                      accumulate_gradients=accumulate_gradients, options=options, progress=progress,
                      limits=limits)


def gc_saves_nothing(model: CostModel) -> str:
    """The note a plan carries when GC's predicted peak is store-all's: an
    ``x-gc`` ceiling then holds store-all, and no plan needs to give up time."""
    return (f"{GC_SAVES_NOTHING}: its predicted peak ({format_bytes(model.gc_bytes)}) is store-all's "
            f"({format_bytes(model.store_bytes)}), both at {peak_phase(model)}, where activations are freed; "
            "a ceiling of 1x-gc or more stores every unit")


def peak_phase(model: CostModel) -> str:
    """Where store-all's predicted peak falls (``memory.peak_parts``)."""
    return peak_parts(model, {u.key: STORE for u in model.units}).at


def ceiling_headroom(budget: Budget, gc_peak_bytes: int | None) -> float:
    """The share of ``budget`` a plan keeps free (``CEILING_HEADROOM``): a ceiling
    relative to GC or store-all holds the measured step, so the prediction keeps
    room for the memory model's error; bytes are planned to exactly."""
    return CEILING_HEADROOM if gc_peak_bytes is not None or budget.reference != "bytes" else 0.0


def check_gc_peak(gc_peak_bytes: int | None) -> None:
    """Refuse a ``gc_peak_bytes`` that is not a positive int: ``x-gc`` budgets are multiples of it."""
    if gc_peak_bytes is not None and not (isinstance(gc_peak_bytes, int) and gc_peak_bytes > 0):
        raise ValueError(f"gc_peak_bytes must be a positive byte count (GC's measured peak), got {gc_peak_bytes!r}")


def plan_model(trace: Trace, model: CostModel, *, budget: Budget, budget_bytes: int, risk_budget: float,
               buckets: int | Sequence[BucketSpec | tuple], exposure_mix: Sequence[float] | str | os.PathLike | None,
               gradient_exposures: Sequence[float] | None, loss_ratio: float | None, gc_peak_bytes: int | None,
               accumulate_gradients: bool, options: SolverOptions | None, progress: Progress | None,
               limits: PlanningLimits | None = None) -> Plan:
    """``solve`` on an evaluated cost model, under ``budget_bytes``; ``risk_budget`` parsed.
    Every ILP build and CBC run here shares ``limits.total_time_s``."""
    limits = limits or PlanningLimits()
    check_units(len(model.units), f"the trace of {trace.model}", limits)
    deadline = Deadline(limits.total_time_s)
    options = options or SolverOptions()
    say = progress or (lambda _msg: None)
    error2 = risk_budget
    exposures = mix_exposures(exposure_mix)
    shares = planned_shares(buckets, exposures, gradient_exposures)
    weights = [BucketWeight(name=s.spec.name, samples=s.samples, error=s.error) for s in shares]
    say(f"planning {trace.model}: {len(model.units)} units x {len(shares)} buckets at batch "
        f"{model.batch}, seq_len {model.seq_len}, budget {budget.text} = {format_bytes(budget_bytes)}, "
        f"error budget {format_error(error2)}")
    headroom = ceiling_headroom(budget, gc_peak_bytes)
    with reporting(lambda line: say(f"solver: {line}")) if progress else contextlib.nullcontext():
        plans, stats, collapsed = solve_buckets(model, weights, budget_text=budget.text, budget_bytes=budget_bytes,
                                                risk_budget=error2, options=options, gc_bytes=gc_peak_bytes,
                                                headroom=headroom, deadline=deadline)
    if collapsed:
        say(collapsed)
    solved = [bucket_plan(model, s, plans[s.spec.name], solver=stats) for s in shares]
    for b in solved:
        say(bucket_summary(b))
    total = sum(b.risk for b in solved)
    say(f"{stats.status} in {stats.seconds:.2f} s; predicted error of the whole update "
        f"{format_error(total)}")
    notes = [*trace.notes, f"error: predicted relative L2 error of the whole update's gradient, "
             f"budget {format_error(error2)}; mix of {len(exposures)} samples"]
    if collapsed:
        notes.append(collapsed)
    if gc_peak_bytes is not None:
        notes.append(f"x-gc budget relative to GC's measured peak {gc_peak_bytes} bytes "
                     f"(predicted {model.gc_bytes})")
    if headroom:
        notes.append(f"predicted peaks kept {headroom:.0%} under the ceiling for the memory model's error")
    if model.step.output_bytes:
        ratio = model.step.loss_bytes / model.step.output_bytes
        source = (f"modelled for {trace.output_dtype or 'unknown'} outputs" if loss_ratio is None
                  else "given")
        notes.append(f"step terms: outputs {model.step.output_bytes} bytes, loss {model.step.loss_bytes} "
                     f"bytes (loss_ratio {ratio:.3g}, {source})")
    if model.gc_bytes >= model.store_bytes:
        notes.append(gc_saves_nothing(model))
    if accumulate_gradients:
        notes.append(f"gradients accumulate over microbatches: {model.step.held_gradient_bytes} bytes of "
                     "weight gradients alive through every phase")
    if (model.batch, model.seq_len) != (trace.batch, trace.seq_len):
        notes.append(f"planned for batch {model.batch}, seq_len {model.seq_len}; traced at batch "
                     f"{trace.batch}, seq_len {trace.seq_len}: sizes re-evaluated, seconds scaled by bytes")
    return Plan(
        model=trace.model, fingerprint=trace.fingerprint, batch=model.batch, seq_len=model.seq_len,
        budget=budget.text, budget_bytes=budget_bytes, gc_bytes=model.gc_bytes,
        store_bytes=model.store_bytes, risk_budget=error2,
        codecs=tuple(sorted({c for u in model.units for c in u.codecs})), cost_source=trace.cost_source,
        buckets=(skip_bucket(zero_share(exposures)), *solved), units=plan_units(model), notes=tuple(notes),
        trace=trace, **memory_records(trace, model, {s.spec.name: plans[s.spec.name] for s in shares}),
    )

