"""The actor-update bench's numbers: a table, ratios to GC and the plans' predicted error.

Throughput is the batch's tokens (B x T, skipped samples included) per second
of the whole update, the median over the measured updates of all rounds;
peak memory is the median per-update peak (``measure.py``'s definition).
"""

from __future__ import annotations

import datetime
import platform
from dataclasses import asdict
from typing import Any

import torch

from .actor import LABELS, ActorBenchConfig
from .report import Spread
from .runner import MethodRun

ACTOR_SCHEMA = "hilore.bench-actor/v1"


def _row(run: MethodRun, gc: MethodRun | None, plans: dict[str, Any]) -> dict[str, Any]:
    tokens = run.info.get("tokens")
    rate = Spread.of([tokens / s.seconds for s in run.samples]) if run.samples and tokens else None
    peak = Spread.of([float(s.peak_bytes) for s in run.samples]) if run.samples else None
    gc_rate = gc_peak = None
    if gc is not None and gc.samples and gc.info.get("tokens"):
        gc_rate = Spread.of([gc.info["tokens"] / s.seconds for s in gc.samples]).median
        gc_peak = Spread.of([float(s.peak_bytes) for s in gc.samples]).median
    plan = {"hilore-blind": "blind", "hilore-buckets": "buckets", "hilore-skip": "buckets"}.get(run.method)
    return {
        "method": run.method, "label": LABELS[run.method], "status": run.status, "error": run.error,
        "tokens_per_s": None if rate is None else asdict(rate),
        "peak_bytes": None if peak is None else asdict(peak),
        "speed_vs_gc": None if rate is None or not gc_rate else rate.median / gc_rate,
        "peak_vs_gc": None if peak is None or not gc_peak else peak.median / gc_peak,
        "cosine": None if run.fidelity is None else run.fidelity["cosine"],
        "rel_l2": None if run.fidelity is None else run.fidelity["rel_l2"],
        "predicted_rel_l2": None if plan is None else plans["info"][plan]["predicted_error"],
        "compile_s": run.compile_s, "info": run.info,
    }


def summarise(config: ActorBenchConfig, runs: dict[str, MethodRun], plans: dict[str, Any]) -> dict[str, Any]:
    """The JSON payload: configuration, machine, plans, one row per method."""
    return {
        "schema": ACTOR_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {**asdict(config), "methods": list(config.methods)},
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "cpu_count": __import__("os").cpu_count()},
        "plans": {"info": plans["info"], "mix": plans["mix"]},
        "rows": [_row(r, runs.get("gc"), plans) for r in runs.values()],
    }


def format_table(report: dict[str, Any]) -> str:
    """A markdown table of the rows, as the README shows it."""
    head = ("| method | tokens/s (median) | x GC | peak MB | x GC peak | grad cosine | rel. L2 "
            "(measured / predicted) | skipped | microbatches |")
    lines = [head, "|" + "---|" * 9]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | failed: {str(r['error']).splitlines()[0][:60]} |||||||| ")
            continue

        def num(value: float | None, fmt: str) -> str:
            return "-" if value is None else format(value, fmt)

        predicted = num(r["predicted_rel_l2"], ".1e")
        lines.append(
            f"| {r['label']} | {num(r['tokens_per_s'] and r['tokens_per_s']['median'], '.0f')} | "
            f"{num(r['speed_vs_gc'], '.3f')} | {num(r['peak_bytes'] and r['peak_bytes']['median'] / 1e6, '.1f')} | "
            f"{num(r['peak_vs_gc'], '.3f')} | {num(r['cosine'], '.6f')} | {num(r['rel_l2'], '.1e')} / "
            f"{predicted} | {r['info'].get('samples_skipped', '-')} | {r['info'].get('microbatches', '-')} |")
    return "\n".join(lines)
