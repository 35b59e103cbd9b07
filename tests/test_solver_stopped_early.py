"""When CBC stops early or finds nothing in time: the plans already known stand, and the
bucketed plans never do worse than one plan in every bucket (the exposure-blind plan)."""

from __future__ import annotations

import pytest

from hilore_compiler.planfile import RECOMPUTE, STORE
from hilore_compiler.solver import cost_model, simulate
from hilore_compiler.solver.cbc import SolverOptions
from hilore_compiler.solver.ilp import BucketWeight, expected_time_s
from hilore_compiler.solver.synthetic import random_trace
from hilore_compiler.tracefile import Trace

RISK = 1e-3  # binds on the random graphs: their squared sensitivities are 2.5e-5..1e-2
QUICK = SolverOptions(time_limit_s=1.0)


def _model(trace: Trace):
    return cost_model(trace, batch=trace.batch, seq_len=trace.seq_len,
                      codecs=sorted({c for u in trace.units for c in u.codecs}))


def test_known_plans_are_the_answer_when_cbc_finds_none_in_time(monkeypatch):
    from hilore_compiler.solver import solving
    from hilore_compiler.solver.cbc import NoPlanInTime

    trace = random_trace(3, num_units=6)
    model = _model(trace)
    weights = [BucketWeight(name="b", samples=1.0, error=1.0)]
    start = {"b": {u.key: STORE for u in model.units}}

    def no_plan(*args, **kwargs):
        raise NoPlanInTime("CBC found no plan within 0 s")

    monkeypatch.setattr(solving, "run_cbc", no_plan)
    result = solving.solve_min_time(model, budget_bytes=model.store_bytes, weights=weights,
                                    risk_budget=RISK, options=QUICK, start=start)
    assert result.decisions == start and result.status == "feasible" and result.bound is None
    assert result.objective == 0.0  # store-all recovers nothing
    with pytest.raises(NoPlanInTime):  # nothing known: the error stands
        solving.solve_min_time(model, budget_bytes=model.store_bytes, weights=weights,
                               risk_budget=RISK, options=QUICK)


def test_buckets_stopped_early_never_lose_to_the_exposure_blind_plan(monkeypatch):
    """CBC may stop on the joint problem with plans slower over the mix than
    one plan in every bucket, which satisfies the same constraints."""
    from hilore_compiler.solver import solving
    from hilore_compiler.solver.solving import IlpResult

    trace = random_trace(3, num_units=6)
    model = _model(trace)
    weights = [BucketWeight(name="b0", samples=0.6, error=0.2), BucketWeight(name="b1", samples=0.4, error=0.8)]
    recompute_all = {w.name: {u.key: RECOMPUTE for u in model.units} for w in weights}
    real_run = solving._run

    def stopped_early(problem, options, scale, start=None):
        if len(problem.weights) == 1:
            return real_run(problem, options, scale, start)
        return IlpResult(decisions=recompute_all, status="feasible", seconds=1.0,
                         objective=expected_time_s(model, weights, recompute_all), bound=0.0)

    monkeypatch.setattr(solving, "_solve_apart", lambda *a, **k: None)  # the joint problem, as where risk binds
    monkeypatch.setattr(solving, "_run", stopped_early)
    result = solving.solve_min_time(model, budget_bytes=model.store_bytes, weights=weights,
                                    risk_budget=RISK, options=QUICK)
    assert result.decisions["b0"] == result.decisions["b1"] != recompute_all["b0"]
    assert result.objective < expected_time_s(model, weights, recompute_all)
    assert result.objective == pytest.approx(expected_time_s(model, weights, result.decisions))
    assert result.blind == result.decisions  # kept, so buckets_that_pay need not solve it again


def test_buckets_that_pay_reuse_the_blind_plan_already_solved(monkeypatch):
    from hilore_compiler.solver import planner

    trace = random_trace(3, num_units=6)
    model = _model(trace)
    weights = [BucketWeight(name="b0", samples=0.6, error=0.2), BucketWeight(name="b1", samples=0.4, error=0.8)]
    store = {u.key: "store" for u in model.units}
    recompute = {u.key: RECOMPUTE if u.recomputable else "store" for u in model.units}
    plans = {"b0": store, "b1": recompute}  # distinct, and slower over the mix than store-all everywhere
    blind = {"b0": store, "b1": store}
    monkeypatch.setattr(planner, "blind_min_time", lambda *a, **k: pytest.fail("the blind plan was solved again"))
    kept, note = planner.buckets_that_pay(model, weights, plans, budget_bytes=model.store_bytes, risk_budget=RISK,
                                          options=QUICK, blind=blind)
    assert kept == blind and "one plan in every exposure bucket" in note


def test_least_memory_stopped_early_never_needs_more_than_the_exposure_blind_plan(monkeypatch):
    """The same for the smallest feasible budget: stopped early with store-all
    in every bucket, the least-memory plans are the blind plan's, so a ceiling
    the blind plan meets is never refused to the bucketed one."""
    from hilore_compiler.solver import solving
    from hilore_compiler.solver.solving import IlpResult

    trace = random_trace(3, num_units=6)
    model = _model(trace)
    weights = [BucketWeight(name="b0", samples=0.6, error=0.2), BucketWeight(name="b1", samples=0.4, error=0.8)]
    store_all = {w.name: {u.key: STORE for u in model.units} for w in weights}
    store_bytes = simulate(model, store_all["b0"]).memory_bytes
    real_run = solving._run

    def stopped_early(problem, options, scale, start=None):
        if len(problem.weights) == 1:
            return real_run(problem, options, scale, start)
        return IlpResult(decisions=store_all, status="feasible", seconds=1.0, objective=store_bytes, bound=0.0)

    monkeypatch.setattr(solving, "_solve_apart", lambda *a, **k: None)
    monkeypatch.setattr(solving, "_run", stopped_early)
    result = solving.solve_min_memory(model, weights=weights, risk_budget=RISK, options=QUICK)
    assert result.decisions["b0"] == result.decisions["b1"] != store_all["b0"]
    assert result.objective < store_bytes and result.status == "feasible"
    assert result.objective == simulate(model, result.decisions["b0"]).memory_bytes
