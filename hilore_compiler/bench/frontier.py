"""The memory-speed frontier: every method at every memory ceiling, in one run of alternating rounds.

``hilore bench --ceilings 0.8,1.0,1.1,1.5`` (``BenchConfig.ceilings``, multiples
of GC's measured peak). The fixed methods (GC, store-all, the selective ACs,
GC with int8 checkpoints, uniform int8, GC + chunked log-probs) are set up
once, as ``runner.run_bench`` does, and placed at every ceiling; whether they
fit one is read from their measured peaks (``frontier_report.py``). The
budgeted methods are planned or searched at each ceiling:

- ``hilore``, ``hilore-blind``, ``int8-recompute``, ``hilore-step``, ``sac-milp``: one worker per
  ceiling, planned at ``<c>x-gc`` of the measured GC peak (``launcher.REFERENCE_GC``). A plan
  the solver cannot fit is a point that does not fit, with the smallest
  budget it could meet. A plan whose measured peak is over the ceiling is
  planned again, at a budget lowered by the overshoot (``REFITS`` times at
  most; ``_planned_point``): the memory model misses part of what Inductor's
  backward holds in a layer (its buffer pool), so the measurement, not the
  model, decides what fits, as it does for ``pt-budget``. A plan whose step
  runs the decisions of a plan already measured (same bucket decisions: the
  same compiled step) is not measured again: its point names the run that
  measured it. At a ceiling at or above store-all's measured peak the
  eager-loss methods are store-all's point, not planned at all.
- ``pt-budget``, its solver variants and ``inductor-fp8`` (``peers.SEARCHED``):
  the grid of their knob's probes (``peers.probe_grid``) is compiled once; at
  each ceiling the fastest probe whose measured peak fits is its point, and
  probes chosen at no ceiling are closed.

With ``calibrate``, every plan is made from a trace calibrated per unit first
(``calibrate.py``).

Then every run still measuring alternates in the rounds (``rounds.py``), so
every point's paired ratio against GC, and against any other point, comes from
the same rounds.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Any

from .calibrate import calibrate_cached_trace
from .launcher import REFERENCE_GC, SAME_PLAN, Launcher
from .methods import HILORE_BACKENDS, METHODS, STEP_METHODS
from .rounds import MethodRun, Progress, close_workers, compare_grads, warm_peak, warm_seconds
from .runner import BenchConfig, measure_all, new_launcher, predict_baselines
from .peers import SEARCHED, hidden_state_mb, knob_name, probe_grid
from .sac_milp import METHOD as SAC_MILP
from .search import Probe, choose

#: Methods planned (or searched, ``peers.SEARCHED``) at each ceiling; the others are placed where they fall.
BUDGETED = ("hilore", "hilore-blind", "int8-recompute", SAC_MILP, *SEARCHED, "hilore-step")

#: How many times a planned point whose measured peak is over its ceiling is planned again.
REFITS = 2
#: A re-plan aims this fraction further under the ceiling than the overshoot measured: the
#: peak does not shrink exactly with the budget (the plan's decisions move in whole units).
REFIT_MARGIN = 0.003

#: ``Point.status`` values.
MEASURED, DOES_NOT_FIT, FAILED = "measured", "does not fit", "failed"
#: A budgeted method at a ceiling above store-all's peak: it would keep everything, as store-all does.
AS_STORE_ALL = "store-all"


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """One method at one ceiling: the run measured for it, or why none is."""

    method: str
    #: Multiple of GC's measured peak.
    ceiling: float
    #: Name of the run measured for this point (a key of ``FrontierRun.runs``);
    #: None where nothing runs (``DOES_NOT_FIT``, ``FAILED``).
    run: str | None
    #: ``MEASURED`` (by ``run``, which may be another point's: ``note`` says so),
    #: ``DOES_NOT_FIT``, ``FAILED`` or ``AS_STORE_ALL``.
    status: str
    note: str = ""
    #: Where a plan does not fit: the smallest budget its solver could meet.
    min_budget_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierRun:
    """Every run of the sweep, by name, and every method's point at every ceiling."""

    config: BenchConfig
    device: str
    runs: dict[str, MethodRun]
    points: tuple[Point, ...]
    #: Measured peaks of the GC methods the ceilings are multiples of (``REFERENCE_GC``).
    gc_peaks: dict[str, int]
    #: Every searched method's probe: method, knob, measured peak, warm-up step seconds.
    probes: tuple[Probe, ...]
    #: Kept when a run failed (its log is there), else None (deleted).
    run_dir: str | None


def run_frontier(config: BenchConfig, progress: Progress) -> FrontierRun:
    """Set up the fixed methods, then each budgeted one at each ceiling; measure in rounds."""
    if not config.ceilings:
        raise ValueError("the frontier needs ceilings (BenchConfig.ceilings), e.g. (0.8, 1.0, 1.1, 1.5)")
    launcher = new_launcher(config, progress, prefix="hilore-frontier-")
    device, run_dir = launcher.device, launcher.run_dir
    progress(f"frontier of {config.model}, batch {config.batch}, seq_len {config.seq_len}, {config.dtype} on "
             f"{device} at {', '.join(f'{c:g}' for c in config.ceilings)} x GC; logs in {run_dir}")
    runs: dict[str, MethodRun] = {}
    points: list[Point] = []
    probes: tuple[Probe, ...] = ()
    try:
        for method in (m for m in METHODS if m in config.methods and m not in BUDGETED):
            runs[method] = launcher.start(method)
            points += [Point(method=method, ceiling=c, run=method, status=MEASURED) for c in config.ceilings]
        # Calibration is of HiLoRe's trace: only the hilore backends make one.
        planned = [m for m in METHODS if m in config.methods and m in BUDGETED and m in HILORE_BACKENDS]
        if config.calibrate and planned:
            calibrate_cached_trace(launcher, planned[0], max(config.ceilings))
        for method in (m for m in METHODS if m in config.methods and m in BUDGETED):
            if method in SEARCHED:
                more, tried = _searched_points(launcher, runs, method, progress)
                points, probes = points + more, probes + tried
            else:
                points += [_planned_point(launcher, runs, method, c) for c in config.ceilings]
        predict_baselines({r.method: r for r in reversed(runs.values())})
        measure_all(launcher, {name: runs[name] for name in measure_order(runs, points)}, progress)
    finally:
        close_workers(runs.values())
    compare_grads(runs)
    # A plan that does not fit is an answer, not a failure: its log need not be kept.
    failed = any(run.status not in ("ok", SAME_PLAN) and "min_budget_bytes" not in run.info for run in runs.values())
    if not failed:
        shutil.rmtree(run_dir, ignore_errors=True)
    return FrontierRun(config=config, device=device, runs=runs, points=tuple(points),
                       gc_peaks=dict(launcher.gc_peaks), probes=probes, run_dir=str(run_dir) if failed else None)


def measure_order(runs: dict[str, MethodRun], points: list[Point]) -> list[str]:
    """The order the rounds measure ``runs`` in: the fixed methods', then each ceiling's planned runs together.

    A ceiling's comparison is between its own runs (and the fixed ones that fit it), so
    they should run back to back: on a shared VM two workers' paired log ratio varied
    less the closer they ran in a round (sd 0.118 adjacent, 0.157 five apart, over 22
    disturbed rounds of ``frontier-small-T2048-t1-resident-full.json``, where the
    method-major order put HiLoRe five workers from int8 + recompute at each ceiling).
    """
    ceilings: dict[str, set[float]] = {}
    for point in points:
        if point.run is not None and point.run in runs:
            ceilings.setdefault(point.run, set()).add(point.ceiling)
    fixed = [name for name in runs if len(ceilings.get(name, ())) > 1]
    planned = sorted((name for name in runs if len(ceilings.get(name, ())) == 1),
                     key=lambda name: min(ceilings[name]))  # stable: method order within a ceiling
    return fixed + planned + [name for name in runs if name not in ceilings]


def _planned_point(launcher: Launcher, runs: dict[str, MethodRun], method: str, ceiling: float) -> Point:
    """``method`` planned at ``ceiling`` x its GC's measured peak: a run of its own, another
    run with the same plan, store-all's run, or a point that does not fit."""
    point = {"method": method, "ceiling": ceiling}
    gc_peak = launcher.gc_peaks.get(REFERENCE_GC[method])
    if gc_peak is None:
        return Point(**point, run=None, status=FAILED, note=f"no measured {REFERENCE_GC[method]} peak to plan at")
    store = warm_peak(runs.get("store-all"))
    if method not in STEP_METHODS and store is not None and store <= ceiling * gc_peak:
        return Point(**point, run="store-all", status=AS_STORE_ALL,
                     note=f"the ceiling holds store-all's {store / 1e6:.1f} MB: every plan is store-all")
    name, limit = f"{method}@{ceiling:g}x", ceiling * gc_peak
    multiple, over = ceiling, []
    while True:
        run = launcher.start(method, tag=f"@{ceiling:g}x", hilore_budget=f"{multiple:.6g}x-gc",
                             same_plan=lambda info: same_plan_run(runs, method, info))
        peak = warm_peak(run) if run.status == "ok" else None
        if peak is None or peak <= limit or len(over) == REFITS:
            break
        # Over the ceiling: plan again, lower by the overshoot measured.
        over.append((multiple, peak))
        close_workers([run])
        multiple *= limit / peak * (1 - REFIT_MARGIN)
        launcher.progress(f"{name}: measured {peak / gc_peak:.3f} x GC, over the ceiling; "
                          f"planning again at {multiple:.4g}x-gc")
    refit = ""
    if over:
        run.info["refits"] = [{"budget": f"{m:.6g}x-gc", "peak_bytes": int(p)} for m, p in over]
        refit = f"planned at {multiple:.4g}x-gc: " + "; ".join(
            f"the {m:.4g}x-gc plan measured {p / gc_peak:.3f} x GC" for m, p in over)
    if run.status == SAME_PLAN:
        twin = run.info["same_plan_as"]
        return Point(**point, run=twin, status=MEASURED, note=_notes(f"the same plan as {twin}, measured once", refit))
    runs[name] = run
    if run.status == "ok":
        return Point(**point, run=name, status=MEASURED, note=refit)
    needs = run.info.get("min_budget_bytes")
    if needs is not None:
        return Point(**point, run=None, status=DOES_NOT_FIT, min_budget_bytes=int(needs),
                     note=_notes(f"no plan fits; the smallest budget the solver meets is {needs / 1e6:.1f} MB "
                                 f"({needs / gc_peak:.3f} x GC)", refit))
    return Point(**point, run=None, status=FAILED, note=(run.error or "").splitlines()[0][:120])


def _notes(*notes: str) -> str:
    """A point's notes, the empty ones left out."""
    return "; ".join(n for n in notes if n)


def same_plan_run(runs: dict[str, MethodRun], method: str, info: dict[str, Any]) -> str | None:
    """The run already measured whose step runs the decisions ``info``'s plan runs, or None.

    Two plans run the same compiled step when the bucket the step runs has
    the same decisions (``plan["bucket_digests"]``), whatever the other
    buckets or the budget: e.g. HiLoRe's bucket b1 and the exposure-blind plan
    at one ceiling, or one method at two ceilings that both hold its plan.
    Eager-loss and whole-step methods compile different graphs and never match.
    """
    digest = _step_digest(info)
    if digest is None:
        return None
    for name, run in runs.items():
        if (run.status == "ok" and (run.method in STEP_METHODS) == (method in STEP_METHODS)
                and _step_digest(run.info) == digest):
            return name
    return None


def _step_digest(info: dict[str, Any]) -> str | None:
    """The digest of the decisions the step runs under its bucket, or None without a plan."""
    return info.get("plan", {}).get("bucket_digests", {}).get(info.get("bucket"))


def _probes(launcher: Launcher, method: str, progress: Progress) -> dict[str, MethodRun]:
    """Compile ``method`` at every knob of its grid, one worker each, by run name; the first
    probe that fails to compile stops the grid (a failure is not a memory answer)."""
    config = launcher.config
    unit = hidden_state_mb(config.model, config.batch, config.seq_len, config.dtype)
    tried: dict[str, MethodRun] = {}
    for knob in probe_grid(method, config.budget_probes, unit):
        run = launcher.start(method, tag=f"@{knob:g}", budget=knob)
        tried[run.name] = run
        if run.status != "ok":
            break
        progress(f"{method}: {knob_name(method)} {knob:g} -> peak {warm_peak(run) / 1e6:.1f} MB, "
                 f"{warm_seconds(run) or 0.0:.3f} s/step")
    return tried


def _searched_points(launcher: Launcher, runs: dict[str, MethodRun], method: str,
                     progress: Progress) -> tuple[list[Point], tuple[Probe, ...]]:
    """Compile every probe of ``method``'s grid once; at each ceiling keep the fastest that fits
    (``search.choose`` without slack: the report holds every point to the ceiling itself)."""
    config, gc_peak, knob = launcher.config, launcher.gc_peaks.get("gc"), knob_name(method)
    tried = _probes(launcher, method, progress)
    probes = {name: Probe(method=method, budget=getattr(r.worker_config.options, knob), peak_bytes=warm_peak(r),
                          seconds=warm_seconds(r), error=r.error) for name, r in tried.items()}
    points = []
    for ceiling in config.ceilings:
        point = {"method": method, "ceiling": ceiling}
        best = choose(list(probes.values()), ceiling * gc_peak, 0.0) if gc_peak else None
        if best is None:
            points.append(Point(**point, run=None, status=FAILED, note="no probe ran"))
        elif best.peak_bytes > ceiling * gc_peak:
            points.append(Point(**point, run=None, status=DOES_NOT_FIT,
                                note=f"no probe fits: the smallest measured peak is {best.peak_bytes / 1e6:.1f} MB "
                                     f"({knob} {best.budget:g})"))
        else:
            name = next(n for n, p in probes.items() if p is best)
            points.append(Point(**point, run=name, status=MEASURED, note=f"{knob} {best.budget:g}, the fastest "
                                f"of {len(probes)} probes that fits"))
    chosen = {p.run for p in points if p.run}
    for name, run in tried.items():
        if name in chosen or run.status != "ok":
            runs[name] = run
        else:
            close_workers([run])  # fits no ceiling faster than another probe: not measured in the rounds
    return points, tuple(probes.values())
