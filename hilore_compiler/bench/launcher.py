"""Starting a method's workers: compile, warm up, measure the peak, then the worker the rounds time.

Each method runs in its own process (``worker.py``), driven over a pipe
(``process.py``). On CPU the peak and the time come from two workers of the
method, one with ``MALLOC_MMAP_THRESHOLD_=65536`` (VmHWM needs it) and one
on the heap ``--heap`` names (glibc's default unless ``fixed``); on CUDA one
worker does both (``Launcher``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .measure import StepSample
from .methods import HILORE_BACKENDS, STEP_METHODS, MethodOptions
from .peers import SEARCHED, knob_name
from .process import WorkerError, WorkerProcess, worker_env
from .rounds import MethodRun, Progress, close_workers, describe, warm_peak
from .worker import WorkerConfig

if TYPE_CHECKING:  # runner.py imports this module
    from .runner import BenchConfig


#: Steps whose peaks a CPU peak worker measures after its warm-up (the
#: peak is the same step after step, DESIGN.md "Measuring"; three show it).
PEAK_STEPS = 3

#: ``MethodRun.status`` of a run whose plan another run measures (``Launcher.start``'s ``same_plan``).
SAME_PLAN = "same plan"

#: ``same_plan(info)``: the name of a run already measured with the plan ``info`` describes, or None.
SamePlan = Callable[[dict[str, Any]], "str | None"]

#: The GC method whose measured peak each planned method's ``x-gc`` budget
#: refers to: the one that runs the same step (eager or compiled loss).
REFERENCE_GC = {"hilore": "gc", "hilore-blind": "gc", "int8-recompute": "gc", "sac-milp": "gc", "paper": "gc",
                "hilore-step": "gc-chunked"}


class Launcher:
    """Starts and sets up workers that share one run's configuration and caches.

    On CPU every method has two workers, one after the other. ``start``'s
    measures the peak: it runs with ``MMAP_THRESHOLD_ENV``, which VmHWM needs
    (measure.py) and which slows every step by page faults (store-all's most:
    25% on the actor bench's microbatch: bench/overhead.py, commit 1a36683), so it measures
    ``PEAK_STEPS`` peaks and exits. ``time``'s runs the rounds on the default
    allocator, as a trainer does, or on a fixed heap (``config.heap``),
    compiling from the shared caches. A method
    that plans sets up its timed worker first instead, so that its peak worker
    too compiles from the caches (``plans_first``). On CUDA one worker does
    both: ``max_memory_allocated`` needs no allocator setting.
    """

    def __init__(self, config: BenchConfig, device: str, run_dir: Path, progress: Progress) -> None:
        self.config, self.device, self.run_dir, self.progress = config, device, run_dir, progress
        cache = Path(config.cache_dir).expanduser() if config.cache_dir else run_dir / "cache"
        self.hilore_cache = str(cache / "hilore")
        self.env = worker_env(cache / "inductor", heap=config.heap)
        #: Whether peaks are measured by workers of their own (CPU, see above).
        self.peaks_apart = device == "cpu"
        self.peak_env = worker_env(cache / "inductor", peak=True) if self.peaks_apart else self.env
        #: Measured peaks of the GC methods set up so far: the ceilings the
        #: HiLoRe methods' ``x-gc`` budgets are multiples of (``REFERENCE_GC``),
        #: so that they plan to the same measured ceiling the report holds
        #: every method to.
        self.gc_peaks: dict[str, int] = {}

    def start(self, method: str, tag: str = "", budget: float | None = None, *, hilore_budget: str | None = None,
              same_plan: SamePlan | None = None) -> MethodRun:
        """Spawn ``method``'s worker (``budget``: a searched method's knob, ``peers.knob_name``), compile, warm it up and measure its peak (``run.peaks``);
        a failure is recorded, not raised (with ``info["min_budget_bytes"]`` where a
        plan did not fit). On CPU the worker exits after its peaks:
        ``time`` starts the one the rounds use, except for a method that plans
        (``plans_first``), whose timed worker is set up here, before its peak worker.

        ``hilore_budget`` replaces the configuration's for this method;
        ``same_plan(info)`` names a run already measured with the plan the
        first worker made, or None: if it names one, the method's workers
        are closed and the run comes back with status ``SAME_PLAN`` (the
        frontier measures each plan once)."""
        name = method + tag
        # A searched method's probe: its knob (a memory budget, fp8's size threshold).
        knob = {knob_name(method): budget} if method in SEARCHED else {}
        grad_path = str(self.run_dir / f"grad-{name}.pt")
        options = MethodOptions(hilore_budget=hilore_budget or self.config.hilore_budget,
                                hilore_codecs=self.config.hilore_codecs,
                                hilore_risk_budget=self.config.hilore_risk_budget,
                                hilore_cache_dir=self.hilore_cache, **knob,
                                gc_peak_bytes=self.gc_peaks.get(REFERENCE_GC.get(method, "")),
                                step_chunks=self.config.step_chunks)
        config = WorkerConfig(method=method, model=self.config.model, batch=self.config.batch,
                              seq_len=self.config.seq_len, seed=self.config.seed, device=self.device,
                              warmup=self.config.warmup, options=options, grad_path=grad_path,
                              threads=self.config.threads, dtype=self.config.dtype)
        run = MethodRun(method=method, name=name, grad_path=grad_path, worker_config=config)
        self.progress(f"{name}: compiling and warming up")
        planned_first = self.plans_first(method)
        try:
            if planned_first:
                self._start_timed(run, config)
                if self._measured_already(run, same_plan):
                    return run
                config = dataclasses.replace(config, grad_path=None, options=_as_chosen(options, run.info))
            run.worker = WorkerProcess(config, env=self.peak_env, log_path=self.run_dir / f"{name}.log")
            reply = run.worker.request("setup")
            run.warmup = [StepSample(**s) for s in reply["warmup"]]
            if planned_first:  # the timed worker compiled and planned; its figures stand
                _check_same_plan(name, timed=run.info, measured=reply["info"], cache=self.hilore_cache)
            else:
                run.compile_s, run.info = reply["compile_s"], reply["info"]
            if self.peaks_apart:
                samples = run.worker.request("measure", steps=PEAK_STEPS)["samples"]
                run.peaks = [int(s["peak_bytes"]) for s in samples]
                run.worker.close()
                run.worker, run.timed_worker = run.timed_worker, None
        except WorkerError as e:
            run.fail(e, self.progress)
            if e.min_budget_bytes is not None:
                run.info["min_budget_bytes"] = e.min_budget_bytes
            return run
        if not planned_first and self._measured_already(run, same_plan):
            return run
        if method in REFERENCE_GC.values() and not tag and warm_peak(run) is not None:
            self.gc_peaks[method] = int(warm_peak(run))  # what the HiLoRe methods' x-gc budgets refer to
        peak = f", peak {warm_peak(run) / 1e6:.1f} MB" if self.peaks_apart else ""
        self.progress(f"{name}: compiled in {run.compile_s:.1f} s; warm-up "
                      f"{describe(run.warmup, peak=not self.peaks_apart)}{peak}")
        return run

    def plans_first(self, method: str) -> bool:
        """Whether ``method``'s timed worker is set up before its peak worker (CPU, HiLoRe backends).

        The first process of a method that plans traces, profiles and solves,
        and that leaves its heap fragmented: the step's small allocations then
        land on pages trimmed away and fault them back in, so its VmHWM peak
        read over the same plan's in a process that did not plan (bf16 small,
        B=2, T=2048: 197.0 MB against hilore-blind's 176.4 with the same
        decisions, allocator peaks equal). Planning in the timed worker also
        profiles the costs on the allocator the rounds run on. Not where
        ``hilore-step`` chooses its chunk size: the choice measures each
        candidate's peak, which needs the peak worker's allocator setting.
        """
        choosing_chunks = method in STEP_METHODS and bool(self.config.step_chunks)
        return self.peaks_apart and method in HILORE_BACKENDS and not choosing_chunks

    def _measured_already(self, run: MethodRun, same_plan: SamePlan | None) -> bool:
        """Whether ``same_plan`` names a run with ``run``'s plan; if so ``run`` closes its workers."""
        twin = same_plan(run.info) if same_plan is not None and run.status == "ok" else None
        if twin is None:
            return False
        close_workers([run])
        run.status, run.info["same_plan_as"] = SAME_PLAN, twin
        self.progress(f"{run.name}: the same plan as {twin}, measured once")
        return True

    def _start_timed(self, run: MethodRun, config: WorkerConfig) -> None:
        """Set up ``run``'s timed worker (the timed heap) first; it compiles, plans and
        writes the gradient, and stays alive for the rounds (``run.timed_worker``)."""
        name = run.name or run.method
        run.timed_worker = WorkerProcess(config, env=self.env, log_path=self.run_dir / f"{name}-timed.log")
        reply = run.timed_worker.request("setup")
        run.compile_s, run.info = reply["compile_s"], reply["info"]
        run.info["timed_worker"] = _timed_info(reply)

    def time(self, run: MethodRun) -> None:
        """Start the worker ``run``'s rounds are timed in (CPU: on the timed heap,
        compiled from the caches ``start``'s worker filled); a failure is recorded."""
        if run.status != "ok" or run.worker is not None:
            return  # failed, or set up already: CUDA's one worker, or a method that plans first
        config = dataclasses.replace(run.worker_config, grad_path=None,
                                     options=_as_chosen(run.worker_config.options, run.info))
        name = run.name or run.method
        self.progress(f"{name}: starting the worker the rounds time ({self.config.heap} heap)")
        try:
            run.worker = WorkerProcess(config, env=self.env, log_path=self.run_dir / f"{name}-timed.log")
            reply = run.worker.request("setup")
            _check_same_plan(name, timed=reply["info"], measured=run.info, cache=self.hilore_cache)
        except WorkerError as e:
            run.fail(e, self.progress)
            return
        run.info["timed_worker"] = _timed_info(reply)


def _timed_info(reply: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of a timed worker's set-up."""
    return {"compile_s": reply["compile_s"], "mmap_threshold_set": reply["info"]["mmap_threshold_set"],
            "warmup_s": [s["seconds"] for s in reply["warmup"]]}


def _as_chosen(options: MethodOptions, info: dict[str, Any]) -> MethodOptions:
    """``options`` for a method's second worker: the chunk size its first worker chose, not a new choice."""
    if "chunk_choice" not in info:
        return options
    return dataclasses.replace(options, step_chunks=(), chunk_tokens=info["chunk_choice"]["chunk_tokens"])


def _check_same_plan(name: str, *, timed: dict[str, Any], measured: dict[str, Any], cache: str) -> None:
    """Raise ``WorkerError`` unless a method's two workers run the same plan: else the
    peak measured would be another plan's than the one timed."""
    timed_digest, measured_digest = (info.get("plan", {}).get("decisions_digest") for info in (timed, measured))
    if timed_digest != measured_digest:
        raise WorkerError(f"{name}'s timed worker made another plan (decisions {timed_digest}) than its peak "
                          f"worker ({measured_digest}): was the plan cache {cache} not shared?")
