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
                at p (``memory.rebuilt_from``). z and the segment's workspace
                W[b, g] are continuous: minimising time under a ceiling on T
                never gains from raising them.

Memory of bucket b at each phase (``memory.peak_parts``), all under the
ceiling: kept + the loss's peak; kept - kept of the layers + the end of
backward; and, per segment g, kept - kept of the layers backward finished
before g + T[b, g]. Kept bytes are linear in x, so this stays an ILP.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulp

from ..vocabulary import COMPRESS_PREFIX, RECOMPUTE, STORE, group_of
from .memory import CostModel, Segment

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
    """One bucket's variables and the rules every plan obeys, inside a shared problem."""

    def __init__(self, problem: JointProblem, tag: int) -> None:
        self.problem, self.model, self.tag = problem, problem.model, tag
        prob = problem.prob
        self.x = {
            (u.key, o): _variable(prob, f"x_{tag}_{i}_{j}", pulp.LpBinary)
            for i, u in enumerate(self.model.units) for j, o in enumerate(u.options)
        }
        #: Per segment: T[g], what its backward holds at once besides kept bytes.
        self.T: dict[str, pulp.LpVariable | float] = {}
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
            self.problem.prob += pulp.lpSum(self.x[u.key, o] for o in u.options) == 1, \
                f"one_option_{self.tag}_{i}"

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
                    self.problem.prob += self.x[u.key, RECOMPUTE] + not_exact <= 1, \
                        f"exact_inputs_{self.tag}_{i}_{j}"

    def _largest_transient(self) -> None:
        # T[g] covers what the backward of segment g holds at once besides kept
        # bytes (memory.py): at each cut p, the units rebuilt there, g's
        # recompute workspace or gradient workspace (the larger), and g's other
        # backward terms (a constant). Unit u is rebuilt at p when
        #   p in u's window:  it is not stored (1 - x[u,S]);
        #   p after it:       z[u,p] >= r[v,p] - x[u,S] for each reader v,
        # r[v,p] "v is recomputed and rebuilt at p" (x[v,R] in v's window,
        # z[v,p] after it): recomputing v reads u, so u is rebuilt with it.
        byte_unit, prob = self.problem.byte_unit, self.problem.prob
        step = self.model.step
        for s, segment in enumerate(self.model.segments):
            units = segment.units
            floor = step.backward_bytes.get(segment.name, 0) / byte_unit
            if all(u.options == (STORE,) for u in (*units, *(c for c, _, _ in segment.carried))):
                self.T[segment.name] = floor  # nothing rebuilt
                continue
            T = self.T[segment.name] = _variable(prob, f"T_transient_{self.tag}_{s}", low=floor)
            gradient = step.gradient_bytes.get(segment.name, 0)
            # The larger of the gradient workspace and any recompute workspace.
            workspace = _variable(prob, f"W_{self.tag}_{s}", low=gradient / byte_unit)
            for i, u in enumerate(units):
                if u.recomputable and u.recompute_transient > 0:
                    prob += workspace >= u.recompute_transient / byte_unit * self.x[u.key, RECOMPUTE], \
                        f"workspace_{self.tag}_{s}_{i}"
            early = self._rebuilt_early(s, segment)
            # The outputs and their gradient, and the weights' gradients.
            rest = (2 * step.output_bytes + step.weight_gradient_bytes.get(segment.name, 0)) / byte_unit
            for cut in segment.peak_cuts:
                alive = [u.bytes / byte_unit * (1 - self.x[u.key, STORE])
                         for i, u in enumerate(units) if cut in segment.window(i)]
                alive += [units[i].bytes / byte_unit * z for (i, p), z in early.items() if p == cut]
                # Other segments' units backward rebuilt before reaching their own.
                alive += [u.bytes / byte_unit * (1 - self.x[u.key, STORE]) for u in segment.carried_at(cut)]
                prob += T >= pulp.lpSum(alive) + workspace + rest, f"transient_{self.tag}_{s}_{cut}"

    def _rebuilt_early(self, s: int, segment: Segment) -> dict[tuple[int, int], pulp.LpVariable]:
        """z[i, p] for each unit i and cut p after its window at which a recomputed
        reader can have it rebuilt (``memory.rebuilt_from``), with its constraints."""
        prob, units, n = self.problem.prob, segment.units, len(segment.units)
        early: dict[tuple[int, int], pulp.LpVariable] = {}
        # Readers come after the units they read, so walking backwards defines them first.
        for i in reversed(range(n)):
            u = units[i]
            readers = [j for j in segment.readers[i] if units[j].recomputable]
            if not u.recomputable or not readers:
                continue
            for cut in (c for c in segment.peak_cuts if c > segment.needed_until[i]):
                rebuilt = [self.x[units[j].key, RECOMPUTE] if cut in segment.window(j) else early.get((j, cut))
                           for j in readers]
                rebuilt = [r for r in rebuilt if r is not None]
                if not rebuilt:
                    continue
                z = early[i, cut] = _variable(prob, f"z_{self.tag}_{s}_{i}_{cut}", low=0)
                for k, r in enumerate(rebuilt):
                    # r = 1 makes u stored or recomputed (exact inputs), so this is
                    # z >= x[u,R] + r - 1 on integers, and tighter when relaxed.
                    prob += z >= r - self.x[u.key, STORE], f"early_{self.tag}_{s}_{i}_{cut}_{k}"
        return early

    def kept(self, segments: Sequence[str] | None = None) -> pulp.LpAffineExpression:
        """Kept bytes (stored + compressed) of ``segments`` (None: all), in byte units."""
        return pulp.lpSum(u.kept_bytes(o) / self.problem.byte_unit * self.x[u.key, o]
                          for u in self.model.units
                          if segments is None or group_of(u.layer) in segments for o in u.options)

    def memory(self) -> list[pulp.LpAffineExpression]:
        """The step's memory at each phase (``memory.peak_parts``), in byte units:
        kept bytes less those of the segments backward has finished, plus what
        the phase holds besides them. The plan's memory is the largest."""
        step, byte_unit = self.model.step, self.problem.byte_unit
        kept = self.kept()
        phases = [kept + step.loss_phase_bytes / byte_unit,
                  kept - self.kept(step.layer_segments) + step.end_bytes / byte_unit]
        phases += [kept - self.kept(step.passed.get(g, ())) + T for g, T in self.T.items()]
        return phases

    def time(self) -> pulp.LpAffineExpression:
        """Recovery time: recompute seconds plus encode + decode seconds, in second units."""
        return pulp.lpSum(u.time_s(o) / self.problem.second_unit * self.x[u.key, o]
                          for u in self.model.units for o in u.options)

    def error2(self) -> pulp.LpAffineExpression:
        """Sum of squared sensitivities of the compressed units (``risk.py``)."""
        return pulp.lpSum(c.sensitivity**2 * self.x[u.key, COMPRESS_PREFIX + name]
                          for u in self.model.units for name, c in u.codecs.items())

    def decisions(self) -> dict[str, str]:
        """The chosen option per unit, rounding binaries at CHOSEN."""
        chosen = {}
        for u in self.model.units:
            picked = [o for o in u.options if (self.x[u.key, o].varValue or 0.0) > CHOSEN]
            if len(picked) != 1:
                raise RuntimeError(f"CBC returned {len(picked)} options for unit {u.key}")
            chosen[u.key] = picked[0]
        return chosen


class JointProblem:
    """One ILP over every bucket: per-bucket plans, one shared error budget."""

    def __init__(self, model: CostModel, name: str, weights: Sequence[BucketWeight]) -> None:
        self.model, self.weights = model, tuple(weights)
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
                     risk_budget: float) -> tuple[JointProblem, float]:
    """The fastest plans within the ceiling and error budget, and its objective's seconds per unit."""
    problem = JointProblem(model, "hilore_min_time", weights)
    problem.prob += problem.expected_time()
    # Round-off slack: the terms, scaled, sum to the budget only within ~1e-10
    # of it, and a plan exactly at the budget (the least one) must still fit.
    problem.every_bucket_fits(budget_bytes / problem.byte_unit * (1 + BUDGET_SLACK))
    problem.error_within_budget(risk_budget)
    return problem, problem.second_unit


def min_memory_problem(model: CostModel, weights: Sequence[BucketWeight], *,
                       risk_budget: float) -> tuple[JointProblem, float]:
    """The plans whose largest bucket memory is least, and its objective's bytes per unit."""
    problem = JointProblem(model, "hilore_min_memory", weights)
    ceiling = _variable(problem.prob, "M_ceiling", low=0)
    problem.prob += ceiling
    problem.every_bucket_fits(ceiling)
    problem.error_within_budget(risk_budget)
    return problem, problem.byte_unit
