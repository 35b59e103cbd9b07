"""The driver: one worker process per method, set up in turn, then measured in alternating rounds.

Each method runs in its own process (``worker.py``), started by
``launcher.Launcher``. Only one worker runs at a time: setup (compile,
warm-up, gradient of the fixed batch, the peak) goes method by method, then
the live workers are measured in alternating rounds (``rounds.py``), and
every gradient is compared with store-all's.

Caches: unless ``cache_dir`` is given, the workers of one run share a fresh
temporary Inductor cache (``TORCHINDUCTOR_CACHE_DIR``) and hilore cache, so
runs are independent of each other but methods share compiled kernels and
``uniform-int8`` reuses the trace ``hilore`` made. With ``cache_dir`` they
persist there across runs (faster, for repeated runs of one configuration).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..codecs import codec_names
from ..models import DTYPES
from .launcher import Launcher
from .methods import DEFAULT_METHODS, METHODS
from .rounds import MethodRun, Progress, close_workers, compare_grads, measure_rounds, warm_peak, warm_seconds
from .process import check_heap
from .peers import PT_BUDGETS, SEARCHED, hidden_state_mb, knob_name, probe_grid
from .search import BudgetSearch, search_budget


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
    #: Timed workers' heap on CPU (``process.HEAPS``): ``default`` as a trainer
    #: runs, or ``fixed`` (``process.FIXED_HEAP_ENV``) for close comparisons.
    heap: str = "default"
    #: HiLoRe's memory budget.
    hilore_budget: str = "1.10x-gc"
    #: Codecs HiLoRe's plans may use (empty: store and recompute only, exact gradients).
    hilore_codecs: tuple[str, ...] = ("bf16", "int8")
    #: HiLoRe's error budget (``"cos>=0.999"``, a squared relative error); None: the default.
    hilore_risk_budget: str | None = None
    #: The memory-speed frontier (``frontier.py``): memory ceilings as multiples
    #: of GC's measured peak, each budgeted method planned or searched at each;
    #: empty: one run at ``hilore_budget``.
    ceilings: tuple[float, ...] = ()
    #: ``activation_memory_budget`` of pt-budget and its variants; None: searched to match HiLoRe's peak.
    pt_budget: float | None = None
    #: Budgets the pt-budget search tries (``search.grid``), one process (compile) each.
    budget_probes: int = 4
    #: Persistent cache directory; None: a fresh temporary one per run.
    cache_dir: str | None = None
    #: The frontier's plans made from a trace calibrated per unit (``calibrate.py``),
    #: measured gradient sensitivities instead of the proxy.
    calibrate: bool = False
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
        check_heap(self.heap)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.pt_budget is not None and not 0.0 <= self.pt_budget <= 1.0:
            raise ValueError(f"pt_budget must be in [0, 1], got {self.pt_budget}")
        if any(c < 0 for c in self.step_chunks) or (0 in self.step_chunks and len(self.step_chunks) > 1):
            raise ValueError(f"step_chunks must be positive token counts, or (0,) for the defaults; "
                             f"got {self.step_chunks}")
        if any(not 0 < c < 100 for c in self.ceilings) or len(set(self.ceilings)) != len(self.ceilings):
            raise ValueError(f"ceilings must be distinct positive multiples of GC's peak, got {self.ceilings}")
        if self.calibrate and not self.ceilings:
            raise ValueError("calibrate applies to the frontier: give ceilings too (--ceilings)")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRun:
    """Everything the report needs: configuration, per-method runs, the budget search."""

    config: BenchConfig
    device: str
    runs: tuple[MethodRun, ...]
    budget_search: BudgetSearch | None
    #: Kept when a method failed (its log is there), else None (deleted).
    run_dir: str | None


def budget_target(runs: dict[str, MethodRun], progress: Progress) -> float | None:
    """The peak pt-budget should match: HiLoRe's, else 1.10 x GC's, else None."""
    hilore, gc = warm_peak(runs.get("hilore")), warm_peak(runs.get("gc"))
    if hilore is not None:
        return hilore
    if gc is not None:
        progress("pt-budget: no HiLoRe peak to match; aiming at 1.10 x GC's peak instead")
        return 1.10 * gc
    return None


def _searched(launcher: Launcher, runs: dict[str, MethodRun], method: str,
              progress: Progress) -> tuple[MethodRun, BudgetSearch | None]:
    """A searched method (``peers.SEARCHED``): its knob searched to HiLoRe's peak, or the fixed
    ``pt_budget`` for the memory-budget ones."""
    config = launcher.config
    if config.pt_budget is not None and method in PT_BUDGETS:
        return launcher.start(method, budget=config.pt_budget), None
    knobs = probe_grid(method, config.budget_probes,
                       hidden_state_mb(config.model, config.batch, config.seq_len, config.dtype))
    target = budget_target(runs, progress)
    if target is None:
        knob = 0.5 if method in PT_BUDGETS else knobs[len(knobs) // 2]
        progress(f"{method}: no HiLoRe or GC peak to match; using {knob_name(method)} {knob:g}")
        return launcher.start(method, budget=knob), None

    def probe(knob: float) -> MethodRun:
        return launcher.start(method, tag=f"@{knob:g}", budget=knob)

    return search_budget(probe, warm_peak, warm_seconds, target_bytes=target, probes=config.budget_probes,
                         progress=progress, budgets=knobs, method=method)


def new_launcher(config: BenchConfig, progress: Progress, prefix: str = "hilore-bench-") -> Launcher:
    """A launcher for one run: the device resolved, a fresh folder for its workers' logs (and caches)."""
    return Launcher(config, resolve_device(config.device), Path(tempfile.mkdtemp(prefix=prefix)), progress)


def run_bench(config: BenchConfig, progress: Progress) -> BenchRun:
    """Set up every method, search pt-budget's budget, measure in rounds; see the module docstring."""
    launcher = new_launcher(config, progress)
    device, run_dir = launcher.device, launcher.run_dir
    progress(f"{config.model}, batch {config.batch}, seq_len {config.seq_len}, {config.dtype} on {device}; "
             f"workers' logs and caches in {run_dir}")
    runs: dict[str, MethodRun] = {}
    search = None
    try:
        for method in (m for m in METHODS if m in config.methods):
            if method in SEARCHED:
                runs[method], found = _searched(launcher, runs, method, progress)
                if method == "pt-budget":
                    search = found
                elif found is not None:
                    runs[method].info["budget_search"] = found.to_json()
            else:
                runs[method] = launcher.start(method)
        predict_baselines(runs)
        measure_all(launcher, runs, progress)
    finally:
        close_workers(runs.values())
    compare_grads(runs)
    failed = any(run.status != "ok" for run in runs.values())
    if not failed:
        shutil.rmtree(run_dir, ignore_errors=True)  # only logs, gradients and a temporary cache
    return BenchRun(config=config, device=device, runs=tuple(runs.values()), budget_search=search,
                    run_dir=str(run_dir) if failed else None)


def measure_all(launcher: Launcher, runs: dict[str, MethodRun], progress: Progress) -> None:
    """Start every set-up run's timed worker, then measure the live ones in alternating rounds."""
    for run in runs.values():
        launcher.time(run)
    measure_rounds(list(runs.values()), launcher.config, progress, peaks=not launcher.peaks_apart)


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
