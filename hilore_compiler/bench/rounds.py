"""A method's run and the alternating rounds every bench measures in.

``MethodRun`` gathers one method's figures as a bench goes (set-up, settling
and counted steps, peaks, gradient fidelity); ``measure_rounds`` asks every
live worker, in an order rotated by one per round and reversed every other
round, for ``steps_per_round`` measured steps. Alternating spreads slow phases
of a shared machine over all methods instead of one. Both the step bench
(``runner.py``) and the actor bench (``actor.py``) drive their workers this way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .measure import StepSample, gradient_fidelity
from .process import WorkerError, WorkerProcess

Progress = Callable[[str], None]


@dataclass(slots=True, kw_only=True)
class MethodRun:
    """One method's measurements, filled in as the run goes."""

    method: str
    #: ``method`` plus a tag where one method has several workers (pt-budget's probes).
    name: str | None = None
    status: str = "ok"
    error: str | None = None
    compile_s: float | None = None
    warmup: list[StepSample] = field(default_factory=list)
    #: Steps of the settling rounds (``BenchConfig.settle_rounds``): timed, not counted.
    settle: list[StepSample] = field(default_factory=list)
    samples: list[StepSample] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    grad_path: str | None = None
    #: Gradient cosine and relative L2 error against store-all's, same batch.
    fidelity: dict[str, float] | None = None
    worker: WorkerProcess | None = None
    #: Per-step peaks measured in a process of its own (on CPU, where the
    #: timed workers run on the default allocator and their samples' VmHWM
    #: measures no peak); empty where the timed samples carry the peaks (CUDA).
    peaks: list[int] = field(default_factory=list)
    #: The configuration ``Launcher.start`` ran, which ``Launcher.time`` reuses.
    worker_config: Any = None
    #: The timed worker while the peak worker runs (``Launcher.plans_first``).
    timed_worker: WorkerProcess | None = None

    def fail(self, error: Exception, progress: Progress) -> None:
        self.status, self.error = "failed", str(error)
        progress(f"{self.name or self.method}: FAILED: {_first_line(error)}")
        for worker in (self.worker, self.timed_worker):
            if worker is not None:
                worker.close()
        self.worker = self.timed_worker = None


def _first_line(error: Exception) -> str:
    """The line of an error a progress line shows: the innermost of dynamo's wrapping, if it quotes one."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    inner = [line for line in lines if "Error: " in line and not line.startswith("BackendCompilerFailed")]
    return (inner or lines or [""])[-1 if inner else 0]


def describe(samples: list[StepSample], *, peak: bool = True) -> str:
    """``0.123 s/step, peak 12.3 MB`` (medians) for progress lines; ``peak=False``
    leaves the peak out where the samples' peaks measure nothing (a worker on
    the default allocator, ``actor.run_actor_bench``)."""
    if not samples:
        return "no steps"
    seconds = sorted(s.seconds for s in samples)[len(samples) // 2]
    if not peak:
        return f"{seconds:.3f} s/step"
    peak_bytes = sorted(s.peak_bytes for s in samples)[len(samples) // 2]
    return f"{seconds:.3f} s/step, peak {peak_bytes / 1e6:.1f} MB"


def peak_samples(run: MethodRun) -> list[int]:
    """A method's per-step peaks: its peak worker's (``run.peaks``, CPU), else its timed samples' (CUDA)."""
    return list(run.peaks) or [s.peak_bytes for s in run.samples]


def warm_peak(run: MethodRun | None) -> float | None:
    """Median set-up peak bytes of a method that set up (its peak worker's), else None."""
    if run is not None and run.status == "ok" and run.peaks:
        return float(sorted(run.peaks)[len(run.peaks) // 2])
    return _warm_median(run, "peak_bytes")


def warm_seconds(run: MethodRun | None) -> float | None:
    """Median warm-up step seconds of a method that set up, else None."""
    return _warm_median(run, "seconds")


def _warm_median(run: MethodRun | None, field_name: str) -> float | None:
    if run is None or run.status != "ok" or not run.warmup:
        return None
    values = sorted(getattr(s, field_name) for s in run.warmup)
    return float(values[len(values) // 2])


def measure_rounds(runs: list[MethodRun], config: Any, progress: Progress, *, peaks: bool = True) -> None:
    """``config.settle_rounds`` uncounted rounds, then ``config.repeats`` counted ones; each
    live method measures ``config.steps_per_round`` steps per round (``peaks``: whether
    progress lines show the samples' peaks, ``describe``). Settling steps go to ``run.settle``.

    ``config`` is a ``BenchConfig`` or an ``actor.ActorBenchConfig``."""
    settle = config.settle_rounds
    for r in range(-settle, config.repeats):
        live = [run for run in runs if run.worker is not None]
        if not live:
            return
        shift = r % len(live)  # rotate so no method always follows the same one
        order = live[shift:] + live[:shift]
        # Every other round runs backwards, so of two neighbours neither is always
        # the first: a drift within the round then favours each in turn.
        for run in order if r % 2 == 0 else order[::-1]:
            try:
                reply = run.worker.request("measure", steps=config.steps_per_round)
            except WorkerError as e:
                run.fail(e, progress)
                continue
            # Tagged with the round: the report pairs each method's round with GC's.
            kept = run.settle if r < 0 else run.samples
            kept += [dataclasses.replace(StepSample(**s), round=r) for s in reply["samples"]]
        which = (f"settling round {r + settle + 1}/{settle} (not counted)" if r < 0
                 else f"round {r + 1}/{config.repeats}")
        done = ", ".join(f"{run.name or run.method} {describe(run.settle if r < 0 else run.samples, peak=peaks)}"
                         for run in live if run.worker)
        progress(f"{which}: {done}")


def close_workers(runs: Iterable[MethodRun]) -> None:
    """Close every worker still running (after the rounds, or when they fail)."""
    for run in runs:
        for worker in (run.worker, run.timed_worker):
            if worker is not None:
                worker.close()
        run.worker = run.timed_worker = None


def compare_grads(runs: dict[str, MethodRun]) -> None:
    """Fill each method's ``fidelity`` against store-all's gradient of the same batch."""
    exact_run = runs.get("store-all")
    if exact_run is None or exact_run.status != "ok" or not Path(exact_run.grad_path).exists():
        return
    exact = torch.load(exact_run.grad_path)
    for run in runs.values():
        if run.status == "ok" and Path(run.grad_path).exists():
            cosine, rel_l2 = gradient_fidelity(torch.load(run.grad_path), exact)
            run.fidelity = {"cosine": cosine, "rel_l2": rel_l2}
