"""Traces and plans are data: each bad file gives one line naming the field, exit code 2.

One test per reproduction of issue 11: code in a size, a size that hangs,
non-finite and negative numbers, duplicate keys, a layer that is not an index,
plans without buckets, bad output paths and mistyped backend options.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hilore_compiler import cli
from hilore_compiler.backend.options import BackendOptions
from hilore_compiler.jsonio import FormatError, OutputPathError, check_output_path, save_or_fallback
from hilore_compiler.planfile import Plan
from hilore_compiler.planload import load_plan
from hilore_compiler.solver import solve
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace
from hilore_compiler.tracefile import load_trace

SMALL = SyntheticConfig(num_layers=1, hidden=64, intermediate=172, heads=4, kv_heads=2, vocab=128,
                        batch=2, seq_len=16)


@pytest.fixture(scope="module")
def trace_json(tmp_path_factory) -> dict:
    path = synthetic_trace(SMALL).save(tmp_path_factory.mktemp("v") / "trace.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def plan() -> Plan:
    return solve(synthetic_trace(SMALL), "0.9x-store", buckets=1)


def _write(tmp_path, payload: dict, name: str = "in.json"):
    path = tmp_path / name
    path.write_text(json.dumps(payload))
    return path


def _unit(field: str, value):
    def edit(t):
        t["units"][1][field] = value
    return edit


def _codec(field: str, value):
    def edit(t):
        t["units"][1]["codecs"]["int8"][field] = value
    return edit


def _duplicate_key(t):
    t["units"][2]["key"] = t["units"][1]["key"]


@pytest.mark.parametrize("edit, message", [
    (_unit("bytes", "256*S+0*__import__('os').system('touch pwned')"), r"\.bytes: size .* is not a size function"),
    (_unit("bytes", "S**(S**(S**S))"), r"\.bytes: size 'S\*\*\(S\*\*\(S\*\*S\)\)' rejected"),
    (_unit("bytes", "nan"), r"\.bytes: size 'nan' rejected: unknown name 'nan'"),
    (_unit("bytes", "oo"), "unknown name 'oo'"),
    (_unit("bytes", "zoo"), "unknown name 'zoo'"),
    (_unit("bytes", "256*S*I"), "unknown name 'I'"),
    (_unit("recompute_transient", "S//0"), r"\.recompute_transient: .*division by zero"),
    (_unit("recompute_time_s", math.nan), r"\.recompute_time_s: expected a number >= 0, found nan"),
    (_unit("recompute_time_s", -1.0), r"\.recompute_time_s: expected a number >= 0, found -1.0"),
    (_codec("rel_l2", math.nan), r"\.codecs\.int8\.rel_l2: expected a number >= 0, found nan"),
    (_codec("time_s", math.inf), r"\.codecs\.int8\.time_s: expected a number >= 0, found inf"),
    (_codec("bytes", "-5*S"), r"\.codecs\.int8\.bytes: size -5\*S is -\d+ bytes"),
    (_unit("sensitivity", {"int8": math.nan}), r"\.sensitivity\.int8: expected a number >= 0, found nan"),
    (_unit("sensitivity", {"int8": 1e308}), r"\.sensitivity\.int8: 1e\+308 is past 1000"),
    (_codec("time_s", 1e7), r"\.codecs\.int8\.time_s: 10000000.0 is past 1e\+06"),
    (_unit("bytes", "-4*B*S"), r"\.bytes: size -4\*B\*S is -\d+ bytes"),
    (_unit("layer", "zero"), r"\.layer: expected a layer index >= 0 or null .*found 'zero'"),
    (_unit("layer", -1), r"\.layer: expected a layer index >= 0"),
    (_unit("bytes_at_trace", 7), r"bytes_at_trace: 7 but bytes .* at the traced shape"),
    (_unit("recomputable", "yes"), r"\.recomputable: expected bool, found str"),
    (_duplicate_key, r"\.units: key '.*' appears more than once"),
    (lambda t: t.update(batch=0), r"\.batch: expected an integer > 0, found 0"),
    (lambda t: t.update(notes="a note"), r"\.notes: expected list, found str"),
    (lambda t: t.update(gc_bytes="S - 10**9"), r"\.gc_bytes: size .* rejected"),
    (lambda t: t.update(units=[]), r"\.units: empty"),
    (lambda t: t["units"].__setitem__(0, 5), r"\.units\[0\]: expected an object, found int"),
])
def test_bad_trace_is_one_line_naming_file_unit_and_field(trace_json, tmp_path, monkeypatch, capsys,
                                                         edit, message):
    monkeypatch.chdir(tmp_path)
    payload = json.loads(json.dumps(trace_json))
    edit(payload)
    path = _write(tmp_path, payload)
    with pytest.raises(FormatError, match=message) as info:
        load_trace(path)
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)
    for argv in (["plan", str(path), "-o", "out.json"], ["show", str(path)]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and str(path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]  # no plan, no 'pwned'


def test_problems_are_all_listed_and_counted(trace_json, tmp_path):
    payload = json.loads(json.dumps(trace_json))
    for u in payload["units"][:3]:
        u["recompute_time_s"] = -1.0
    with pytest.raises(FormatError, match=r"\(and 2 more problem\(s\)\)$") as info:
        load_trace(_write(tmp_path, payload))
    assert len(info.value.problems) == 3


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(buckets=[]), r"\.buckets: no bucket with decisions"),
    (lambda p: p.update(buckets=p["buckets"][:1]), r"\.buckets: no bucket with decisions"),
    (lambda p: p["buckets"][1]["predicted"].update(risk=math.nan), r"predicted\.risk: expected a number >= 0"),
    (lambda p: p["buckets"][1].update(lo=-1.0), r"\]\.lo: expected a number >= 0, found -1.0"),
    (lambda p: p["units"][0].update(bytes=-8192), r"units\[0\]\[.*\]\.bytes: expected an integer >= 0"),
    (lambda p: p["units"][0].update(layer=True), r"\.layer: expected a layer index >= 0 or null"),
    (lambda p: p.update(risk_budget=math.inf), r"risk_budget: expected a number >= 0, found inf"),
    (lambda p: p.update(codecs=[1]), r"codecs\[0\]: expected a string"),
])
def test_bad_plan_is_one_line(plan, tmp_path, capsys, edit, message):
    payload = json.loads(json.dumps(plan.to_json()))
    edit(payload)
    path = _write(tmp_path, payload, "plan.json")
    with pytest.raises(FormatError, match=message):
        load_plan(path)
    assert cli.main(["show", str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_invalid_records_are_never_written(plan, tmp_path):
    nan_risk = dataclasses.replace(plan.buckets[1], risk=math.nan)
    with pytest.raises(FormatError, match=r"predicted\.risk"):
        dataclasses.replace(plan, buckets=(plan.buckets[0], nan_risk)).save(tmp_path / "p.json")
    trace = synthetic_trace(SMALL)
    bad_unit = dataclasses.replace(trace.units[0], layer="zero")
    with pytest.raises(FormatError, match=r"\.layer"):
        dataclasses.replace(trace, units=(bad_unit, *trace.units[1:])).save(tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- output paths
def test_output_path_is_checked_before_the_work(plan, tmp_path, capsys):
    trace_path = synthetic_trace(SMALL).save(tmp_path / "trace.json")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    before = trace_path.read_text()
    for output, message in [
        (tmp_path / "adir", "is a folder; give a file name"),
        (tmp_path / "afile" / "plan.json", "afile is a file, not a folder"),
        (trace_path, "is also the input"),
    ]:
        assert cli.main(["plan", str(trace_path), "--buckets", "1", "-o", str(output)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "planning" not in err  # refused before solving
    assert trace_path.read_text() == before
    with pytest.raises(OutputPathError, match="not writable"):
        check_output_path("/proc/hilore-plan.json")


def test_a_late_write_failure_keeps_the_work(plan, tmp_path, monkeypatch):
    calls = []

    def save(path):
        calls.append(path)
        if len(calls) == 1:
            raise PermissionError(13, "Permission denied")
        return plan.save(path)

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(OutputPathError, match="the plan was saved to .* instead") as info:
        save_or_fallback(save, tmp_path / "ro" / "plan.json", "plan")
    fallback = calls[1]
    assert str(fallback) in str(info.value) and load_plan(fallback) == plan


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("options, message", [
    ({"codecs": "int8"}, "'codecs' must be a list of codec names"),
    ({"buckets": 2.5}, "'buckets' must be a positive int"),
    ({"buckets": 0}, "'buckets' must be a positive int"),
    ({"plan": 123}, "'plan' must be a Plan, a path"),
    ({"memory_budget": 1.1}, "'memory_budget' must be a string"),
    ({"risk_budget": math.nan}, "'risk_budget' must be a number >= 0, None"),
    ({"strict": "yes"}, "'strict' must be True or False"),
    ({"verbose": 1}, "'verbose' must be True or False"),
    ({"cache_dir": 5}, "'cache_dir' must be a folder path"),
])
def test_backend_options_are_typed_at_the_door(options, message):
    with pytest.raises(ValueError, match=message):
        BackendOptions.from_mapping(options)


def test_backend_options_accept_documented_forms(plan, tmp_path):
    opts = BackendOptions.from_mapping({"codecs": ["int8"], "buckets": 2, "plan": plan, "risk_budget": "cos>=0.999",
                                        "cache_dir": tmp_path, "strict": True, "memory_budget": "6GiB"})
    assert (opts.codecs, opts.buckets, opts.cache_dir) == (("int8",), 2, str(tmp_path))
    assert BackendOptions.from_mapping({"risk_budget": 0.01, "plan": tmp_path / "p.json"}).risk_budget == 0.01
    skip_only = dataclasses.replace(plan, buckets=plan.buckets[:1])
    with pytest.raises(FormatError, match=r"options\['plan'\]\.buckets: no bucket with decisions"):
        BackendOptions.from_mapping({"plan": skip_only})
