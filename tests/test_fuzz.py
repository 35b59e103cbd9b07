"""Fuzz: mutated traces and plans either work or fail with one line, never otherwise.

Seeded (``derandomize=True``) hypothesis mutations of a real trace (the layer-0
slice of ``traces/small-cpu-T2048.json``) and of a plan solved from it: numbers
become NaN, infinite, negative, huge or of another type; strings become code,
size bombs, empty or huge; keys are deleted, renamed or duplicated; objects and
lists are replaced or emptied. Each case then goes through ``load_trace`` +
``solve`` + ``Plan.save`` or ``load_plan`` + ``hilore show``. Allowed outcomes:
success (and what was written loads back equal), or the project's own error
(FormatError, or InfeasibleBudgetError for a valid trace that cannot fit) with
a one-line message and no file written. Anything else, or a case running past
CASE_SECONDS, fails the test.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hilore_compiler import cli
from hilore_compiler.commands.show import render_plan
from hilore_compiler.jsonio import FormatError
from hilore_compiler.planload import load_plan
from hilore_compiler.solver import InfeasibleBudgetError, SolverOptions, solve
from hilore_compiler.tracefile import load_trace, trace_from_json

ROOT = Path(__file__).resolve().parents[1]
#: Wall-clock bound of one case; a parse that hangs (the old S**(S**(S**S)))
#: or a solve that does not stop is a failure, not a slow test.
CASE_SECONDS = 20
#: Per-ILP CBC limit inside a case.
SOLVER = SolverOptions(time_limit_s=2.0)
#: A few hundred cases in all, well under a minute on a laptop core.
TRACE_CASES, PLAN_CASES = 150, 150
FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

NUMBERS = [math.nan, math.inf, -math.inf, -1, -1e-9, 0, 1e308, 10**30, 2**63, True, "12", None]
STRINGS = [
    "", "S**(S**(S**S))", "256*S+0*__import__('os').system('touch pwned')", "nan", "oo", "zoo",
    "256*S*I", "S//0", "mod(S, S - S)", "S // (S - 2048)", "-S", "x" * 5000, "9" * 5000, "1+" * 700 + "1",
    "line\nbreak", "zero", "compress:", "store", "recompute", "skip", 7, None, [], {},
]
STRUCTURES = ["delete", "empty", "list", "object", "duplicate", "copy-sibling", "rename"]


class CaseTimeout(BaseException):
    """A case ran past CASE_SECONDS (BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def bounded(seconds: int):
    def expire(signum, frame):
        raise CaseTimeout(f"case ran past {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _nodes(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every value in a JSON tree, the root excluded."""
    found = []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        found.append((*path, key))
        found += _nodes(child, (*path, key))
    return found


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def mutate(data: st.DataObject, payload: dict) -> dict:
    """Apply one to three drawn mutations to a deep copy of ``payload``."""
    payload = copy.deepcopy(payload)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        paths = _nodes(payload)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths), label="path")
        parent, key = _at(payload, path[:-1]), path[-1]
        value = parent[key]
        pool = NUMBERS if isinstance(value, (int, float)) else STRINGS if isinstance(value, str) else []
        # Mostly a value of the same JSON type (NaN, negative, code...), the rest structural.
        kind = data.draw(st.sampled_from(["value"] * 5 * bool(pool) + ["any"] + STRUCTURES), label="kind")
        if kind in ("value", "any"):
            parent[key] = data.draw(st.sampled_from(pool if kind == "value" else NUMBERS + STRINGS), label="new")
        elif kind == "delete":
            del parent[key]
        elif kind == "empty":
            parent[key] = type(value)() if isinstance(value, (dict, list)) else []
        elif kind in ("list", "object"):
            parent[key] = [value] if kind == "list" else {"value": value}
        elif kind == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(value))  # e.g. a unit twice: duplicate keys
        elif kind == "copy-sibling" and isinstance(parent, (list, dict)) and len(parent) > 1:
            siblings = [k for k in (range(len(parent)) if isinstance(parent, list) else parent) if k != key]
            parent[key] = copy.deepcopy(parent[data.draw(st.sampled_from(siblings), label="sibling")])
        elif kind == "rename" and isinstance(parent, dict):
            parent[data.draw(st.sampled_from(["gzip", "compress:gzip", "", "key", "b9"]), label="name")] = \
                parent.pop(key)
    return payload


@pytest.fixture(scope="module")
def real_trace() -> dict:
    """The real small CPU trace, cut to the units outside the layers and layer 0 (fast ILPs)."""
    payload = json.loads((ROOT / "traces" / "small-cpu-T2048.json").read_text())
    units = [u for u in payload["units"] if u["layer"] in (None, 0)]
    keys = {u["key"] for u in units}
    for u in units:
        u["recompute_from"] = [k for k in u["recompute_from"] if k in keys]
    payload["units"] = units
    trace_from_json(copy.deepcopy(payload))  # the unmutated slice is valid
    return payload


@pytest.fixture(scope="module")
def real_plan(real_trace) -> dict:
    return solve(trace_from_json(copy.deepcopy(real_trace)), "1.0x-store", buckets=2, options=SOLVER).to_json()


def _one_line(error: BaseException) -> None:
    message = str(error)
    assert message and "\n" not in message, repr(message)


def _loaded(load, source: Path, capsys, *show_options: str):
    """``load(source)`` and ``hilore show`` of it; None after checking both fail in one line."""
    try:
        loaded = load(source)
    except FormatError as e:
        _one_line(e)
        assert cli.main(["show", str(source)]) == 2
        assert capsys.readouterr().err.count("\n") == 1
        return None
    assert cli.main(["show", str(source), *show_options]) == 0
    capsys.readouterr()
    return loaded


def _trace_case(payload: dict, folder: Path, capsys) -> None:
    source, output = folder / "trace.json", folder / "plan.json"
    source.write_text(json.dumps(payload))
    # A trace's show draws a Pareto curve: two points keep it quick. The time
    # limit is only a cap (CBC proves these small ILPs in milliseconds); at
    # 0.5 s a machine loaded 4x over its cores saw CBC stop with no plan.
    trace = _loaded(load_trace, source, capsys, "--points", "2", "--time-limit", str(SOLVER.time_limit_s))
    if trace is None:
        return
    try:
        plan = solve(trace, "1.0x-store", buckets=1, options=SOLVER)
        plan.save(output)
    except (FormatError, InfeasibleBudgetError) as e:
        _one_line(e)
        assert not output.exists()
        return
    assert load_plan(output) == plan
    render_plan(plan)


def _plan_case(payload: dict, folder: Path, capsys) -> None:
    source, again = folder / "plan.json", folder / "again.json"
    source.write_text(json.dumps(payload))
    plan = _loaded(load_plan, source, capsys)
    if plan is None:
        return
    plan.bucket_for(1.0)  # the backend's default-bucket choice: needs a bucket with decisions
    assert load_plan(plan.save(again)) == plan


@settings(FUZZ, max_examples=TRACE_CASES)
@given(data=st.data())
def test_mutated_traces_plan_or_fail_in_one_line(real_trace, data, capsys):
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):  # where 'touch pwned' would land
        payload = mutate(data, real_trace)
        with bounded(CASE_SECONDS):
            _trace_case(payload, Path(folder), capsys)
        assert not (Path(folder) / "pwned").exists()


@settings(FUZZ, max_examples=PLAN_CASES)
@given(data=st.data())
def test_mutated_plans_load_and_show_or_fail_in_one_line(real_plan, data, capsys):
    with tempfile.TemporaryDirectory() as folder:
        payload = mutate(data, real_plan)
        with bounded(CASE_SECONDS):
            _plan_case(payload, Path(folder), capsys)


def test_the_fuzz_can_fail():
    """The harness is not a tautology: a hang and a stray exception both surface."""
    with pytest.raises(CaseTimeout), bounded(1):
        while True:
            pass
    with pytest.raises(FormatError):
        trace_from_json({"schema": "hilore.trace/v1", "units": "not a list"})
