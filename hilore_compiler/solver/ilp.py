"""The ILP of one exposure bucket (PuLP + CBC), in the paper's words.

Variables
    x[u, o]  binary: recovery unit u takes option o (store, compress:<codec>,
             recompute). Exactly one per unit.
    T        continuous: the most bytes backward holds at once to recover
             units (``memory.py``): the recomputed and decoded units of one
             layer plus one unit's recompute workspace. Every term is linear
             in x, so T >= each of them needs no auxiliary variables; the
             per-layer sum is the conservative upper bound of "a unit plus its
             recomputed inputs" (those lie in its layer by the chain rule).

Objective: minimise recovery time (recompute seconds + codec seconds); the
second problem here minimises memory instead, to name the smallest feasible
budget when the first is infeasible.

Units inside the ILP: memory in thousandths of the store-all bytes and time in
thousandths of the slowest plan's time, whatever the model's size. CBC's
tolerances are absolute (1e-7 primal, 1e-6 integrality and objective cutoff
steps): with raw bytes (1e9) or seconds (1e-6) it either loses bytes or
stalls on gaps that are pure round-off; a 41-unit trace in milliseconds did.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pulp

from ..planfile import COMPRESS_PREFIX, RECOMPUTE
from .memory import CostModel, group_of

#: Memory and time enter the ILP in thousandths of a reference (see
#: ``_Formulation.byte_unit``), so coefficients are ~1e-3..1e3 on any model.
SCALE = 1e3
#: A binary counts as chosen above this value: CBC returns integers only up to
#: its integrality tolerance (1e-6), so never compare with ``== 1``.
CHOSEN = 0.5


class SolverUnavailableError(RuntimeError):
    """CBC, the MILP solver the planner runs, cannot be found."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverOptions:
    """How hard CBC works on each bucket."""

    #: Wall seconds per ILP; then CBC returns its best plan so far (status
    #: ``feasible``, with the gap it proved). Traces of one or two layers and the
    #: small graphs of the tests solve to optimality in a second or less. On a
    #: 32-layer trace CBC's feasibility pump finds its plan within ~3 s but cannot
    #: prove it optimal in minutes (the layers are near-identical, so branching
    #: on which of 32 alike layers takes which pattern does not move the bound);
    #: the proven gap at 4 s is about 0.5-1.5% of recovery time.
    time_limit_s: float = 4.0
    #: Relative MIP gap at which CBC may stop; 0 asks for proven optimality.
    gap_rel: float = 0.0
    #: CBC threads; None leaves CBC's default (one).
    threads: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class IlpResult:
    """The rounded answer of one ILP and how CBC got there."""

    decisions: Mapping[str, str]
    #: ``optimal`` or ``feasible`` (stopped by the time limit).
    status: str
    seconds: float
    #: The objective of ``decisions``, in seconds (time ILP) or bytes (memory ILP).
    objective: float
    #: CBC's proven lower bound on the objective, same units; None if unknown.
    bound: float | None

    @property
    def gap(self) -> float | None:
        """Relative MIP gap: 0 when proven optimal."""
        if self.bound is None:
            return None
        return max(self.objective - self.bound, 0.0) / max(abs(self.objective), 1e-300)


def _cbc(**options: object) -> pulp.LpSolver | None:
    """A CBC that PuLP can run: the binary bundled with PuLP, else one on PATH.

    PuLP 3.3 deprecates PULP_CBC_CMD (the bundled binary) in favour of COIN_CMD
    with ``pip install pulp[cbc]``; until 4.0 the bundled one is what ``pip
    install pulp`` provides, so its deprecation warning is silenced here only.
    """
    for name in ("PULP_CBC_CMD", "COIN_CMD"):
        kind = getattr(pulp, name, None)
        if kind is None:
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
            solver = kind(**options)
        if solver.available():
            return solver
    return None


def check_cbc() -> None:
    """Raise SolverUnavailableError, saying how to get CBC, if PuLP cannot run it."""
    if _cbc(msg=False) is None:
        raise SolverUnavailableError(
            "the CBC solver is not available to PuLP: pulp.PULP_CBC_CMD().available() is "
            "false. `pip install pulp` ships a CBC binary for common platforms (PuLP >= 3.3: "
            "`pip install pulp[cbc]`); otherwise install it (`apt-get install coinor-cbc`) "
            "and point PuLP at it with pulp.PULP_CBC_CMD(path='/usr/bin/cbc')"
        )


def _variable(prob: pulp.LpProblem, name: str, cat: str = pulp.LpContinuous,
              low: float | None = None, up: float | None = None) -> pulp.LpVariable:
    """A variable of ``prob``, created through the problem where PuLP has that
    API (3.3+, the 4.0 way) and through LpVariable before it."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat)
    return pulp.LpVariable(name, low, up, cat)


class _Formulation:
    """Variables and the constraints every bucket's problem shares."""

    def __init__(self, model: CostModel, name: str) -> None:
        self.model = model
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        self.x = {
            (u.key, o): _variable(self.prob, f"x_{i}_{j}", pulp.LpBinary)
            for i, u in enumerate(model.units) for j, o in enumerate(u.options)
        }
        #: Bytes and seconds per ILP unit (see SCALE).
        self.byte_unit = max(sum(u.bytes for u in model.units), 1) / SCALE
        self.second_unit = max(sum(max(map(u.time_s, u.options)) for u in model.units), 1e-12) / SCALE
        self.T = _variable(self.prob, "T_transient", low=0)
        self._one_option_per_unit()
        self._recompute_reads_only_exact_inputs()
        self._largest_transient()

    def _compressed(self, key: str) -> pulp.LpAffineExpression:
        """1 if unit ``key`` is compressed with any codec, else 0."""
        u = self.model.unit(key)
        return pulp.lpSum(self.x[key, COMPRESS_PREFIX + c] for c in u.codecs)

    def _one_option_per_unit(self) -> None:
        # Every recovery unit is stored, compressed with one codec, or recomputed.
        for i, u in enumerate(self.model.units):
            self.prob += pulp.lpSum(self.x[u.key, o] for o in u.options) == 1, f"one_option_{i}"

    def _recompute_reads_only_exact_inputs(self) -> None:
        # Recomputation is bitwise exact, so it never reads a compressed input:
        #   x[u,R] + x[v,compress:*] <= 1            for v in from(u);
        # and recompute chains stay in one layer (memory.py says why):
        #   x[u,R] + x[v,compress:*] + x[v,R] <= 1   for v in from(u) of another layer.
        for i, u in enumerate(self.model.units):
            if not u.recomputable:
                continue
            for j, v in enumerate(self.model.unit(k) for k in u.recompute_from):
                not_exact = self._compressed(v.key)
                if v.recomputable and group_of(v.layer) != group_of(u.layer):
                    not_exact += self.x[v.key, RECOMPUTE]
                if len(not_exact) > 0:
                    self.prob += self.x[u.key, RECOMPUTE] + not_exact <= 1, f"exact_inputs_{i}_{j}"

    def _largest_transient(self) -> None:
        # T covers what backward holds at once while recovering a unit w of
        # layer g: every recomputed or decoded unit of g (full bytes), plus
        # w's recompute workspace if w is recomputed.
        held: dict[str, list] = {}
        for u in self.model.units:
            rebuilt = self._compressed(u.key)
            if u.recomputable:
                rebuilt += self.x[u.key, RECOMPUTE]
            if len(rebuilt) > 0:
                held.setdefault(group_of(u.layer), []).append(u.bytes / self.byte_unit * rebuilt)
        for g, terms in enumerate(held.values()):
            self.prob += self.T >= pulp.lpSum(terms), f"transient_layer_{g}"
        for i, w in enumerate(self.model.units):
            if w.recomputable and w.recompute_transient > 0:
                workspace = w.recompute_transient / self.byte_unit * self.x[w.key, RECOMPUTE]
                self.prob += self.T >= pulp.lpSum(held[group_of(w.layer)]) + workspace, \
                    f"transient_workspace_{i}"

    def memory(self) -> pulp.LpAffineExpression:
        """Kept bytes (stored + compressed) plus the largest transient, in byte units."""
        kept = pulp.lpSum(
            u.kept_bytes(o) / self.byte_unit * self.x[u.key, o] for u in self.model.units for o in u.options
        )
        return kept + self.T

    def time(self) -> pulp.LpAffineExpression:
        """Recovery time: recompute seconds plus encode + decode seconds, in second units."""
        return pulp.lpSum(
            u.time_s(o) / self.second_unit * self.x[u.key, o] for u in self.model.units for o in u.options
        )

    def add_risk_bound(self, exposure: float, risk_budget: float) -> None:
        # Update-conditioned risk: sum of sensitivity x exposure over compressed
        # units stays within the bucket's risk budget.
        risk = pulp.lpSum(
            c.sensitivity * exposure * self.x[u.key, COMPRESS_PREFIX + name]
            for u in self.model.units for name, c in u.codecs.items()
        )
        self.prob += risk <= risk_budget, "risk_budget"

    def decisions(self) -> dict[str, str]:
        """The chosen option per unit, rounding binaries at CHOSEN."""
        chosen = {}
        for u in self.model.units:
            picked = [o for o in u.options if (self.x[u.key, o].varValue or 0.0) > CHOSEN]
            if len(picked) != 1:
                raise RuntimeError(f"CBC returned {len(picked)} options for unit {u.key}")
            chosen[u.key] = picked[0]
        return chosen


class _NoPlanInTime(RuntimeError):
    """CBC stopped at the time limit without any plan."""


def _run_cbc(form: _Formulation, options: SolverOptions, scale: float,
             start: Mapping[str, str] | None = None) -> IlpResult | None:
    """Solve; None if infeasible. ``scale`` turns the ILP objective into report units.

    ``start``: a feasible plan CBC begins from (a MIP start).
    """
    if start is not None:
        for (key, option), var in form.x.items():
            var.setInitialValue(1 if start[key] == option else 0)
    with tempfile.TemporaryDirectory(prefix="hilore-cbc-") as tmp:
        log = Path(tmp) / "cbc.log"
        cbc = _cbc(msg=False, timeLimit=options.time_limit_s, gapRel=options.gap_rel,
                   threads=options.threads, logPath=str(log), warmStart=start is not None)
        if cbc is None:
            check_cbc()  # raises, saying how to get CBC
        began = time.perf_counter()
        form.prob.solve(cbc)
        seconds = time.perf_counter() - began
        text = log.read_text() if log.exists() else ""
    if form.prob.status == pulp.LpStatusInfeasible:
        return None
    if form.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise _NoPlanInTime(f"CBC found no plan within {options.time_limit_s} s "
                            f"(status {pulp.LpStatus[form.prob.status]}); raise the time limit")
    optimal = form.prob.sol_status == pulp.LpSolutionOptimal
    objective = (pulp.value(form.prob.objective) or 0.0) * scale
    found = None if optimal else _lower_bound(text)
    bound = objective if optimal else None if found is None else found * scale
    return IlpResult(decisions=form.decisions(), status="optimal" if optimal else "feasible",
                     seconds=seconds, objective=objective, bound=bound)


def _lower_bound(log: str) -> float | None:
    """CBC's best bound when it stopped early, from its log, in ILP units.

    (CBC's own "Gap:" line is rounded to two decimals, too coarse to report.)
    """
    found = re.search(r"^Lower bound:\s*([-+0-9.eE]+)", log, re.MULTILINE)
    return float(found[1]) if found else None


def solve_min_time(model: CostModel, *, budget_bytes: int, exposure: float, risk_budget: float,
                   options: SolverOptions, start: Mapping[str, str] | None = None) -> IlpResult | None:
    """Fastest plan within ``budget_bytes`` and the risk budget; None if infeasible.

    ``start``: a plan known to satisfy every constraint here (a higher-exposure
    bucket's, a smaller budget's, or the min-memory one). CBC starts cold all
    the same, because its feasibility pump finds better plans than it does
    from a MIP start; it runs from ``start`` only if it found nothing in time,
    and ``start`` is returned if CBC stopped early with a slower plan.
    """
    form = _Formulation(model, "hilore_min_time")
    form.prob += form.time()
    # Memory: kept bytes plus the largest transient fit the budget.
    form.prob += form.memory() <= budget_bytes / form.byte_unit, "memory_budget"
    form.add_risk_bound(exposure, risk_budget)
    try:
        result = _run_cbc(form, options, scale=form.second_unit)
    except _NoPlanInTime:
        if start is None:
            raise
        result = _run_cbc(form, options, scale=form.second_unit, start=start)
    if result is not None and start is not None and result.status != "optimal":
        # Stopped early: never return a plan slower than the known one.
        start_s = sum(model.unit(key).time_s(option) for key, option in start.items())
        if start_s < result.objective:
            result = dataclasses.replace(result, decisions=dict(start), objective=start_s)
    return result


def solve_min_memory(model: CostModel, *, exposure: float, risk_budget: float,
                     options: SolverOptions) -> IlpResult:
    """The plan that needs the least memory under the same rules and risk budget.

    Always feasible: storing every unit satisfies every constraint.
    """
    form = _Formulation(model, "hilore_min_memory")
    form.prob += form.memory()
    form.add_risk_bound(exposure, risk_budget)
    result = _run_cbc(form, options, scale=form.byte_unit)
    if result is None:
        raise RuntimeError("CBC reports the min-memory problem infeasible, yet store-all satisfies it")
    return result
