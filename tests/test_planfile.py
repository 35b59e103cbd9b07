"""Plans as immutable records and as ``hilore.plan/v1`` JSON files."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from hilore_compiler.jsonio import FormatError
from hilore_compiler.planfile import PEAK_PARTS, PLAN_SCHEMA, Plan
from hilore_compiler.planload import load_plan, plan_from_json
from hilore_compiler.solver import solve
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

SMALL = SyntheticConfig(num_layers=1, hidden=64, intermediate=172, heads=4, kv_heads=2, vocab=128,
                        batch=2, seq_len=16)


@pytest.fixture(scope="module")
def plan() -> Plan:
    return solve(synthetic_trace(SMALL), "0.85x-store", buckets=2)


def test_json_round_trip_is_equal(plan):
    again = plan_from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_save_and_load(plan, tmp_path):
    path = plan.save(tmp_path / "sub" / "plan.json")
    assert load_plan(path) == plan
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temp file left behind
    payload = json.loads(path.read_text())
    assert payload["schema"] == PLAN_SCHEMA
    assert payload["buckets"][-1]["hi"] is None  # the unbounded top bucket
    assert payload["buckets"][0]["plan"] == "skip" and payload["buckets"][0]["decisions"] == {}


def test_record_contents(plan):
    trace = synthetic_trace(SMALL)
    assert plan.fingerprint == trace.fingerprint and plan.model == trace.model
    assert (plan.batch, plan.seq_len) == (SMALL.batch, SMALL.seq_len)
    assert plan.budget == "0.85x-store" and plan.budget_bytes == math.floor(0.85 * plan.store_bytes)
    assert plan.bucket_names == ("zero", "b0", "b1")
    decisions = plan.decisions("b1")
    assert set(decisions) == {u.key for u in trace.units}
    assert set(decisions.values()) <= {"store", "recompute", "compress:bf16", "compress:int8", "compress:fp8"}
    b1 = plan.bucket("b1")
    assert b1.memory_bytes == b1.kept_bytes + b1.transient_bytes <= plan.budget_bytes
    # Where the peak falls, and its parts, which make up the transient bytes.
    assert b1.peak_at in ("loss", "end of backward") or b1.peak_at.startswith("backward of ")
    parts = dict(b1.peak_parts)
    assert parts.keys() == set(PEAK_PARTS) and parts["freed"] >= 0
    assert sum(parts.values()) - 2 * parts.pop("freed") == b1.transient_bytes
    assert b1.solver.status in ("optimal", "feasible") and b1.solver.seconds > 0
    with pytest.raises(KeyError, match="no bucket 'b9'"):
        plan.decisions("b9")


def test_bucket_for_exposure(plan):
    b0 = plan.bucket("b0").bucket
    assert plan.bucket_for(0.0) == "zero"
    assert plan.bucket_for(b0.hi / 2) == "b0"
    assert plan.bucket_for(b0.hi) == "b0"  # ranges are (lo, hi]: a bucket holds its top
    assert plan.bucket_for(b0.hi * 1.001) == "b1"
    assert plan.bucket_for(1e9) == "b1"
    with pytest.raises(ValueError):
        plan.bucket_for(-1.0)


def test_plan_is_immutable(plan):
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget_bytes = 1  # type: ignore[misc]
    plan.decisions("b0")["x"] = "store"  # a copy: the plan is unchanged
    assert "x" not in plan.decisions("b0")


def test_malformed_json_names_the_problem(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"schema": "hilore.plan/v1", "model": ')
    with pytest.raises(FormatError, match=r"plan.json: not valid JSON \(line 1"):
        load_plan(path)
    with pytest.raises(FormatError, match="cannot read"):
        load_plan(tmp_path / "missing.json")
    trace_path = synthetic_trace(SMALL).save(tmp_path / "trace.json")
    with pytest.raises(FormatError, match="it is a trace, not a plan"):
        load_plan(trace_path)


def _broken(plan: Plan, tmp_path, edit) -> str:
    payload = plan.to_json()
    edit(payload)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(payload))
    return path


def test_plans_from_before_freed_was_recorded_load(plan, tmp_path):
    """``peak_parts.freed`` is newer than the format: a plan without it reads as nothing freed."""
    def drop_freed(p):
        for b in p["buckets"]:
            parts = b["predicted"].get("peak_parts", {})
            assert parts.pop("freed", 0) == 0  # the fixture's peaks fall where nothing is freed yet
    old = load_plan(_broken(plan, tmp_path, drop_freed))
    assert all(b.peak_parts["freed"] == 0 for b in old.buckets if b.peak_at is not None)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.pop("fingerprint"), "missing field 'fingerprint'"),
    (lambda p: p["shape"].update(batch="2"), r"shape.batch: expected int, found str"),
    (lambda p: p["buckets"][1]["decisions"].update({"model.norm:mul:0": "squash"}),
     r"buckets\[1\]\[b0\].decisions\[model.norm:mul:0\]: 'squash' is not one of"),
    (lambda p: p["buckets"][2]["decisions"].pop("model.norm:mul:0"), r"undecided units \['model.norm:mul:0'\]"),
    (lambda p: p["buckets"][1]["decisions"].update({"ghost:mm:0": "store"}), r"unknown units \['ghost:mm:0'\]"),
    (lambda p: p["buckets"][0]["decisions"].update({"model.norm:mul:0": "store"}), "skip bucket has no decisions"),
    (lambda p: p["buckets"][2].update(name="b0"), "not unique"),
    (lambda p: p["buckets"][1].update(hi="inf"), r"hi: expected a number or null"),
    (lambda p: p["units"][0]["options"].update({"gzip": {"bytes": 1, "time_s": 0.0}}), "'gzip' is not store"),
    (lambda p: p["buckets"][1]["predicted"]["peak_parts"].update(outputs=10**12), r"peak_parts: add up to"),
    (lambda p: p["buckets"][1]["predicted"]["peak_parts"].pop("rebuilt"), r"peak_parts: missing field 'rebuilt'"),
    (lambda p: p["buckets"][1]["predicted"]["peak_parts"].update(freed=10**12), r"peak_parts: add up to"),
])
def test_invalid_plan_names_what_is_wrong(plan, tmp_path, edit, message):
    with pytest.raises(FormatError, match=message):
        load_plan(_broken(plan, tmp_path, edit))
