"""``hilore bench --memory-check``: predicted against measured whole-step peaks.

The memory model (``solver/memory.py``) decides what fits a ceiling, so it has
to hold on the shapes people train, not only on the bench's ``small``. For
one model and shape this runs the bench's GRPO step (``worker.actor_step``:
the compiled policy, token log-probs and the loss after it, backward) under
each method in a fresh process that measures peaks only (the CPU's VmHWM
with ``MALLOC_MMAP_THRESHOLD_``, or CUDA's allocator: ``measure.py``):

- ``store-all`` (Inductor's own partition), ``gc`` (compiled, the layers
  checkpointed as the model's trainer does: a Hugging Face model's own
  gradient checkpointing) and ``gc-eager`` (the same, not compiled);
- ``hilore`` as a user compiles it with nothing set: ``memory_budget`` 1.10x
  GC's *predicted* peak, the loss after the graph modelled from the logits'
  dtype (``solver.lossmodel``), not measured.

HiLoRe's plan also predicts store-all's and GC's peaks (the references of
``x-store`` and ``x-gc``), and GC's under eager autograd (``gc_eager_bytes``:
a tied weight's partials summed out of place, ``StepTerms.eager``), so every
row has a prediction from the same model. Each worker measures two peaks: the tensor peak (the CPU
allocator's, ``measure.allocator_peak``: what the model predicts, as
docs/fidelity.md holds every plan to) and VmHWM (the process's, which also
counts its heap and the buffers libraries such as oneDNN keep outside
torch's allocator; a process that planned and profiled read up to 51 MB
more than one that did not, at the same tensor peak). A row is within
tolerance when tensor / predicted is within ``TOLERANCE``; HiLoRe's row also
says whether its peak is under its ceiling, and its ratio to compiled GC's.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .launcher import PEAK_STEPS
from .methods import MethodOptions
from .process import WorkerError, WorkerProcess, worker_env
from .worker import WorkerConfig

#: The methods compared, in the order they run.
METHODS = ("store-all", "gc", "gc-eager", "hilore")

#: |measured / predicted - 1| a row may be off by.
TOLERANCE = 0.03

#: HiLoRe's zero-config ceiling (the backend's default).
ZERO_CONFIG_BUDGET = "1.10x-gc"

#: Which prediction of the plan each method is held to.
_PREDICTION = {"store-all": "store_bytes", "gc": "gc_bytes", "gc-eager": "gc_eager_bytes"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCheckConfig:
    """One model and shape; ``model`` as ``build_model`` takes it (an ``hf:`` reference included)."""

    model: str
    batch: int = 1
    seq_len: int = 512
    dtype: str = "float32"
    device: str = "cpu"
    methods: tuple[str, ...] = METHODS
    #: Steps after the compiling call before the peaks are measured.
    warmup: int = 1
    threads: int | None = None
    seed: int = 0
    #: Inductor's and hilore's caches; empty: fresh in a temporary folder.
    cache_dir: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"--memory-check runs {', '.join(METHODS)}; not {', '.join(unknown)}")


def run_memory_check(config: MemoryCheckConfig, progress: Callable[[str], None] = lambda _m: None
                     ) -> dict[str, Any]:
    """Run every method in its own peak-measuring process; the report (``format_table`` prints it)."""
    run_dir = Path(tempfile.mkdtemp(prefix="hilore-memory-check-"))
    cache = Path(config.cache_dir).expanduser() if config.cache_dir else run_dir / "cache"
    env = worker_env(cache / "inductor", peak=config.device == "cpu")
    options = MethodOptions(hilore_budget=ZERO_CONFIG_BUDGET, hilore_cache_dir=str(cache / "hilore"),
                            measure_loss=False)
    rows = []
    for method in config.methods:
        progress(f"{method}: compiling, warming up and measuring {PEAK_STEPS} peaks")
        worker_config = WorkerConfig(method=method, model=config.model, batch=config.batch, seq_len=config.seq_len,
                                     seed=config.seed, device=config.device, warmup=config.warmup, options=options,
                                     threads=config.threads, dtype=config.dtype)
        rows.append(_measure(worker_config, env, run_dir / f"{method}.log"))
        row = rows[-1]
        progress(f"{method}: {row['status']}" + (f", peak {row['measured_bytes'] / 2**20:.1f} MiB"
                                                  if row["status"] == "ok" else f" ({row.get('error')})"))
    return summarise(config, rows, str(run_dir))


def _measure(config: WorkerConfig, env: dict[str, str], log_path: Path) -> dict[str, Any]:
    """One method's row: its measured peak (the largest of ``PEAK_STEPS``), compile
    seconds, and for HiLoRe its plan's predictions; a failure is a row, not a raise."""
    row: dict[str, Any] = {"method": config.method, "status": "ok"}
    worker = WorkerProcess(config, env=env, log_path=log_path)
    try:
        setup = worker.request("setup")
        samples = worker.request("measure", steps=PEAK_STEPS)["samples"]
        tensor_peak = worker.request("tensor_peak")["tensor_peak_bytes"]
    except WorkerError as e:
        return {**row, "status": "failed", "error": str(e), "log": str(log_path)}
    finally:
        worker.close()
    peaks = [int(s["peak_bytes"]) for s in samples]
    info = setup["info"]
    row.update(measured_bytes=max(peaks), peaks=peaks, tensor_peak_bytes=tensor_peak,
               compile_s=round(setup["compile_s"], 1),
               dynamo_graphs=info.get("dynamo_graphs"), graph_breaks=info.get("graph_breaks"))
    plan = info.get("plan")
    if plan:
        row["plan"] = {k: plan[k] for k in ("budget", "budget_bytes", "gc_bytes", "store_bytes", "gc_eager_bytes")
                       if k in plan}
        row["predicted_bytes"] = info.get("predicted_peak_bytes")
        row["plan"]["counts"] = [r["counts"] for r in plan.get("records", [])][:1]
    return row


def summarise(config: MemoryCheckConfig, rows: list[dict[str, Any]], run_dir: str) -> dict[str, Any]:
    """Each row's prediction (from HiLoRe's plan) and its ratio; HiLoRe's ceiling checks."""
    plan = next((r["plan"] for r in rows if r["method"] == "hilore" and r.get("plan")), None)
    for row in rows:
        if row["method"] in _PREDICTION and plan is not None:
            row["predicted_bytes"] = plan.get(_PREDICTION[row["method"]])
        if row["status"] == "ok" and row.get("predicted_bytes"):
            ratio = row["tensor_peak_bytes"] / row["predicted_bytes"]
            row["tensor_over_predicted"] = round(ratio, 4)
            row["measured_over_predicted"] = round(row["measured_bytes"] / row["predicted_bytes"], 4)
            row["within_tolerance"] = abs(ratio - 1) <= TOLERANCE
    hilore = next((r for r in rows if r["method"] == "hilore" and r["status"] == "ok"), None)
    if hilore is not None and plan is not None:
        hilore["ceiling_bytes"] = plan["budget_bytes"]
        hilore["under_ceiling"] = hilore["tensor_peak_bytes"] <= plan["budget_bytes"]
        hilore["vmhwm_under_ceiling"] = hilore["measured_bytes"] <= plan["budget_bytes"]
        gc = next((r for r in rows if r["method"] == "gc" and r["status"] == "ok"), None)
        if gc is not None:
            hilore["over_measured_gc"] = round(hilore["tensor_peak_bytes"] / gc["tensor_peak_bytes"], 4)
    if plan is not None and plan["gc_bytes"] >= plan["store_bytes"]:
        note = ("GC saves nothing at this shape: its predicted peak is store-all's (the weights' gradients "
                "at the end of backward outweigh the activations), so every x-gc plan stores all")
    else:
        note = ""
    return {"config": dataclasses.asdict(config), "tolerance": TOLERANCE, "rows": rows, "note": note,
            "run_dir": run_dir}


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table: one row per method."""
    c = report["config"]
    lines = [f"memory check: {c['model']}, batch {c['batch']} x {c['seq_len']} tokens, {c['dtype']} on {c['device']}",
             "tensor: the allocator's peak, what the model predicts; VmHWM: the process's, its heap and "
             "libraries' buffers included",
             f"{'method':<10} {'predicted':>12} {'tensor':>12} {'ratio':>6} {'VmHWM':>12} {'ratio':>6}  "
             f"within {report['tolerance']:.0%}  notes",
             "-" * 100]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['method']:<10} failed: {r.get('error', '')[:60]}")
            continue
        predicted = r.get("predicted_bytes")
        notes = []
        if "ceiling_bytes" in r:
            notes.append(f"ceiling {_mib(r['ceiling_bytes'])} ({'held' if r['under_ceiling'] else 'EXCEEDED'}; "
                         f"VmHWM {'under' if r['vmhwm_under_ceiling'] else 'over'})")
        if "over_measured_gc" in r:
            notes.append(f"{r['over_measured_gc']:.3f}x measured GC")
        lines.append(f"{r['method']:<10} {_mib(predicted) if predicted else '-':>12} "
                     f"{_mib(r['tensor_peak_bytes']):>12} {r.get('tensor_over_predicted', float('nan')):>6.3f} "
                     f"{_mib(r['measured_bytes']):>12} {r.get('measured_over_predicted', float('nan')):>6.3f}  "
                     f"{'yes' if r.get('within_tolerance') else 'no':<9}  {'; '.join(notes)}")
    if report.get("note"):
        lines.append(f"note: {report['note']}")
    return "\n".join(lines)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
