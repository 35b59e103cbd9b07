"""hilore bench --ceilings: the memory-speed frontier's placement, per-ceiling table and plan sharing."""

from __future__ import annotations

import json

import pytest

from hilore_compiler.bench.frontier import (
    AS_STORE_ALL,
    DOES_NOT_FIT,
    MEASURED,
    FrontierRun,
    Point,
    _planned_point,
    _searched_points,
    measure_order,
    same_plan_run,
)
from hilore_compiler.bench.frontier_report import (
    format_ceiling_table,
    format_points_table,
    summarise_frontier,
    to_json,
)
from hilore_compiler.bench.measure import StepSample
from hilore_compiler.bench.rounds import MethodRun
from hilore_compiler.bench.runner import BenchConfig
from hilore_compiler.cli import build_parser
from hilore_compiler.commands.bench import config_from_args
from hilore_compiler.tracefile import load_trace

CEILINGS = (0.8, 1.1, 1.5)


def _run(method: str, seconds: float, peak_mb: float, name: str | None = None, digest: str | None = None) -> MethodRun:
    """Four rounds of one step; the machine slows by round for every method alike, plus 0-2% of the run's own."""
    key = name or method
    samples = [StepSample(seconds=seconds * f * (1 + 0.01 * ((r + len(key)) % 3)), peak_bytes=0, round=r)
               for r, f in enumerate((0.9, 1.0, 1.2, 1.1))]
    info = {"bucket": "b1", "plan": {"bucket_digests": {"b1": digest}}} if digest else {}
    return MethodRun(method=method, name=key, samples=samples, peaks=[int(peak_mb * 1e6)] * 3, info=info,
                     fidelity={"cosine": 1.0, "rel_l2": 0.0})


def _frontier() -> FrontierRun:
    """GC 100 MB at 2.0 s; store-all 300 MB at 1.0 s; uniform int8 108 MB at 1.3 s; HiLoRe does not
    fit 0.8 (needs 85 MB), runs 1.2 s at 1.1 and 1.05 s at 1.5; the blind plan is HiLoRe's at 1.1 and
    its own (1.1 s) at 1.5; one pt-budget probe (140 MB, 1.5 s) fits 1.5 only."""
    runs = {r.name: r for r in (
        _run("store-all", 1.0, 300), _run("gc", 2.0, 100), _run("uniform-int8", 1.3, 108),
        _run("hilore", 1.2, 109, "hilore@1.1x", "aa"), _run("hilore", 1.05, 148, "hilore@1.5x", "bb"),
        _run("hilore-blind", 1.1, 147, "hilore-blind@1.5x", "cc"), _run("pt-budget", 1.5, 140, "pt-budget@0.5"))}
    points = [Point(method=m, ceiling=c, run=m, status=MEASURED) for m in ("store-all", "gc", "uniform-int8")
              for c in CEILINGS]
    points += [Point(method="hilore", ceiling=0.8, run=None, status=DOES_NOT_FIT, min_budget_bytes=85_000_000),
               Point(method="hilore", ceiling=1.1, run="hilore@1.1x", status=MEASURED),
               Point(method="hilore", ceiling=1.5, run="hilore@1.5x", status=MEASURED),
               Point(method="hilore-blind", ceiling=0.8, run=None, status=DOES_NOT_FIT, min_budget_bytes=85_000_000),
               Point(method="hilore-blind", ceiling=1.1, run="hilore@1.1x", status=MEASURED,
                     note="the same plan as hilore@1.1x, measured once"),
               Point(method="hilore-blind", ceiling=1.5, run="hilore-blind@1.5x", status=MEASURED),
               Point(method="pt-budget", ceiling=0.8, run=None, status=DOES_NOT_FIT),
               Point(method="pt-budget", ceiling=1.1, run=None, status=DOES_NOT_FIT),
               Point(method="pt-budget", ceiling=1.5, run="pt-budget@0.5", status=MEASURED)]
    config = BenchConfig(model="tiny", batch=2, seq_len=128, ceilings=CEILINGS,
                         methods=("store-all", "gc", "hilore", "hilore-blind", "uniform-int8", "pt-budget"))
    return FrontierRun(config=config, device="cpu", runs=runs, points=tuple(points), gc_peaks={"gc": 100_000_000},
                       probes=(), run_dir=None)


def test_each_ceiling_names_the_fastest_other_method_that_fits_and_hilore_over_it():
    report = summarise_frontier(_frontier())
    rows = {r.ceiling: r for r in report.rows}
    # 0.8 x GC: nothing fits (GC is 1.0); HiLoRe says what it would need.
    low = rows[0.8]
    assert low.fastest_other is None and low.vs_fastest is None and low.hilore.fits is False
    assert low.hilore.point.min_budget_bytes == 85_000_000
    # 1.1 x GC: uniform int8 (1.08 x GC) is the fastest other that fits; the blind plan is HiLoRe's own run.
    mid = rows[1.1]
    assert mid.fastest_other.point.method == "uniform-int8" and mid.hilore.fits
    assert mid.vs_fastest.ratio == pytest.approx(1.3 / 1.2, rel=0.02) and mid.vs_fastest.rounds == 4
    assert mid.vs_blind is None  # one plan, one run: no ratio between a run and itself
    assert mid.recovered == pytest.approx((2.0 - 1.2) / (2.0 - 1.0), rel=0.03)
    # 1.5 x GC: the blind plan (147 MB, 1.1 s) beats pt-budget and uniform int8; store-all does not fit.
    high = rows[1.5]
    assert high.fastest_other.point.method == "hilore-blind"
    assert high.vs_fastest.ratio == pytest.approx(1.1 / 1.05, rel=0.02) and high.vs_blind == high.vs_fastest
    fits = {(c.point.method, c.point.ceiling): c.fits for c in report.cells}
    assert fits[("store-all", 1.5)] is False and fits[("gc", 0.8)] is False and fits[("gc", 1.1)] is True
    assert fits[("pt-budget", 1.1)] is False and fits[("pt-budget", 1.5)] is True


def test_tables_and_json_say_does_not_fit_and_same_plan():
    report = summarise_frontier(_frontier())
    table = format_ceiling_table(report).splitlines()
    assert len(table) == 2 + len(CEILINGS)
    assert "does not fit: needs 85.0 MB" in table[2] and "| none |" in table[2]
    assert "uniform int8" in table[3] and "blind: the same plan" in table[3]
    assert "HiLoRe blind" in table[4] and "vs blind" in table[4]
    points = format_points_table(report)
    assert "does not fit" in points and "the same plan as hilore@1.1x" in points
    data = json.loads(json.dumps(to_json(report)))
    assert [r["ceiling"] for r in data["rows"]] == list(CEILINGS)
    assert data["rows"][1]["fastest_other"]["method"] == "uniform-int8"
    assert set(data["runs"]) == set(_frontier().runs) and len(data["points"]) == 6 * len(CEILINGS)


def test_a_hilore_point_over_its_ceiling_is_not_counted_as_fitting():
    frontier = _frontier()
    frontier.runs["hilore@1.1x"].peaks[:] = [int(112e6)] * 3  # 1.12 x GC, over 1.1
    row = {r.ceiling: r for r in summarise_frontier(frontier).rows}[1.1]
    assert row.hilore.fits is False
    assert "over the ceiling (1.120 x GC)" in format_ceiling_table(summarise_frontier(frontier))


def test_a_plan_already_measured_is_named_by_its_step_decisions():
    runs = {"hilore@1.1x": _run("hilore", 1.2, 109, "hilore@1.1x", "aa"),
            "uniform-int8": _run("uniform-int8", 1.3, 108, digest="uu")}
    assert same_plan_run(runs, "hilore-blind", {"bucket": "b1", "plan": {"bucket_digests": {"b1": "aa"}}}) \
        == "hilore@1.1x"
    assert same_plan_run(runs, "hilore", {"bucket": "b0", "plan": {"bucket_digests": {"b0": "uu"}}}) == "uniform-int8"
    assert same_plan_run(runs, "hilore", {"bucket": "b1", "plan": {"bucket_digests": {"b1": "zz"}}}) is None
    # A whole-step plan is another graph: it never shares a run with an eager-loss one.
    assert same_plan_run(runs, "hilore-step", {"bucket": "b1", "plan": {"bucket_digests": {"b1": "aa"}}}) is None
    runs["hilore@1.1x"].status = "failed"
    assert same_plan_run(runs, "hilore-blind", {"bucket": "b1", "plan": {"bucket_digests": {"b1": "aa"}}}) is None


class _ProbeLauncher:
    """Starts pt-budget probes whose peak and speed grow with the budget."""

    def __init__(self, ceilings):
        self.config = BenchConfig(model="tiny", ceilings=ceilings, budget_probes=4)
        self.gc_peaks = {"gc": 100_000_000}

    def start(self, method, tag="", budget=None, **_):
        from types import SimpleNamespace

        run = MethodRun(method=method, name=method + tag, worker_config=SimpleNamespace(
            options=SimpleNamespace(activation_memory_budget=budget)))
        run.peaks = [int((110 + 100 * budget) * 1e6)]  # 0.125 -> 122.5 MB ... 0.875 -> 197.5 MB
        run.warmup = [StepSample(seconds=2.0 - budget, peak_bytes=0)]
        return run


def test_pt_budget_probes_compile_once_and_each_ceiling_keeps_the_fastest_that_fits():
    runs: dict[str, MethodRun] = {}
    points, probes = _searched_points(_ProbeLauncher((1.1, 1.5, 2.0)), runs, "pt-budget", progress=lambda m: None)
    assert len(probes) == 4
    by = {p.ceiling: p for p in points}
    assert by[1.1].status == DOES_NOT_FIT and "smallest measured peak is 122.5 MB" in by[1.1].note
    assert by[1.5].run == "pt-budget@0.375"  # 147.5 MB fits 150; 0.625 (172.5) does not
    assert by[2.0].run == "pt-budget@0.875"
    assert set(runs) == {"pt-budget@0.375", "pt-budget@0.875"}  # probes chosen at no ceiling are not timed
    assert AS_STORE_ALL == "store-all"


class _OvershootLauncher:
    """Plans that measure 2% of GC over their budget, and no plan under 0.88 x GC."""

    def __init__(self):
        self.config = BenchConfig(model="tiny")
        self.gc_peaks = {"gc": 100_000_000}
        self.budgets: list[str] = []
        self.progress = lambda message: None

    def start(self, method, tag="", budget=None, *, hilore_budget=None, same_plan=None):
        self.budgets.append(hilore_budget)
        multiple = float(hilore_budget.removesuffix("x-gc"))
        run = MethodRun(method=method, name=method + tag)
        if multiple < 0.88:
            run.status, run.error, run.info = "failed", "infeasible budget", {"min_budget_bytes": 88_000_000}
            return run
        run.peaks = [int((multiple + 0.02) * 100_000_000)]
        return run


def test_a_plan_measured_over_its_ceiling_is_planned_again_lower_by_the_overshoot():
    launcher, runs = _OvershootLauncher(), {}
    point = _planned_point(launcher, runs, "hilore", 1.0)
    assert launcher.budgets[0] == "1x-gc" and len(launcher.budgets) == 2
    lowered = float(launcher.budgets[1].removesuffix("x-gc"))
    assert lowered == pytest.approx(1.0 / 1.02 * 0.997, rel=1e-5)
    assert point.status == MEASURED and point.run == "hilore@1x"
    assert runs["hilore@1x"].peaks[0] <= 100_000_000  # what the rounds measure fits
    assert "the 1x-gc plan measured 1.020 x GC" in point.note
    assert runs["hilore@1x"].info["refits"] == [{"budget": "1x-gc", "peak_bytes": 102_000_000}]


def test_a_plan_whose_lowered_budget_no_plan_meets_does_not_fit_and_says_why():
    launcher, runs = _OvershootLauncher(), {}
    point = _planned_point(launcher, runs, "int8-recompute", 0.89)
    assert len(launcher.budgets) == 2 and point.status == DOES_NOT_FIT
    assert point.min_budget_bytes == 88_000_000 and "the 0.89x-gc plan measured 0.910 x GC" in point.note
    assert [r.status for r in runs.values()] == ["failed"]  # the infeasible re-plan, as any unfit plan is


def test_calibrate_is_for_the_frontier():
    with pytest.raises(ValueError, match="give ceilings too"):
        BenchConfig(calibrate=True)
    args = build_parser().parse_args(["bench", "--quick", "--ceilings", "1.5", "--calibrate"])
    assert config_from_args(args).calibrate


def test_cli_ceilings_take_multiples_of_gc_with_or_without_the_suffix():
    args = build_parser().parse_args(["bench", "--quick", "--ceilings", "0.8, 1.0,1.5x-gc", "--risk-budget",
                                      "cos>=0.99"])
    config = config_from_args(args)
    assert config.ceilings == (0.8, 1.0, 1.5) and config.hilore_risk_budget == "cos>=0.99"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--ceilings", "0,1.1"])
    with pytest.raises(ValueError, match="distinct"):
        BenchConfig(ceilings=(1.1, 1.1))


# --- one real sweep ----------------------------------------------------------

@pytest.mark.slow
def test_a_quick_sweep_plans_per_ceiling_and_reports_a_ceiling_no_plan_fits(request, monkeypatch):
    """GC and HiLoRe at two ceilings of the tiny policy: far below GC no plan fits, and the
    point says what budget would; at 1.5 x GC HiLoRe runs, measured in rounds against GC."""
    from hilore_compiler.bench.frontier import run_frontier

    monkeypatch.delenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", raising=False)  # see test_bench's real run
    cache = request.config.cache.mkdir("hilore-frontier-compile")
    config = BenchConfig(model="tiny", batch=2, seq_len=128, methods=("gc", "hilore"), ceilings=(0.3, 1.5),
                         repeats=2, steps_per_round=1, warmup=1, settle_rounds=0, device="cpu", threads=1,
                         cache_dir=str(cache), calibrate=True)
    messages = []
    result = run_frontier(config, progress=messages.append)
    # --calibrate: the plans come from the shared cache's trace, measured per unit.
    trace_path = max((cache / "hilore").glob("*.trace.json"), key=lambda p: p.stat().st_mtime)
    calibrated = load_trace(trace_path)
    assert sum(bool(u.sensitivity) for u in calibrated.units) > len(calibrated.units) // 2
    assert any(m.startswith("calibrate: ") for m in messages)
    points = {(p.method, p.ceiling): p for p in result.points}
    gc_peak = result.gc_peaks["gc"]
    low, high = points[("hilore", 0.3)], points[("hilore", 1.5)]
    assert low.status == DOES_NOT_FIT and low.run is None and low.min_budget_bytes > 0.3 * gc_peak
    assert high.status == MEASURED and [s.round for s in result.runs[high.run].samples] == [0, 1]
    report = summarise_frontier(result)
    row = {r.ceiling: r for r in report.rows}[1.5]
    assert row.hilore.fits and row.fastest_other.point.method == "gc" and row.vs_fastest.rounds == 2


class _Worker:
    """A ``WorkerProcess`` stand-in: plans at once, or fails as a solver that cannot fit does."""

    spawned: list[_Worker] = []
    infeasible = False

    def __init__(self, config, env, log_path):
        self.config, self.closed = config, False
        self.spawned.append(self)

    def request(self, cmd, **fields):
        from hilore_compiler.bench.process import WorkerError

        if self.infeasible:
            raise WorkerError("InfeasibleBudgetError: ...", min_budget_bytes=170_000_000)
        if cmd == "measure":
            return {"samples": [{"seconds": 1.0, "peak_bytes": 7}] * fields["steps"]}
        return {"compile_s": 1.0, "warmup": [], "info": {"mmap_threshold_set": False, "bucket": "b1",
                "plan": {"decisions_digest": "d", "bucket_digests": {"b1": "aa"}}}}

    def close(self):
        self.closed = True


def test_the_launcher_closes_a_plan_already_measured_and_keeps_what_an_unfit_one_needs(tmp_path, monkeypatch):
    from hilore_compiler.bench import launcher as launcher_module
    from hilore_compiler.bench.launcher import SAME_PLAN, Launcher

    monkeypatch.setattr(launcher_module, "WorkerProcess", _Worker)
    monkeypatch.setattr(_Worker, "spawned", [])
    launcher = Launcher(BenchConfig(model="tiny", ceilings=(1.1,)), "cpu", tmp_path, [].append)
    twin = launcher.start("hilore-blind", tag="@1.1x", hilore_budget="1.1x-gc", same_plan=lambda info: "hilore@1.1x")
    assert twin.status == SAME_PLAN and twin.info["same_plan_as"] == "hilore@1.1x"
    assert len(_Worker.spawned) == 1 and _Worker.spawned[0].closed  # no peak worker: nothing left to measure
    assert _Worker.spawned[0].config.options.hilore_budget == "1.1x-gc"
    own = launcher.start("hilore", tag="@1.1x", hilore_budget="1.1x-gc", same_plan=lambda info: None)
    assert own.status == "ok" and len(_Worker.spawned) == 3 and own.worker is _Worker.spawned[1]
    monkeypatch.setattr(_Worker, "infeasible", True)
    unfit = launcher.start("hilore", tag="@0.8x", hilore_budget="0.8x-gc")
    assert unfit.status == "failed" and unfit.info["min_budget_bytes"] == 170_000_000


def test_rounds_measure_each_ceilings_runs_back_to_back_after_the_fixed_methods():
    runs = {name: MethodRun(method=name.split("@")[0], name=name) for name in (
        "gc", "gc-int8", "hilore@1x", "hilore@1.5x", "int8-recompute@1x", "int8-recompute@1.5x", "failed")}
    points = [Point(method=m, ceiling=c, run=m, status=MEASURED) for m in ("gc", "gc-int8") for c in (1.0, 1.5)]
    points += [Point(method=m, ceiling=c, run=f"{m}@{c:g}x", status=MEASURED)
               for m in ("hilore", "int8-recompute") for c in (1.0, 1.5)]
    points += [Point(method="hilore-blind", ceiling=1.5, run="hilore@1.5x", status=MEASURED)]
    assert measure_order(runs, points) == ["gc", "gc-int8", "hilore@1x", "int8-recompute@1x",
                                           "hilore@1.5x", "int8-recompute@1.5x", "failed"]


def test_peer_table_pairs_hilore_with_every_method_at_every_ceiling(tmp_path, capsys):
    from hilore_compiler.bench import peer_table

    def run(seconds):  # two steps in each of three rounds
        return {"status": "ok", "samples": [{"seconds": s, "peak_bytes": 0, "round": r}
                                            for r, s in enumerate(seconds) for _ in range(2)]}

    result = {"hilore_method": "hilore", "tokens_per_step": 100, "runs": {
        "hilore@1x": run([1.0, 1.0, 1.0]), "gc": run([1.2, 1.2, 1.2]), "pt-budget@0.5": run([0.5, 0.5, 0.5]),
        "pt-budget@0.1": run([2.0, 2.0, 2.0])}, "points": [
        {"method": "hilore", "ceiling": 1.0, "run": "hilore@1x", "fits": True},
        {"method": "gc", "ceiling": 1.0, "run": "gc", "fits": True},
        {"method": "pt-budget", "ceiling": 1.0, "run": "pt-budget@0.5", "fits": False},
        {"method": "int8-recompute", "ceiling": 1.0, "run": None, "fits": False},
        {"method": "pt-budget-knee", "ceiling": 1.0, "run": None, "fits": False, "status": "does not fit"},
        {"method": "uniform-int8", "ceiling": 1.0, "run": "hilore@1x", "fits": True}]}
    found = {p.method: p for p in peer_table.pairings(result)}
    assert found["gc"].ratio.ratio == pytest.approx(1.2)
    assert found["pt-budget"].ratio.ratio == pytest.approx(0.5) and not found["pt-budget"].fits
    assert found["int8-recompute"].ratio is None
    # Only a fitting peer can be the weakest pairing: pt-budget is faster but over the ceiling.
    assert peer_table.weakest(list(found.values()))[1.0].method == "gc"
    table = peer_table.format_table(list(found.values()))
    # No run: a point the method could not fit says so; one it has no point at, "no point".
    # A method whose point is HiLoRe's own run is no pairing, and says so.
    assert found["uniform-int8"].own and found["uniform-int8"].ratio is None
    assert "| 1 | 1.200 [1.200, 1.200] | does not fit | no point | does not fit | HiLoRe's plan |" in table
    path = tmp_path / "result.json"
    path.write_text("{not json")
    assert peer_table.main([str(path)]) == 2
    assert "is not a readable frontier result" in capsys.readouterr().err


def test_peer_table_pairs_by_fastest_step_where_interference_hits_some_rounds(tmp_path, capsys):
    """One-sided noise (a slow round of the other method) moves the paired mean, not the fastest steps."""
    from hilore_compiler.bench import peer_table

    def run(seconds):
        return {"status": "ok", "samples": [{"seconds": 9.0, "peak_bytes": 0, "round": None}]  # warm-up: not counted
                + [{"seconds": s, "peak_bytes": 0, "round": r} for r, s in enumerate(seconds)]}

    result = {"hilore_method": "hilore", "tokens_per_step": 100, "runs": {
        "hilore@1x": run([1.0, 1.0, 1.0, 1.0]), "gc": run([1.1, 1.65, 1.1, 1.65])}, "points": [
        {"method": "hilore", "ceiling": 1.0, "run": "hilore@1x", "fits": True},
        {"method": "gc", "ceiling": 1.0, "run": "gc", "fits": True}]}
    (gc,) = peer_table.pairings(result)
    assert gc.fastest == pytest.approx(1.1) and gc.ratio.ratio > 1.3
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    assert peer_table.main([str(path), "--fastest"]) == 0
    assert "| 1 | 1.100 |" in capsys.readouterr().out
