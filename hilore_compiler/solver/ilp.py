"""The ILP over every exposure bucket at once (PuLP + CBC), in the paper's words.

Variables, per nonzero bucket b
    x[b, u, o]  binary: recovery unit u takes option o (store,
                compress:<codec>, recompute) in bucket b. One per unit.
    T[b, g]     continuous: the most bytes the backward of segment g holds
                at once besides kept ones (``memory.py``): at each cut of g,
                its rebuilt units, workspace and backward terms. A unit's
                bytes count at the cuts of its window when it is not stored;
                a recomputed unit's also after it, through z[b, u, p] >=
                x[b, v, R] - x[b, u, S] for each recomputed reader v rebuilt
                at p (``segments.rebuilt_from``). z and the segment's workspace
                W[b, g] are continuous: minimising time under a ceiling on T
                never gains from raising them.

Memory of bucket b at each phase (``memory.peak_parts``), all under the
ceiling: kept + the loss's peak; kept - kept of the layers + the end of
backward; and, per segment g, kept - kept of the layers backward finished
before g + T[b, g]. Kept bytes are linear in x, so this stays an ILP. They
enter each phase through K[b, g] (a segment's kept bytes) and running sums
U[b, s] over the nested sets of segments the phases hold (``kept_chain``), so
every row is a few terms long and the nonzeros grow linearly with depth.
Units of tied layers (``tying.py``) read the variables of the unit that
decides them: x[b, u, o] exists only for the deciding units.

Objective: minimise the expected recovery time over a batch's exposure mix,
sum_b p_b x time_b, p_b the bucket's share of samples (``mix.py``).

Constraints: each bucket's rules and its memory under the ceiling (buckets run
one after another), and one error budget shared by all buckets,
sum_b q_b sum_u s(u)^2 x[b,u,compress], q_b the bucket's error share
(``risk.py``). Only the budget couples the buckets: it is what lets
low-exposure buckets spend error on fast, lossy options that high-exposure
buckets cannot afford. The second problem here
minimises the largest bucket memory instead, to name the smallest feasible
budget when the first is infeasible.

How the problems are solved (one bucket at a time where that is exact, MIP
starts) is ``solving.py``'s; CBC itself (finding it, running it, reading its
log) is ``cbc.py``'s.

Units inside the ILP: memory in thousandths of the store-all bytes and time in
thousandths of the slowest plan's time, whatever the model's size. CBC's
tolerances are absolute (1e-7 primal, 1e-6 integrality and objective cutoff
steps): with raw bytes (1e9) or seconds (1e-6) it either loses bytes or
stalls on gaps that are pure round-off; a 41-unit trace in milliseconds did.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pulp

from ..vocabulary import COMPRESS_PREFIX, RECOMPUTE, STORE, group_of
from .memory import CostModel, UnitCost
from .segments import Segment
from .tying import Tying, untied

#: Memory and time enter the ILP in thousandths of a reference (see
#: ``_Formulation.byte_unit``), so coefficients are ~1e-3..1e3 on any model.
SCALE = 1e3
#: Relative slack on a byte budget inside the ILP (``min_time_problem``); far
#: below the planner's re-simulation tolerance, under a byte up to 1 GB.
BUDGET_SLACK = 1e-9
#: A binary counts as chosen above this value: CBC returns integers only up to
#: its integrality tolerance (1e-6), so never compare with ``== 1``.
CHOSEN = 0.5


def _variable(prob: pulp.LpProblem, name: str, cat: str = pulp.LpContinuous,
              low: float | None = None, up: float | None = None) -> pulp.LpVariable:
    """A variable of ``prob``, created through the problem where PuLP has that
    API (3.3+, the 4.0 way) and through LpVariable before it."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat)
    return pulp.LpVariable(name, low, up, cat)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketWeight:
    """How one bucket enters the joint problem (``risk.BucketShare`` without the range)."""

    name: str
    #: Weight of its recovery time in the objective: its share of a batch's samples.
    samples: float
    #: Its error share (``risk.BucketShare.error``); its risk scales with it.
    error: float


#: Smallest time weight of a bucket: one the mix leaves empty still gets a
#: plan that is fast for the samples that do land in it, not an arbitrary one.
MIN_TIME_WEIGHT = 1e-3


class _Bucket:
    """One bucket's variables and the rules every plan obeys, inside a shared problem.

    Units tied to another (``tying.py``) have no variables of their own: they
    read those of the unit that decides them (``var``), so a rule written for
    each of them says the same of the shared variables and is written once.
    """

    def __init__(self, problem: JointProblem, tag: int) -> None:
        self.problem, self.model, self.tag = problem, problem.model, tag
        self.alias = problem.tying.alias
        prob = problem.prob
        self.x = {
            (u.key, o): _variable(prob, f"x_{tag}_{i}_{j}", pulp.LpBinary)
            for i, u in enumerate(self.model.units) if problem.tying.decides(u.key)
            for j, o in enumerate(u.options)
        }
        #: Per segment: T[g], what its backward holds at once besides kept
        #: bytes and the weights' gradients (those differ by position, so tied
        #: segments share T and the memory rows add them).
        self.T: dict[str, pulp.LpVariable | float] = {}
        self._one_option_per_unit()
        self._recompute_reads_only_exact_inputs()
        self._largest_transient()
        self.unfreed = kept_chain(self)

    def var(self, key: str, option: str) -> pulp.LpVariable:
        """x[u, o] of unit ``key``: its own, or that of the unit deciding it."""
        return self.x[self.alias[key], option]

    def _compressed(self, key: str) -> pulp.LpAffineExpression:
        """1 if unit ``key`` is compressed with any codec, else 0."""
        u = self.model.unit(key)
        return pulp.lpSum(self.var(key, COMPRESS_PREFIX + c) for c in u.codecs)

    def _one_option_per_unit(self) -> None:
        # Every recovery unit is stored, compressed with one codec, or recomputed.
        for i, u in enumerate(self.model.units):
            if self.problem.tying.decides(u.key):
                self.problem.prob += pulp.lpSum(self.x[u.key, o] for o in u.options) == 1, \
                    f"one_option_{self.tag}_{i}"

    def _recompute_reads_only_exact_inputs(self) -> None:
        # Recomputation is bitwise exact, so it never reads a compressed input:
        #   x[u,R] + x[v,compress:*] <= 1            for v in from(u);
        # and recompute chains stay in one layer (memory.py says why):
        #   x[u,R] + x[v,compress:*] + x[v,R] <= 1   for v in from(u) of another layer.
        # Tied units give the same row many times: each is written once.
        written: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for u in self.model.units:
            if not u.recomputable:
                continue
            for v in (self.model.unit(k) for k in u.recompute_from):
                not_exact = [(self.alias[v.key], COMPRESS_PREFIX + c) for c in v.codecs]
                if v.recomputable and group_of(v.layer) != group_of(u.layer):
                    not_exact.append((self.alias[v.key], RECOMPUTE))
                row = (self.alias[u.key], tuple(not_exact))
                if not not_exact or row in written:
                    continue
                written.add(row)
                self.problem.prob += self.var(u.key, RECOMPUTE) + pulp.lpSum(self.x[t] for t in not_exact) <= 1, \
                    f"exact_inputs_{self.tag}_{len(written)}"

    def _largest_transient(self) -> None:
        # Segments whose units and carried units are decided by the same
        # variables, with the same gradient workspace, hold the same transient:
        # one T for them all.
        shared: dict[tuple, pulp.LpVariable | float] = {}
        for s, segment in enumerate(self.model.segments):
            signature = (tuple(self.alias[u.key] for u in segment.units), segment.needed_until, segment.readers,
                         tuple((self.alias[c.key], first, last) for c, first, last in segment.carried),
                         self.model.step.gradient_bytes.get(segment.name, 0),
                         self.model.step.outputs_in(segment.name))
            if signature not in shared:
                shared[signature] = self._transient(s, segment)
            self.T[segment.name] = shared[signature]

    def _transient(self, s: int, segment: Segment) -> pulp.LpVariable | float:
        # T[g] covers what the backward of segment g holds at once besides kept
        # bytes and weight gradients (memory.py): at each cut p, the units
        # rebuilt there, g's recompute workspace or gradient workspace (the
        # larger), and the outputs and what is left of their gradient (a
        # constant, ``StepTerms.outputs_in``). Unit u is
        # rebuilt at p when
        #   p in u's window:  it is not stored (1 - x[u,S]);
        #   p after it:       z[u,p] >= r[v,p] - x[u,S] for each reader v,
        # r[v,p] "v is recomputed and rebuilt at p" (x[v,R] in v's window,
        # z[v,p] after it): recomputing v reads u, so u is rebuilt with it.
        byte_unit, prob = self.problem.byte_unit, self.problem.prob
        step, units = self.model.step, segment.units
        gradient = step.gradient_bytes.get(segment.name, 0)
        outputs = step.outputs_in(segment.name)
        floor = (outputs + gradient) / byte_unit if segment.name in step.gradient_bytes else 0.0
        if all(u.options == (STORE,) for u in (*units, *(c for c, _, _ in segment.carried))):
            return floor  # nothing rebuilt
        T = _variable(prob, f"T_transient_{self.tag}_{s}", low=floor)
        # The larger of the gradient workspace and any recompute workspace.
        workspace = _variable(prob, f"W_{self.tag}_{s}", low=gradient / byte_unit)
        for i, u in enumerate(units):
            if u.recomputable and u.recompute_transient > 0:
                prob += workspace >= u.recompute_transient / byte_unit * self.var(u.key, RECOMPUTE), \
                    f"workspace_{self.tag}_{s}_{i}"
        early = self._rebuilt_early(s, segment)
        for cut in segment.peak_cuts:
            alive = [u.bytes / byte_unit * (1 - self.var(u.key, STORE))
                     for i, u in enumerate(units) if cut in segment.window(i)]
            alive += [units[i].bytes / byte_unit * z for (i, p), z in early.items() if p == cut]
            # Other segments' units backward rebuilt before reaching their own.
            alive += [u.bytes / byte_unit * (1 - self.var(u.key, STORE)) for u in segment.carried_at(cut)]
            prob += T >= pulp.lpSum(alive) + workspace + outputs / byte_unit, f"transient_{self.tag}_{s}_{cut}"
        return T

    def _rebuilt_early(self, s: int, segment: Segment) -> dict[tuple[int, int], pulp.LpVariable]:
        """z[i, p] for each unit i and cut p after its window at which a recomputed
        reader can have it rebuilt (``segments.rebuilt_from``), with its constraints."""
        prob, units, n = self.problem.prob, segment.units, len(segment.units)
        early: dict[tuple[int, int], pulp.LpVariable] = {}
        # Readers come after the units they read, so walking backwards defines them first.
        for i in reversed(range(n)):
            u = units[i]
            readers = [j for j in segment.readers[i] if units[j].recomputable]
            if not u.recomputable or not readers:
                continue
            for cut in (c for c in segment.peak_cuts if c > segment.needed_until[i]):
                rebuilt = [self.var(units[j].key, RECOMPUTE) if cut in segment.window(j) else early.get((j, cut))
                           for j in readers]
                rebuilt = [r for r in rebuilt if r is not None]
                if not rebuilt:
                    continue
                z = early[i, cut] = _variable(prob, f"z_{self.tag}_{s}_{i}_{cut}", low=0)
                for k, r in enumerate(rebuilt):
                    # r = 1 makes u stored or recomputed (exact inputs), so this is
                    # z >= x[u,R] + r - 1 on integers, and tighter when relaxed.
                    prob += z >= r - self.var(u.key, STORE), f"early_{self.tag}_{s}_{i}_{cut}_{k}"
        return early

    def kept(self, units: Sequence[UnitCost]) -> pulp.LpAffineExpression:
        """Kept bytes (stored + compressed) of ``units``, in byte units."""
        return pulp.lpSum(u.kept_bytes(o) / self.problem.byte_unit * self.var(u.key, o)
                          for u in units for o in u.options if u.kept_bytes(o))

    def memory(self) -> list[pulp.LpAffineExpression]:
        """The step's memory at each phase (``memory.peak_parts``), in byte units:
        kept bytes less those of the segments backward has finished, plus what
        the phase holds besides them. The plan's memory is the largest."""
        step, byte_unit = self.model.step, self.problem.byte_unit
        every = frozenset(s.name for s in self.model.segments)
        phases = [self.unfreed[every] + step.loss_phase_bytes / byte_unit,
                  self.unfreed[every - set(step.layer_segments)] + step.end_bytes / byte_unit]
        phases += [self.unfreed[every - set(step.passed.get(g, ()))] + T
                   + step.weight_gradient_bytes.get(g, 0) / byte_unit for g, T in self.T.items()]
        return phases

    def _per_unit(self, cost: Callable[[UnitCost, str], float]) -> pulp.LpAffineExpression:
        """sum over units and options of cost(u, o) x[u, o], tied units' costs
        added onto the variables that decide them."""
        coefficients: dict[pulp.LpVariable, float] = {}
        for u in self.model.units:
            for o in u.options:
                c = cost(u, o)
                if c:
                    var = self.var(u.key, o)
                    coefficients[var] = coefficients.get(var, 0.0) + c
        return pulp.LpAffineExpression(coefficients)

    def time(self) -> pulp.LpAffineExpression:
        """Recovery time: recompute seconds plus encode + decode seconds, in second units."""
        return self._per_unit(lambda u, o: u.time_s(o) / self.problem.second_unit)

    def error2(self) -> pulp.LpAffineExpression:
        """Sum of squared sensitivities of the compressed units (``risk.py``)."""
        return self._per_unit(lambda u, o: u.codecs[o.removeprefix(COMPRESS_PREFIX)].sensitivity**2
                              if o.startswith(COMPRESS_PREFIX) else 0.0)

    def decisions(self) -> dict[str, str]:
        """The chosen option per unit, rounding binaries at CHOSEN."""
        chosen = {}
        for u in self.model.units:
            picked = [o for o in u.options if (self.var(u.key, o).varValue or 0.0) > CHOSEN]
            if len(picked) != 1:
                raise RuntimeError(f"CBC returned {len(picked)} options for unit {u.key}")
            chosen[u.key] = picked[0]
        return chosen


def kept_chain(bucket: _Bucket) -> dict[frozenset[str], pulp.LpAffineExpression]:
    """Kept bytes of each set of segments a memory phase holds unfreed, in byte units.

    Backward frees the layers it has finished, so those sets are nested (the
    loss holds every segment, a layer's backward its own and those below).
    Summing every unit's options per phase made the rows' nonzeros grow with
    depth squared (3.6M at 128 layers); instead K[g] (kept bytes of segment
    g, one variable for segments decided alike) and U[s] = U[previous set] +
    the K of the segments it adds keep every row a few terms long.
    """
    model, prob, tag = bucket.model, bucket.problem.prob, bucket.tag
    step = model.step
    every = frozenset(s.name for s in model.segments)
    sets = {every, every - set(step.layer_segments), *(every - set(step.passed.get(g, ())) for g in bucket.T)}
    K: dict[str, pulp.LpVariable] = {}
    shared: dict[tuple[str, ...], pulp.LpVariable] = {}
    for s, segment in enumerate(model.segments):
        signature = tuple(bucket.alias[u.key] for u in segment.units)
        if signature not in shared:
            shared[signature] = _variable(prob, f"K_{tag}_{s}", low=0)
            prob += shared[signature] == bucket.kept(segment.units), f"kept_{tag}_{s}"
        K[segment.name] = shared[signature]
    unfreed: dict[frozenset[str], pulp.LpAffineExpression] = {}
    previous: frozenset[str] = frozenset()
    for k, held in enumerate(sorted(sets, key=len)):
        base = unfreed[previous] if previous and previous <= held else None
        added = held - previous if base is not None else held
        U = _variable(prob, f"U_{tag}_{k}", low=0)
        prob += U == (base if base is not None else 0) + pulp.lpSum(K[g] for g in sorted(added)), f"unfreed_{tag}_{k}"
        unfreed[held] = pulp.LpAffineExpression(U)
        previous = held
    return unfreed


class JointProblem:
    """One ILP over every bucket: per-bucket plans, one shared error budget."""

    def __init__(self, model: CostModel, name: str, weights: Sequence[BucketWeight],
                 tying: Tying | None = None) -> None:
        self.model, self.weights = model, tuple(weights)
        #: Which units share variables (``tying.py``); None: every unit decides alone.
        self.tying = tying or untied(model)
        self.prob = pulp.LpProblem(name, pulp.LpMinimize)
        #: Bytes and seconds per ILP unit (see SCALE).
        self.byte_unit = max(sum(u.bytes for u in model.units), 1) / SCALE
        self.second_unit = max(sum(max(map(u.time_s, u.options)) for u in model.units), 1e-12) / SCALE
        self.buckets = {w.name: _Bucket(self, i) for i, w in enumerate(self.weights)}

    def expected_time(self) -> pulp.LpAffineExpression:
        """Recovery time over a batch's exposure mix: each bucket's time x its sample share."""
        return pulp.lpSum(max(w.samples, MIN_TIME_WEIGHT) * self.buckets[w.name].time()
                          for w in self.weights)

    def every_bucket_fits(self, limit: pulp.LpAffineExpression | float) -> None:
        # Memory: each bucket's memory at every phase fits the ceiling
        # (buckets run one after another, never at once).
        for w in self.weights:
            for k, phase in enumerate(self.buckets[w.name].memory()):
                self.prob += phase <= limit, f"memory_budget_{w.name}_{k}"

    def error_within_budget(self, risk_budget: float) -> None:
        # The update's predicted squared relative gradient error, summed over
        # buckets (quadrature, risk.py), stays within the one shared budget:
        #   sum_b q_b sum_u s(u)^2 x[b,u,compress] <= risk_budget.
        # Divided by the budget: CBC's feasibility tolerance is absolute
        # (1e-7), a quarter percent of a 2e-5 budget, which it then overran.
        # An infinite budget is no constraint (``solving._budget_idle``).
        if math.isinf(risk_budget):
            return
        scale = risk_budget if risk_budget > 0 else 1.0
        self.prob += pulp.lpSum(w.error / scale * self.buckets[w.name].error2() for w in self.weights) \
            <= risk_budget / scale, "risk_budget"

    def decisions(self) -> dict[str, dict[str, str]]:
        """The solved plans: ``{bucket: {unit key: option}}``."""
        return {name: b.decisions() for name, b in self.buckets.items()}

    def set_start(self, start: Mapping[str, Mapping[str, str]]) -> None:
        """Give CBC ``start`` (``{bucket: {unit key: option}}``) as its MIP start."""
        for name, bucket in self.buckets.items():
            for (key, option), var in bucket.x.items():
                var.setInitialValue(1 if start[name][key] == option else 0)


def expected_time_s(model: CostModel, weights: Sequence[BucketWeight],
                    decisions: Mapping[str, Mapping[str, str]]) -> float:
    """The joint objective of ``decisions`` in seconds (what ``solve_min_time`` minimises)."""
    return sum(max(w.samples, MIN_TIME_WEIGHT) * sum(model.unit(k).time_s(o) for k, o in decisions[w.name].items())
               for w in weights)


def min_time_problem(model: CostModel, weights: Sequence[BucketWeight], *, budget_bytes: int,
                     risk_budget: float, tying: Tying | None = None) -> tuple[JointProblem, float]:
    """The fastest plans within the ceiling and error budget, and its objective's seconds per unit."""
    problem = JointProblem(model, "hilore_min_time", weights, tying)
    problem.prob += problem.expected_time()
    # Round-off slack: the terms, scaled, sum to the budget only within ~1e-10
    # of it, and a plan exactly at the budget (the least one) must still fit.
    problem.every_bucket_fits(budget_bytes / problem.byte_unit * (1 + BUDGET_SLACK))
    problem.error_within_budget(risk_budget)
    return problem, problem.second_unit


def min_memory_problem(model: CostModel, weights: Sequence[BucketWeight], *,
                       risk_budget: float, tying: Tying | None = None) -> tuple[JointProblem, float]:
    """The plans whose largest bucket memory is least, and its objective's bytes per unit."""
    problem = JointProblem(model, "hilore_min_memory", weights, tying)
    ceiling = _variable(problem.prob, "M_ceiling", low=0)
    problem.prob += ceiling
    problem.every_bucket_fits(ceiling)
    problem.error_within_budget(risk_budget)
    return problem, problem.byte_unit
