"""Planning is bounded: too many recovery units are refused at once, and one plan's ILPs share a deadline."""

from __future__ import annotations

import json

import pytest

from hilore_compiler import cli
from hilore_compiler.solver import SolverOptions, solve
from hilore_compiler.solver.limits import (MAX_UNITS, Deadline, PlanningLimits, PlanningTimeoutError,
                                           TooManyUnitsError)
from hilore_compiler.solver.synthetic import random_trace
from hilore_compiler.tracefile import TRACE_SCHEMA


def test_a_trace_with_more_units_than_the_limit_is_refused_naming_the_limit():
    with pytest.raises(TooManyUnitsError, match=r"has 12 recovery units, more than the 10 one plan is made for"):
        solve(random_trace(0, num_units=12), "1.0x-store", limits=PlanningLimits(max_units=10))


def test_hilore_plan_refuses_an_oversized_trace_before_reading_its_units(tmp_path, capsys):
    # The units are not even valid: the count alone refuses the file, before
    # 100,000 sizes would be parsed and checked (about 40 s on its own).
    path = tmp_path / "huge.trace.json"
    path.write_text(json.dumps({"schema": TRACE_SCHEMA, "units": [{}] * (MAX_UNITS + 1)}))
    assert cli.main(["plan", str(path), "-o", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert f"has {MAX_UNITS + 1} recovery units, more than the {MAX_UNITS}" in err
    assert not (tmp_path / "plan.json").exists()


def test_a_plan_past_its_total_time_limit_stops_with_a_clear_error():
    with pytest.raises(PlanningTimeoutError, match=r"ran past its 1e-09 s limit before the min-memory ILP"):
        solve(random_trace(0, num_units=6), "1.0x-store", buckets=1, limits=PlanningLimits(total_time_s=1e-9))


def test_cbc_runs_share_the_time_left():
    options = SolverOptions(time_limit_s=4.0)
    assert Deadline(10.0).share(options, 5).time_limit_s == pytest.approx(2.0, abs=0.05)
    assert Deadline(100.0).share(options, 5).time_limit_s == 4.0  # never more than asked
    assert Deadline(0.0).share(options, 5).time_limit_s == 1.0  # never less than MIN_CBC_S


@pytest.mark.parametrize("bad", [{"max_units": 0}, {"total_time_s": -1.0}])
def test_limits_are_checked(bad):
    with pytest.raises(ValueError):
        PlanningLimits(**bad)


def test_a_running_cbc_says_how_it_is_doing_once_per_interval(monkeypatch):
    from hilore_compiler.solver import cbc
    from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

    # A short interval, so that a solve of well under a second is "long".
    monkeypatch.setattr(cbc, "PROGRESS_INTERVAL_S", 0.01)
    said: list[str] = []
    solve(synthetic_trace(SyntheticConfig(num_layers=4)), budget="1.10x-gc", progress=said.append,
          options=SolverOptions(tie_blocks=False))
    lines = [s for s in said if s.startswith("solver: CBC has run")]
    assert lines, said
    assert all(" s of at most " in s for s in lines)
    # Quiet without a listener: the watcher thread is only started for one.
    quiet = cbc._LISTENER.get()
    assert quiet is None


def test_cbc_status_reads_the_latest_plan_and_bound_from_its_log():
    from hilore_compiler.solver.cbc import cbc_status

    assert cbc_status("", 3.2, 12).endswith("no plan yet")
    log = ("Cbc0012I Integer solution of 607.5 found by feasibility pump\n"
           "Cbc0010I After 100 nodes, 3 on tree, 600 best solution, best possible 594 (3.2 seconds)\n")
    assert cbc_status(log, 6.0, 12.0) == "CBC has run 6 s of at most 12 s; a plan found, within 1.0% of optimal"


@pytest.mark.slow
def test_the_backend_says_how_a_long_cbc_run_is_doing_when_verbose(monkeypatch, capsys):
    from hilore_compiler.backend import BackendOptions
    from hilore_compiler.backend.planning import solve_lengths
    from hilore_compiler.solver import cbc
    from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

    monkeypatch.setattr(cbc, "PROGRESS_INTERVAL_S", 0.01)
    trace = synthetic_trace(SyntheticConfig(num_layers=4))
    for verbose in (True, False):
        options = BackendOptions.from_mapping({"verbose": verbose, "buckets": 1})
        solve_lengths(trace, options, trace.batch, (trace.seq_len, trace.seq_len))
        said = capsys.readouterr().err
        assert ("hilore: solver: CBC has run" in said) is verbose, said
