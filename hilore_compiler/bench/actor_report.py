"""The actor-update bench's numbers: a table, ratios to GC and the plans' predicted error.

Throughput is the batch's tokens (B x T, skipped samples included) per second
of the whole update, the median over the measured updates of all rounds;
peak memory is the median per-update peak (``measure.py``'s definition: the
process's VmHWM), measured in a process of its own after the rounds
(``actor.rss_peaks``); the tensor peak is one update's by the allocator, what the
plans' memory model predicts (``predicted_peak_bytes``: the plan's largest
bucket).
Speed ratios to GC and to the exposure-blind plan are paired by round with
a 95% interval (``paired.py``): the methods of one round ran back to back.
A method that skips zero-exposure samples is paired with GC and the blind
plan skipping them too (``gc-skip``, ``hilore-blind-skip``): the skip is the
update loop's and open to every method, so it is no part of a plan's lead.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict
from typing import Any

from .actor import LABELS, PLAN_OF, SKIPPING, ActorBenchConfig
from .host import environment
from .paired import format_paired, paired_ratio
from .report import Spread
from .rounds import MethodRun

ACTOR_SCHEMA = "hilore.bench-actor/v1"


def _paired(run: MethodRun, reference: MethodRun | None) -> dict[str, Any] | None:
    """``run``'s speed over ``reference``'s, paired by round; None where either has no rounds."""
    tokens = run.info.get("tokens")
    if reference is None or reference is run or not tokens or not run.samples or not reference.samples:
        return None
    ratio = paired_ratio(run.samples, reference.samples, tokens)
    return None if ratio is None else asdict(ratio)


def _peak(run: MethodRun) -> Spread | None:
    """Per-update VmHWM peaks from the method's peak process; None where it failed
    (the timed rounds run on the default allocator, where VmHWM measures no peak)."""
    return Spread.of([float(p) for p in run.peaks]) if run.peaks else None


def references(method: str) -> dict[str, str]:
    """The methods ``method``'s speed is paired with: GC and the blind plan, run the same
    way (with the zero skip where ``method`` skips)."""
    if method in SKIPPING:
        return {"gc": "gc-skip", "blind": "hilore-blind-skip"}
    return {"gc": "gc", "blind": "hilore-blind"}


def _row(run: MethodRun, runs: dict[str, MethodRun], plans: dict[str, Any]) -> dict[str, Any]:
    """One method's figures; peaks and the unpaired ``speed_vs_gc`` are against plain GC."""
    tokens = run.info.get("tokens")
    gc, paired_with = runs.get("gc"), references(run.method)
    rate = Spread.of([tokens / s.seconds for s in run.samples]) if run.samples and tokens else None
    peak = _peak(run)
    gc_rate = gc_peak = None
    if gc is not None and gc.samples and gc.info.get("tokens"):
        gc_rate = Spread.of([gc.info["tokens"] / s.seconds for s in gc.samples]).median
        gc_peaks = _peak(gc)
        gc_peak = None if gc_peaks is None else gc_peaks.median
    plan = PLAN_OF.get(run.method)
    return {
        "method": run.method, "label": LABELS[run.method], "status": run.status, "error": run.error,
        "tokens_per_s": None if rate is None else asdict(rate),
        "peak_bytes": None if peak is None else asdict(peak),
        "speed_vs_gc": None if rate is None or not gc_rate else rate.median / gc_rate,
        "paired_vs_gc": _paired(run, runs.get(paired_with["gc"])),
        "paired_vs_blind": _paired(run, runs.get(paired_with["blind"])), "paired_with": paired_with,
        # What the skip alone is worth: the same method without it.
        "paired_vs_no_skip": _paired(run, runs.get(SKIPPING[run.method])) if run.method in SKIPPING else None,
        "peak_vs_gc": None if peak is None or not gc_peak else peak.median / gc_peak,
        "cosine": None if run.fidelity is None else run.fidelity["cosine"],
        "rel_l2": None if run.fidelity is None else run.fidelity["rel_l2"],
        "predicted_rel_l2": None if plan is None else plans["info"][plan]["predicted_error"],
        "tensor_peak_bytes": run.info.get("tensor_peak_bytes"),
        "predicted_peak_bytes": None if plan is None else max(
            b["memory_bytes"] for b in plans["info"][plan]["buckets"].values()),
        "compile_s": run.compile_s, "info": run.info,
        # Per-round updates, so that any two methods can be paired later (paired.paired_ratio).
        "samples": [asdict(x) for x in run.samples], "settle": [asdict(x) for x in run.settle],
    }


def summarise(config: ActorBenchConfig, runs: dict[str, MethodRun], plans: dict[str, Any]) -> dict[str, Any]:
    """The JSON payload: configuration, machine, plans, one row per method."""
    return {
        "schema": ACTOR_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(config), "methods": list(config.methods)},
        "machine": environment(config.device),
        "plans": {"info": plans["info"], "mix": plans["mix"]},
        "rows": [_row(r, runs, plans) for r in runs.values()],
    }


def format_table(report: dict[str, Any]) -> str:
    """A markdown table of the rows, as docs/benchmarks.md shows it; the ratios of a skipping
    row are to GC and the blind plan with the zero skip (``references``)."""
    head = ("| method | tokens/s (median) | x GC, same skip [95% CI] | x blind, same skip [95% CI] "
            "| x without skip [95% CI] | peak MB | x GC peak "
            "| tensor MB (measured / predicted) | grad cosine | rel. L2 (measured / predicted) | skipped "
            "| microbatches |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | failed: {str(r['error']).splitlines()[0][:60]} " + "|" * (columns - 1) + " ")
            continue

        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        def megabytes(value: float | None) -> str:
            return num(value and value / 1e6, ".1f")

        predicted = num(r["predicted_rel_l2"], ".1e")
        lines.append(
            f"| {r['label']} | {num(r['tokens_per_s'] and r['tokens_per_s']['median'], '.0f')} | "
            f"{format_paired(r.get('paired_vs_gc'))} | {format_paired(r.get('paired_vs_blind'))} | "
            f"{format_paired(r.get('paired_vs_no_skip'))} | "
            f"{num(r['peak_bytes'] and r['peak_bytes']['median'] / 1e6, '.1f')} | "
            f"{num(r['peak_vs_gc'], '.3f')} | {megabytes(r.get('tensor_peak_bytes'))} / "
            f"{megabytes(r.get('predicted_peak_bytes'))} | {num(r['cosine'], '.6f')} | {num(r['rel_l2'], '.1e')} / "
            f"{predicted} | {r['info'].get('samples_skipped', '-')} | {r['info'].get('microbatches', '-')} |")
    return "\n".join(lines)
