"""``hilore bench --ceilings ... --calibrate``: plan the frontier from a trace calibrated per unit.

HiLoRe's error budget bounds each unit's gradient error through a sensitivity:
a proxy from the trace, or one measured by ``hilore calibrate``. Measured,
int4 on the attention units of ``small`` costs about a tenth of what the proxy
charges, which moves the 1.5x plan (docs/benchmarks.md, the frontier). The
planned methods' workers take their trace from the run's shared hilore cache,
so calibrating means: one hilore worker traces into that cache, ``hilore
calibrate --per-unit`` measures the trace in place (written atomically), the
plans it left are deleted, and every plan of the sweep is made from the
calibrated trace. A trace already calibrated (a persistent ``--cache-dir``)
is used as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..tracefile import load_trace
from .launcher import Launcher
from .rounds import close_workers


def calibrate_cached_trace(launcher: Launcher, method: str, ceiling: float) -> Path:
    """Make sure the shared cache holds ``method``'s trace, calibrated per unit; returns its path.

    ``method`` (a planned one) is started once at ``ceiling`` so that its worker
    traces; its run is closed, not measured.
    """
    config, cache = launcher.config, Path(launcher.hilore_cache)
    # Always through a worker, even when the cache holds traces: those may be
    # of an older hilore (traces are keyed by its code), which the workers
    # would not read, and they would plan from a new, uncalibrated trace. The
    # worker loads or writes this code's trace, then the newest.
    launcher.progress(f"calibrate: tracing with a {method} worker first (or reading its cached trace)")
    close_workers([launcher.start(method, tag="@trace", hilore_budget=f"{ceiling:g}x-gc")])
    trace_path = _newest_trace(cache)
    if trace_path is None:
        raise RuntimeError(f"--calibrate: the {method} worker left no trace in {cache}; "
                           f"its log is in {launcher.run_dir}")
    trace = load_trace(trace_path)
    if any(u.sensitivity for u in trace.units):
        launcher.progress(f"calibrate: {trace_path.name} is calibrated already; planning from it")
        return trace_path
    launcher.progress(f"calibrate: measuring {len(trace.units)} units' gradient sensitivity per codec "
                      f"(hilore calibrate --per-unit; a forward and backward per unit and codec)")
    partial = trace_path.with_name(trace_path.name.removesuffix(".trace.json") + ".calibrating.json")
    command = [sys.executable, "-m", "hilore_compiler", "calibrate", "--model", config.model,
               "--dtype", config.dtype, "--seed", str(config.seed), "--trace", str(trace_path), "--per-unit",
               "-o", str(partial)]
    if config.hilore_codecs:
        command += ["--codecs", ",".join(config.hilore_codecs)]
    log = launcher.run_dir / "calibrate.log"
    with open(log, "w") as out:
        done = subprocess.run(command, env=launcher.env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"--calibrate: hilore calibrate failed (exit {done.returncode}); see {log}")
    os.replace(partial, trace_path)  # atomic: a worker never reads half a trace
    for plan in cache.glob("*.plan.json"):  # made from the uncalibrated trace
        plan.unlink()
    launcher.progress(f"calibrate: {trace_path.name} calibrated; every plan is made from it")
    return trace_path


def _newest_trace(cache: Path) -> Path | None:
    traces = sorted(cache.glob("*.trace.json"), key=lambda p: p.stat().st_mtime)
    return traces[-1] if traces else None
