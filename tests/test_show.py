"""The ``hilore plan`` and ``hilore show`` commands, through ``cli.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hilore_compiler import cli
from hilore_compiler.planload import load_plan
from hilore_compiler.solver import solve
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

TRACES = Path(__file__).resolve().parents[1] / "traces"
SMALL = SyntheticConfig(num_layers=1, hidden=64, intermediate=172, heads=4, kv_heads=2, vocab=128,
                        batch=2, seq_len=16)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("show")
    trace = synthetic_trace(SMALL)
    trace_path = trace.save(root / "trace.json")
    plan_path = solve(trace, "0.85x-store", buckets=2).save(root / "plan.json")
    return trace_path, plan_path


def test_plan_command_writes_a_valid_plan(files, tmp_path, capsys):
    trace_path, _ = files
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", str(trace_path), "--budget", "0.9x-store", "--risk", "0.05", "--buckets", "2",
                   "--codecs", "bf16,int8", "--batch", "4", "--seq-len", "32", "-o", str(out)])
    captured = capsys.readouterr()
    assert rc == 0
    plan = load_plan(out)
    assert (plan.batch, plan.seq_len, plan.budget, plan.risk_budget) == (4, 32, "0.9x-store", 0.05)
    assert plan.bucket_names == ("zero", "b0", "b1")
    assert set(plan.codecs) <= {"bf16", "int8"}
    assert "planning" in captured.err and "bucket b1 " in captured.err  # progress on stderr
    assert f"wrote {out}" in captured.out and "b0  exposure (0," in captured.out


def test_plan_command_reports_an_infeasible_budget(files, tmp_path, capsys):
    trace_path, _ = files
    rc = cli.main(["plan", str(trace_path), "--budget", "100", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "smallest feasible budget is" in err and "x-gc" in err
    assert not (tmp_path / "p.json").exists()
    rc = cli.main(["plan", str(trace_path), "--budget=-3GB", "-o", str(tmp_path / "p.json")])
    assert rc == 2 and "accepted:" in capsys.readouterr().err


def test_show_plan_prints_every_section(files, capsys):
    _, plan_path = files
    assert cli.main(["show", str(plan_path)]) == 0
    out = capsys.readouterr().out
    for section in ("== plan: synthetic-llama-1L", "== buckets", "== per layer", "== per kind",
                    "== totals against GC and store-all"):
        assert section in out
    assert "layer 0" in out and "outside" in out and "mlp.gate" in out and "skip" in out
    headings = [line for line in out.splitlines() if line.startswith("== per layer, ")]
    named = " ".join(headings)
    assert "b0" in named and "b1" in named  # each bucket under the plan it runs, shared plans once
    assert len(headings) == len({b.decisions for b in load_plan(plan_path).buckets if not b.skip})
    assert max(map(len, out.splitlines())) <= 100
    plan = load_plan(plan_path)
    totals = out.split("== totals against GC and store-all")[1]
    assert f"{plan.bucket('b1').memory_bytes / plan.gc_bytes:.2f}x" in totals


def test_show_trace_prints_units_and_pareto_curve(files, tmp_path, capsys):
    trace_path, _ = files
    png = tmp_path / "curve.png"
    assert cli.main(["show", str(trace_path), "--units", "--points", "5", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "== trace: synthetic-llama-1L" in out and "== recovery units" in out
    assert "model.layers.0.mlp.gate_proj:mm:0" in out
    curve = out.split("== memory-time Pareto curve")[1].split("wrote ")[0].strip().splitlines()
    assert len(curve) == 1 + 2 + 5  # title rest, header, rule, five budgets
    top = curve[-1].split()  # the store-all budget: nothing compressed or recomputed, no time
    assert top[-3:-1] == ["0", "0"] and "1.00x" in top and "0 s" in curve[-1]
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_trace_by_default_sums_units_per_kind_in_100_columns_and_solves_nothing(capsys, monkeypatch):
    from hilore_compiler.commands import show

    def no_solver(*args, **kwargs):
        raise AssertionError("show without --curve must not solve")

    monkeypatch.setattr(show, "pareto_curve", no_solver)
    assert cli.main(["show", str(TRACES / "small-cpu-T2048-int4.json")]) == 0
    out = capsys.readouterr().out
    assert "== recovery units per kind" in out and "mlp.gate_proj.linear" in out
    assert "Pareto" not in out and ":mm:0" not in out  # no curve, no unit keys
    assert max(map(len, out.splitlines())) <= 100


def test_show_rejects_malformed_files(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["show", str(bad)]) == 2
    assert "not valid JSON (line 1" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something/v9"}))
    assert cli.main(["show", str(other)]) == 2
    assert "expected 'hilore.plan/v1' or 'hilore.trace/v1'" in capsys.readouterr().err
    assert cli.main(["show", str(tmp_path / "missing.json")]) == 2
