"""``hilore bench --lengths 256,512,1024,2048``: the step at several sequence lengths, in one run.

GRPO batches change length every step. This bench runs each method
(``lengths_worker.LENGTH_METHODS``) in a process of its own over a batch at
every length: GC, store-all, HiLoRe with one plan over the range
(``hilore-range``), with length buckets (``hilore-lengths``) and with a
static plan per length (``hilore-static``, the upper bound); ``hilore``
(zero config, plans over the lengths seen) by name. Set-up runs
one step per length in turn, so the seconds it takes are the run's compile
time, and dynamo compiles as it does for a user (static, then dynamic).
Then rounds alternate the methods (their order rotating each round); each
round measures every length, so every (method, length) gets a speed ratio
to GC paired by round (``paired.py``). Peaks are the allocator's peak of one
step per length after the rounds (``measure.allocator_peak``, the same
count for every method), against 1.10x GC's at the same length; gradients
are compared with store-all's per length.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .lengths_worker import DEFAULT_LENGTH_METHODS, LENGTH_METHODS, LengthsWorkerConfig
from .measure import gradient_fidelity
from .paired import format_paired, geometric_interval
from .process import WorkerError, WorkerProcess, check_heap, worker_env

Progress = Callable[[str], None]
#: The ceiling the report holds every method to, as a multiple of GC's peak at the same length.
CEILING_X_GC = 1.10


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthsBenchConfig:
    """What ``hilore bench --lengths`` runs."""

    model: str = "small"
    batch: int = 2
    lengths: tuple[int, ...] = (256, 512, 1024, 2048)
    methods: tuple[str, ...] = DEFAULT_LENGTH_METHODS
    #: Rounds of alternation, each measuring every method at every length.
    repeats: int = 6
    steps_per_round: int = 1
    hilore_budget: str = "1.10x-gc"
    hilore_codecs: tuple[str, ...] = ("bf16", "int8")
    seed: int = 0
    threads: int | None = None
    cache_dir: str | None = None
    #: Timed workers' heap (``runner.BenchConfig.heap``).
    heap: str = "default"

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in LENGTH_METHODS]
        if unknown or "gc" not in self.methods:
            raise ValueError(f"--lengths runs {', '.join(LENGTH_METHODS)} (gc always, the reference); "
                             f"unknown: {unknown}")
        if len(self.lengths) < 2 or min(self.lengths) < 2 or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"--lengths needs two or more distinct lengths >= 2, got {self.lengths}")
        check_heap(self.heap)
        if self.repeats < 1 or self.steps_per_round < 1:
            raise ValueError("repeats and steps_per_round must be >= 1")


class LengthsWorkerProcess(WorkerProcess):
    """A ``--lengths`` worker in a process of its own (``lengths_worker``)."""

    MODULE = "hilore_compiler.bench.lengths_worker"


def run_lengths_bench(config: LengthsBenchConfig, progress: Progress) -> dict[str, Any]:
    """Set up every method, measure in rounds, read peaks and gradients; the result record."""
    run_dir = Path(tempfile.mkdtemp(prefix="hilore-lengths-"))
    cache = Path(config.cache_dir).expanduser() if config.cache_dir else run_dir / "cache"
    env = worker_env(cache / "inductor", heap=config.heap)
    hilore = {"memory_budget": config.hilore_budget, "codecs": list(config.hilore_codecs),
              "cache_dir": str(cache / "hilore"), "verbose": True}
    workers: dict[str, LengthsWorkerProcess] = {}
    methods: dict[str, dict[str, Any]] = {}
    progress(f"{config.model}, batch {config.batch}, lengths {list(config.lengths)}; logs in {run_dir}")
    try:
        for method in config.methods:
            worker_config = LengthsWorkerConfig(method=method, model=config.model, batch=config.batch,
                                                lengths=config.lengths, seed=config.seed, hilore=hilore,
                                                grad_dir=str(run_dir), threads=config.threads)
            workers[method] = LengthsWorkerProcess(asdict(worker_config), env=env, log_path=run_dir / f"{method}.log")
            progress(f"{method}: compiling at each length")
            try:
                reply = workers[method].request("setup")
            except WorkerError as error:
                methods[method] = {"status": "failed", "error": str(error)}
                workers.pop(method).close()
                progress(f"{method}: FAILED ({error})")
                continue
            methods[method] = {"status": "ok", "setup_s": reply["compile_s"], "info": reply["info"], "samples": []}
            progress(f"{method}: set up in {reply['compile_s']:.1f} s")
        _rounds(workers, methods, config, progress)
        for method, worker in workers.items():
            methods[method]["tensor_peak_bytes"] = worker.request("tensor_peak")["tensor_peak_bytes"]
    finally:
        for worker in workers.values():
            worker.close()
    _fidelity(methods, config, run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"config": asdict(config), "torch": torch.__version__, "methods": methods,
            "lengths": summarise(methods, config)}


def _rounds(workers: dict[str, LengthsWorkerProcess], methods: dict[str, dict[str, Any]],
            config: LengthsBenchConfig, progress: Progress) -> None:
    """One settling round (not counted), then ``repeats`` rounds in a rotating method order."""
    names = list(workers)
    for r in range(-1, config.repeats):
        order = names[r % len(names):] + names[:r % len(names)] if r >= 0 else names
        for method in order:
            samples = workers[method].request("measure", steps=config.steps_per_round)["samples"]
            if r >= 0:
                methods[method]["samples"] += [{**s, "round": r} for s in samples]
        if r >= 0:
            progress(f"round {r + 1}/{config.repeats} done")


def _fidelity(methods: dict[str, dict[str, Any]], config: LengthsBenchConfig, run_dir: Path) -> None:
    """Each method's gradient at each length against store-all's (or GC's without it)."""
    reference = "store-all" if methods.get("store-all", {}).get("status") == "ok" else "gc"
    for method, record in methods.items():
        if record["status"] != "ok":
            continue
        record["fidelity"] = {}
        for n in config.lengths:
            exact = torch.load(run_dir / f"{reference}-{n}.pt")
            cosine, rel_l2 = gradient_fidelity(torch.load(run_dir / f"{method}-{n}.pt"), exact)
            record["fidelity"][str(n)] = {"cosine": cosine, "rel_l2": rel_l2, "reference": reference}


def _round_speeds(samples: list[dict[str, Any]], length: int, tokens: int) -> dict[int, float]:
    by_round: dict[int, list[float]] = {}
    for s in samples:
        if s["length"] == length:
            by_round.setdefault(s["round"], []).append(tokens / s["seconds"])
    return {r: statistics.median(v) for r, v in by_round.items()}


def summarise(methods: dict[str, dict[str, Any]], config: LengthsBenchConfig) -> dict[str, list[dict[str, Any]]]:
    """Per length, one row per method: tokens/s, ratio to GC paired by round, peak, fidelity."""
    out: dict[str, list[dict[str, Any]]] = {}
    for n in config.lengths:
        tokens = config.batch * n
        gc = methods["gc"]
        gc_speeds = _round_speeds(gc.get("samples", []), n, tokens)
        gc_peak = gc.get("tensor_peak_bytes", {}).get(str(n))
        rows = []
        for method, record in methods.items():
            if record["status"] != "ok":
                rows.append({"method": method, "status": "failed", "error": record["error"]})
                continue
            speeds = _round_speeds(record["samples"], n, tokens)
            ratio = geometric_interval([speeds[r] / gc_speeds[r] for r in sorted(speeds) if r in gc_speeds])
            peak = record["tensor_peak_bytes"][str(n)]
            rows.append({
                "method": method, "status": "ok", "tokens_per_s": statistics.median(speeds.values()),
                "x_gc": None if ratio is None else asdict(ratio), "peak_bytes": peak,
                "x_gc_peak": peak / gc_peak if gc_peak else None,
                "fits": bool(gc_peak) and peak <= CEILING_X_GC * gc_peak,
                "first_step_s": record["info"]["first_step_s"][str(n)],
                **record.get("fidelity", {}).get(str(n), {}),
            })
        out[str(n)] = rows
    return out


def render_lengths(result: dict[str, Any]) -> str:
    """The result as Markdown: a table per length, then each method's set-up (compile) time."""
    lines = []
    for n, rows in result["lengths"].items():
        lines += [f"### T = {n}", "",
                  "| method | tokens/s | x GC [95% CI] | peak MB | x GC peak | fits 1.10x GC | grad cosine | "
                  "first step s |", "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            if row["status"] != "ok":
                lines.append(f"| {row['method']} | failed: {row['error'][:80]} | | | | | | |")
                continue
            lines.append(
                f"| {row['method']} | {row['tokens_per_s']:.0f} | {format_paired(row['x_gc'])} | "
                f"{row['peak_bytes'] / 1e6:.1f} | {row['x_gc_peak']:.3f} | {'yes' if row['fits'] else 'no'} | "
                f"{row.get('cosine', float('nan')):.6f} | {row['first_step_s']:.1f} |")
        lines.append("")
    lines += ["| method | set-up over all lengths (s) | dynamo graphs | hilore graphs planned / variants / "
              "re-solves | length buckets |", "|---|---|---|---|---|"]
    for method, record in result["methods"].items():
        if record["status"] != "ok":
            continue
        info, h = record["info"], record["info"].get("hilore")
        planned = "-" if h is None else f"{h['planned']}/{h['graphs']} / {h['variants']} / {h['resolves']}"
        buckets = "-" if h is None else ", ".join(f"{lo}-{hi}" for lo, hi in h["length_buckets"])
        lines.append(f"| {method} | {record['setup_s']:.1f} | {info['dynamo_graphs']} | {planned} | {buckets} |")
    return "\n".join(lines)
