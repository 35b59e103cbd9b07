"""The driver: one worker process per method, set up in turn, then measured in alternating rounds.

Each method runs in its own process (``worker.py``), driven over a pipe
(``process.py``). Only one worker runs at a time: setup (compile, warm-up,
gradient of the fixed batch, the peak) goes method by method, then every
round asks each live worker, in an order rotated by one per round, for
``steps_per_round`` measured steps. Alternating spreads slow phases of a
shared machine over all methods instead of one. On CPU the peak and the
time come from two workers of the method, one with
``MALLOC_MMAP_THRESHOLD_=65536`` (VmHWM needs it) and one on the default
allocator (``Launcher``).

Caches: unless ``cache_dir`` is given, the workers of one run share a fresh
temporary Inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and hilore cache, so
runs are independent of each other but methods share compiled kernels and
``uniform-int8`` reuses the trace ``hilore`` made. With ``cache_dir`` they
persist there across runs (faster, for repeated runs of one configuration).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..codecs import codec_names
from ..models import DTYPES
from .measure import StepSample, gradient_fidelity
from .methods import DEFAULT_METHODS, HILORE_BACKENDS, METHODS, STEP_METHODS, MethodOptions
from .process import WorkerError, WorkerProcess, worker_env
from .search import BudgetSearch, search_budget
from .worker import WorkerConfig

Progress = Callable[[str], None]



@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What ``hilore bench`` runs. Defaults: the paper's setting (2K-token responses) scaled to a CPU."""

    #: Built-in policy (``hilore_compiler.models``).
    model: str = "small"
    batch: int = 2
    #: Tokens per sequence (prompt + response); all but the first are response tokens.
    seq_len: int = 2048
    #: Methods to run (see ``methods.METHODS``); set up in the order of METHODS.
    methods: tuple[str, ...] = DEFAULT_METHODS
    #: Rounds of alternation; each gives one paired speed ratio per method
    #: (report.py), so 8 rounds put 7 degrees of freedom in its t-interval.
    repeats: int = 8
    #: Measured steps per method per round.
    steps_per_round: int = 2
    #: Measured steps right after compiling, not counted in the rounds
    #: (their peaks steer the pt-budget search).
    warmup: int = 2
    #: Rounds run, alternating, after every worker is set up and before the
    #: counted ones; their steps are kept apart (``MethodRun.settle``). A
    #: worker set up first waits through every later set-up, and its first
    #: steps after that ran slow: GC's first step of round 1 took 4.03 s
    #: against 1.62 s from round 2 on, which lifted HiLoRe's paired ratio
    #: over GC from 1.205 to 1.251 in the run of commit 5f23749.
    settle_rounds: int = 1
    #: ``cpu``, ``cuda`` or ``auto`` (cuda when available).
    device: str = "auto"
    #: Seeds the weights and the batch.
    seed: int = 0
    #: Threads per worker (None: torch's default).
    threads: int | None = None
    #: HiLoRe's memory budget.
    hilore_budget: str = "1.10x-gc"
    #: Codecs HiLoRe's plans may use (empty: store and recompute only, exact gradients).
    hilore_codecs: tuple[str, ...] = ("bf16", "int8")
    #: pt-budget's ``activation_memory_budget``; None: searched to match HiLoRe's peak.
    pt_budget: float | None = None
    #: Budgets the pt-budget search tries (``search.grid``), one process (compile) each.
    budget_probes: int = 4
    #: Persistent cache directory; None: a fresh temporary one per run.
    cache_dir: str | None = None
    #: Parameter dtype of the policy (``DTYPES``); log-probs and loss stay fp32.
    dtype: str = "float32"
    #: ``hilore-step``'s candidate chunk sizes (``MethodOptions.step_chunks``);
    #: empty: the same chunks as ``gc-chunked``; ``(0,)``: the default candidates.
    step_chunks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown or no methods {unknown}; choose from {', '.join(METHODS)}")
        for name in ("batch", "repeats", "steps_per_round", "budget_probes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2 or self.warmup < 0 or self.settle_rounds < 0:
            raise ValueError("seq_len must be >= 2, warmup >= 0 and settle_rounds >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.pt_budget is not None and not 0.0 <= self.pt_budget <= 1.0:
            raise ValueError(f"pt_budget must be in [0, 1], got {self.pt_budget}")
        if any(c < 0 for c in self.step_chunks) or (0 in self.step_chunks and len(self.step_chunks) > 1):
            raise ValueError(f"step_chunks must be positive token counts, or (0,) for the defaults; "
                             f"got {self.step_chunks}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        unknown_codecs = [c for c in self.hilore_codecs if c not in codec_names()]
        if unknown_codecs:
            raise ValueError(f"unknown codec(s) {unknown_codecs}; choose from {', '.join(codec_names())} "
                             "or none")


#: ``--quick``: the whole pipeline on the tiny policy in a few minutes of compiling.
QUICK = {"model": "tiny", "seq_len": 128, "repeats": 3, "steps_per_round": 2, "warmup": 1,
         "budget_probes": 2}


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` if available else ``cpu``; others unchanged, once checked.

    Checked here, before any worker starts, so that ``--device cuda`` without
    a GPU fails in one line instead of once per method inside the workers.
    """
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise ValueError(f"--device cuda, but torch sees no CUDA device ({build}): run on a machine "
                         "with a GPU and a CUDA build of torch, or use --device cpu")
    return device


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
        progress(f"{self.method}: FAILED: {str(error).splitlines()[0]}")
        for worker in (self.worker, self.timed_worker):
            if worker is not None:
                worker.close()
        self.worker = self.timed_worker = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRun:
    """Everything the report needs: configuration, per-method runs, the budget search."""

    config: BenchConfig
    device: str
    runs: tuple[MethodRun, ...]
    budget_search: BudgetSearch | None
    #: Kept when a method failed (its log is there), else None (deleted).
    run_dir: str | None


#: Steps whose peaks a CPU peak worker measures after its warm-up (the
#: peak is the same step after step, DESIGN.md "Measuring"; three show it).
PEAK_STEPS = 3

#: The GC method whose measured peak each HiLoRe method's ``x-gc`` budget
#: refers to: the one that runs the same step (eager or compiled loss).
REFERENCE_GC = {"hilore": "gc", "hilore-blind": "gc", "hilore-step": "gc-chunked"}


class Launcher:
    """Starts and sets up workers that share one run's configuration and caches.

    On CPU every method has two workers, one after the other. ``start``'s
    measures the peak: it runs with ``MMAP_THRESHOLD_ENV``, which VmHWM needs
    (measure.py) and which slows every step by page faults (store-all's most:
    25% on the actor bench's microbatch, bench/overhead.py), so it measures
    ``PEAK_STEPS`` peaks and exits. ``time``'s runs the rounds on the default
    allocator, as a trainer does, compiling from the shared caches. A method
    that plans sets up its timed worker first instead, so that its peak worker
    too compiles from the caches (``plans_first``). On CUDA one worker does
    both: ``max_memory_allocated`` needs no allocator setting.
    """

    def __init__(self, config: BenchConfig, device: str, run_dir: Path, progress: Progress) -> None:
        self.config, self.device, self.run_dir, self.progress = config, device, run_dir, progress
        cache = Path(config.cache_dir).expanduser() if config.cache_dir else run_dir / "cache"
        self.hilore_cache = str(cache / "hilore")
        self.env = worker_env(cache / "inductor")
        #: Whether peaks are measured by workers of their own (CPU, see above).
        self.peaks_apart = device == "cpu"
        self.peak_env = worker_env(cache / "inductor", peak=True) if self.peaks_apart else self.env
        #: Measured peaks of the GC methods set up so far: the ceilings the
        #: HiLoRe methods' ``x-gc`` budgets are multiples of (``REFERENCE_GC``),
        #: so that they plan to the same measured ceiling the report holds
        #: every method to.
        self.gc_peaks: dict[str, int] = {}

    def start(self, method: str, tag: str = "", budget: float | None = None) -> MethodRun:
        """Spawn ``method``'s worker, compile, warm it up and measure its peak (``run.peaks``);
        a failure is recorded, not raised. On CPU the worker exits after its peaks:
        ``time`` starts the one the rounds use, except for a method that plans
        (``plans_first``), whose timed worker is set up here, before its peak worker."""
        name = method + tag
        grad_path = str(self.run_dir / f"grad-{name}.pt")
        options = MethodOptions(hilore_budget=self.config.hilore_budget, hilore_codecs=self.config.hilore_codecs,
                                hilore_cache_dir=self.hilore_cache, activation_memory_budget=budget,
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
            return run
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

    def _start_timed(self, run: MethodRun, config: WorkerConfig) -> None:
        """Set up ``run``'s timed worker (default allocator) first; it compiles, plans and
        writes the gradient, and stays alive for the rounds (``run.timed_worker``)."""
        name = run.name or run.method
        run.timed_worker = WorkerProcess(config, env=self.env, log_path=self.run_dir / f"{name}-timed.log")
        reply = run.timed_worker.request("setup")
        run.compile_s, run.info = reply["compile_s"], reply["info"]
        run.info["timed_worker"] = _timed_info(reply)

    def time(self, run: MethodRun) -> None:
        """Start the worker ``run``'s rounds are timed in (CPU: on the default allocator,
        compiled from the caches ``start``'s worker filled); a failure is recorded."""
        if run.status != "ok" or run.worker is not None:
            return  # failed, or set up already: CUDA's one worker, or a method that plans first
        config = dataclasses.replace(run.worker_config, grad_path=None,
                                     options=_as_chosen(run.worker_config.options, run.info))
        name = run.name or run.method
        self.progress(f"{name}: starting the worker the rounds time (default allocator)")
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


def budget_target(runs: dict[str, MethodRun], progress: Progress) -> float | None:
    """The peak pt-budget should match: HiLoRe's, else 1.10 x GC's, else None."""
    hilore, gc = warm_peak(runs.get("hilore")), warm_peak(runs.get("gc"))
    if hilore is not None:
        return hilore
    if gc is not None:
        progress("pt-budget: no HiLoRe peak to match; aiming at 1.10 x GC's peak instead")
        return 1.10 * gc
    return None


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
        for run in live[shift:] + live[:shift]:
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
        done = ", ".join(f"{run.method} {describe(run.settle if r < 0 else run.samples, peak=peaks)}"
                         for run in live if run.worker)
        progress(f"{which}: {done}")


def _pt_budget(launcher: Launcher, runs: dict[str, MethodRun],
               progress: Progress) -> tuple[MethodRun, BudgetSearch | None]:
    config = launcher.config
    if config.pt_budget is not None:
        return launcher.start("pt-budget", budget=config.pt_budget), None
    target = budget_target(runs, progress)
    if target is None:
        progress("pt-budget: no HiLoRe or GC peak to match; using activation_memory_budget 0.5")
        return launcher.start("pt-budget", budget=0.5), None

    def probe(budget: float) -> MethodRun:
        return launcher.start("pt-budget", tag=f"@{budget:g}", budget=budget)

    return search_budget(probe, warm_peak, warm_seconds, target_bytes=target, probes=config.budget_probes,
                         progress=progress)


def run_bench(config: BenchConfig, progress: Progress) -> BenchRun:
    """Set up every method, search pt-budget's budget, measure in rounds; see the module docstring."""
    device = resolve_device(config.device)
    run_dir = Path(tempfile.mkdtemp(prefix="hilore-bench-"))
    launcher = Launcher(config, device, run_dir, progress)
    progress(f"{config.model}, batch {config.batch}, seq_len {config.seq_len}, {config.dtype} on {device}; "
             f"workers' logs and caches in {run_dir}")
    runs: dict[str, MethodRun] = {}
    search = None
    try:
        for method in (m for m in METHODS if m in config.methods):
            if method == "pt-budget":
                runs[method], search = _pt_budget(launcher, runs, progress)
            else:
                runs[method] = launcher.start(method)
            if method in REFERENCE_GC.values() and warm_peak(runs[method]) is not None:
                launcher.gc_peaks[method] = int(warm_peak(runs[method]))
        predict_baselines(runs)
        for run in runs.values():
            launcher.time(run)
        measure_rounds(list(runs.values()), config, progress, peaks=not launcher.peaks_apart)
    finally:
        close_workers(runs.values())
    compare_grads(runs)
    failed = any(run.status != "ok" for run in runs.values())
    if not failed:
        shutil.rmtree(run_dir, ignore_errors=True)  # only logs, gradients and a temporary cache
    return BenchRun(config=config, device=device, runs=tuple(runs.values()), budget_search=search,
                    run_dir=str(run_dir) if failed else None)


def predict_baselines(runs: dict[str, MethodRun]) -> None:
    """GC's and store-all's predicted peaks, from the memory model of HiLoRe's plan.

    The hilore worker's plan predicts every plan's step peak, its own and the
    two references of its budgets, with the same model (``solver/memory.py``);
    the report sets them beside the measured peaks.
    """
    for source in ("hilore", "hilore-blind", "uniform-int8"):
        run = runs.get(source)
        plan = run.info.get("plan", {}) if run is not None and run.status == "ok" else {}
        if "gc_bytes" in plan:
            break
    else:
        return
    for method, key in (("gc", "gc_bytes"), ("store-all", "store_bytes")):
        if method in runs and runs[method].status == "ok":
            runs[method].info["predicted_peak_bytes"] = plan[key]


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
