"""Turn a ``BenchRun`` into statistics, the paper's targets, a table and JSON (the PNG: ``plot.py``).

Throughput is tokens per second of one step (B x T tokens), the median over
the measured steps of all rounds, with min/max and quartiles as spread;
peak memory is the median per-step peak (on CPU measured by each method's
worker of its own under the VmHWM allocator setting, ``launcher.Launcher``,
while the timed rounds run on the default allocator). Both are reported as ratios to GC,
the baseline the paper's ceiling and speed-ups are stated against; speed
also as the geometric mean of per-round paired ratios with a 95% interval
(``paired.py``), which the speed targets use when the samples carry rounds.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from .host import environment
from .methods import LABELS
from .paired import PairedRatio, paired_ratio
from .rounds import MethodRun, peak_samples
from .runner import BenchRun

BENCH_SCHEMA = "hilore.bench/v1"

#: The paper's memory ceiling: HiLoRe's peak at most 1.10 x GC's actor-update peak.
MEMORY_CEILING = 1.10
#: The paper's speed-ups: up to +13.5% over GC and +7.9% over the fastest
#: other baseline (that fits the ceiling).
SPEEDUP_VS_GC = 1.135
SPEEDUP_VS_BEST = 1.079
#: The project's fidelity target: gradient cosine to exact (store-all).
MIN_COSINE = 0.999


@dataclass(frozen=True, slots=True, kw_only=True)
class Spread:
    """Median and spread of repeated measurements."""

    median: float
    min: float
    max: float
    q1: float
    q3: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if len(values) == 1:
            return cls(median=values[0], min=values[0], max=values[0], q1=values[0], q3=values[0])
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(median=statistics.median(values), min=min(values), max=max(values), q1=q1, q3=q3)


@dataclass(frozen=True, slots=True, kw_only=True)
class MethodStats:
    """One row of the table."""

    method: str
    label: str
    status: str
    error: str | None
    tokens_per_s: Spread | None
    peak_bytes: Spread | None
    #: Ratios to GC's medians (None without GC or without data).
    speed_vs_gc: float | None
    peak_vs_gc: float | None
    cosine: float | None
    rel_l2: float | None
    compile_s: float | None
    note: str
    #: Speed over GC's, paired by round, with its 95% interval (None without rounds).
    paired_vs_gc: PairedRatio | None = None
    #: The peak the method's planner predicted (``info["predicted_peak_bytes"]``), if any.
    predicted_peak_bytes: float | None = None
    #: Measured peak within MEMORY_CEILING x GC's (None without both peaks).
    fits_ceiling: bool | None = None
    #: The cosine the plan predicts for this step's bucket, and the one its
    #: risk budget leaves that bucket (``plans.step_cosines``); None: no plan.
    predicted_cosine: float | None = None
    cosine_bound: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One of the paper's claims checked on this run; ``met`` None: not evaluable."""

    name: str
    value: float | None
    threshold: float
    #: ``">="`` or ``"<="``: how ``value`` must compare with ``threshold``.
    sense: str
    met: bool | None
    detail: str
    #: 95% interval of a paired speed ratio (speed targets with rounds only).
    interval: tuple[float, float] | None = None
    #: Whether the interval's lower bound is above 1.0: faster beyond round-to-round noise.
    lower_bound_above_1: bool | None = None


def method_note(run: MethodRun) -> str:
    """What else a reader needs to know about a row (budget, bucket, failure)."""
    if run.status != "ok":
        return "FAILED: " + (run.error or "").splitlines()[0][:100]
    if "activation_memory_budget" in run.info:
        return f"budget {run.info['activation_memory_budget']:g}"
    if "fp8_size_mb" in run.info:
        return f"fp8 from {run.info['fp8_size_mb']:g} MiB"
    if run.info.get("bucket"):
        return f"bucket {run.info['bucket']}"
    return ""


def method_stats(run: MethodRun, tokens: int, gc: MethodRun | None) -> MethodStats:
    """Statistics of one method; ratios against ``gc``'s medians when it has data."""
    tps = Spread.of([tokens / s.seconds for s in run.samples]) if run.samples else None
    peaks = peak_samples(run) if run.samples else []
    peak = Spread.of([float(p) for p in peaks]) if peaks else None
    gc_tps = Spread.of([tokens / s.seconds for s in gc.samples]).median if gc and gc.samples else None
    gc_peaks = peak_samples(gc) if gc and gc.samples else []
    gc_peak = statistics.median(gc_peaks) if gc_peaks else None
    fidelity = run.fidelity or {}
    peak_vs_gc = peak.median / gc_peak if peak and gc_peak else None
    return MethodStats(
        method=run.method, label=LABELS[run.method], status=run.status, error=run.error,
        tokens_per_s=tps, peak_bytes=peak,
        speed_vs_gc=tps.median / gc_tps if tps and gc_tps else None,
        peak_vs_gc=peak_vs_gc,
        cosine=fidelity.get("cosine"), rel_l2=fidelity.get("rel_l2"),
        compile_s=run.compile_s, note=method_note(run),
        paired_vs_gc=paired_ratio(run.samples, gc.samples, tokens) if gc else None,
        predicted_peak_bytes=run.info.get("predicted_peak_bytes"),
        fits_ceiling=None if peak_vs_gc is None else peak_vs_gc <= MEMORY_CEILING,
        predicted_cosine=run.info.get("predicted_cosine"), cosine_bound=run.info.get("cosine_bound"),
    )


def _compare(name: str, value: float | None, threshold: float, sense: str, missing: str) -> Target:
    if value is None:
        return Target(name=name, value=None, threshold=threshold, sense=sense, met=None, detail=missing)
    met = value >= threshold if sense == ">=" else value <= threshold
    margin = (value / threshold - 1) * 100
    return Target(name=name, value=value, threshold=threshold, sense=sense, met=met,
                  detail=f"{value:.4g} vs {sense} {threshold:g} ({margin:+.1f}%)")


def _cosine(name: str, s: MethodStats | None, missing: str) -> Target:
    """Gradient cosine against the bound the method's plan promises for this step.

    A step that runs one exposure bucket alone may spend that bucket's share
    of the update's error budget: its bound is ``risk_budget / error_share``
    (``plans.step_cosines``), MIN_COSINE for the exposure-blind plan and
    for methods without a plan.
    """
    bound = s.cosine_bound if s and s.cosine_bound is not None else MIN_COSINE
    target = _compare(name, s.cosine if s else None, bound, ">=", missing)
    if s and s.cosine_bound is not None and target.value is not None:
        detail = f"{target.detail}; the bound of its plan for this step"
        if s.predicted_cosine is not None:
            detail += f", which predicts {s.predicted_cosine:.6f}"
        target = replace(target, detail=detail)
    return target


def best_fitting_baseline(stats: dict[str, MethodStats]) -> MethodStats | None:
    """The fastest method other than HiLoRe whose peak fits MEMORY_CEILING x GC's.

    ``hilore-blind`` (one exposure bucket) competes here like any baseline.
    """
    fits = [s for m, s in stats.items() if m != "hilore" and s.tokens_per_s and s.fits_ceiling]
    return max(fits, key=lambda s: s.tokens_per_s.median, default=None)


def _speed(name: str, median_ratio: float | None, paired: PairedRatio | None, threshold: float,
           missing: str) -> Target:
    """A speed-up target on the paired geometric mean (the ratio of medians without rounds)."""
    target = _compare(name, paired.ratio if paired else median_ratio, threshold, ">=", missing)
    if paired is None or paired.low is None:
        return target
    above = paired.low > 1.0
    detail = (f"{target.detail}; 95% CI [{paired.low:.3f}, {paired.high:.3f}] over {paired.rounds} "
              f"rounds, lower bound {'above' if above else 'not above'} 1.0")
    return replace(target, detail=detail, interval=(paired.low, paired.high),
                               lower_bound_above_1=above)


def targets(stats: dict[str, MethodStats], vs_best: PairedRatio | None = None,
            vs_chunked: PairedRatio | None = None) -> list[Target]:
    """The paper's claims on this run: memory ceiling, the two speed-ups, gradient fidelity.

    ``vs_best``: HiLoRe's speed over the fastest fitting baseline's, paired by
    round; ``vs_chunked``: HiLoRe whole step's over GC + chunked log-probs'.
    """
    h = stats.get("hilore")
    speed = h.tokens_per_s.median if h and h.tokens_per_s else None
    best = best_fitting_baseline(stats)
    median_vs_best = speed / best.tokens_per_s.median if speed and best else None
    return [
        _compare("HiLoRe peak / GC peak", h.peak_vs_gc if h else None, MEMORY_CEILING, "<=",
                 "needs HiLoRe and GC measurements"),
        _speed("HiLoRe speed / GC speed", h.speed_vs_gc if h else None, h.paired_vs_gc if h else None,
               SPEEDUP_VS_GC, "needs HiLoRe and GC measurements"),
        _speed(f"HiLoRe speed / fastest fitting baseline ({best.label if best else '-'})", median_vs_best,
               vs_best if median_vs_best else None, SPEEDUP_VS_BEST,
               "needs HiLoRe and a baseline within the ceiling"),
        _cosine("HiLoRe gradient cosine", h, "needs HiLoRe and store-all gradients"),
        *step_targets(stats, vs_chunked),
    ]


def step_targets(stats: dict[str, MethodStats], paired: PairedRatio | None = None) -> list[Target]:
    """HiLoRe on the whole step against GC + chunked log-probs, when both ran:
    within 1.10x its measured peak, faster (by how much, with the paired
    interval when the runs have rounds) and at the gradient cosine target."""
    h, gc = stats.get("hilore-step"), stats.get("gc-chunked")
    if h is None or gc is None:
        return []
    peak = (h.peak_bytes.median / gc.peak_bytes.median) if h.peak_bytes and gc.peak_bytes else None
    speed = (h.tokens_per_s.median / gc.tokens_per_s.median) if h.tokens_per_s and gc.tokens_per_s else None
    missing = "needs HiLoRe whole step and GC + chunked log-probs measurements"
    return [_compare("HiLoRe whole step peak / GC + chunked peak", peak, MEMORY_CEILING, "<=", missing),
            _speed("HiLoRe whole step speed / GC + chunked speed", speed, paired if speed else None, 1.0,
                   missing),
            _cosine("HiLoRe whole step gradient cosine", h, "needs HiLoRe whole step and store-all gradients")]


def recovered_fraction(stats: dict[str, MethodStats]) -> float | None:
    """(t_GC - t_HiLoRe) / (t_GC - t_store): the share of GC's recompute overhead HiLoRe removes."""
    times = {m: 1.0 / s.tokens_per_s.median for m, s in stats.items() if s.tokens_per_s}
    if not all(m in times for m in ("gc", "hilore", "store-all")):
        return None
    overhead = times["gc"] - times["store-all"]
    if overhead <= 0:
        return None  # GC no slower than store-all: nothing to recover (noise dominates)
    return (times["gc"] - times["hilore"]) / overhead


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchReport:
    """The statistics and verdicts of one run."""

    run: BenchRun
    stats: tuple[MethodStats, ...]
    targets: tuple[Target, ...]
    recovered: float | None
    environment: dict[str, Any]


def summarise(run: BenchRun) -> BenchReport:
    """Statistics per method, targets and the recovered share of GC's overhead."""
    tokens = run.config.batch * run.config.seq_len
    runs = {r.method: r for r in run.runs}
    stats = {r.method: method_stats(r, tokens, runs.get("gc")) for r in run.runs}
    best = best_fitting_baseline(stats)
    vs_best = (paired_ratio(runs["hilore"].samples, runs[best.method].samples, tokens)
               if best and "hilore" in runs else None)
    vs_chunked = (paired_ratio(runs["hilore-step"].samples, runs["gc-chunked"].samples, tokens)
                  if "hilore-step" in runs and "gc-chunked" in runs else None)
    return BenchReport(run=run, stats=tuple(stats.values()), targets=tuple(targets(stats, vs_best, vs_chunked)),
                       recovered=recovered_fraction(stats), environment=environment(run.device))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: BenchReport) -> str:
    """The side-by-side table: throughput (paired ratio to GC with its 95% interval),
    measured and predicted peak, measured and predicted gradient cosine, and
    whether the peak fits the ceiling."""
    head = (f"{'method':<15}{'tokens/s':>10}  {'x GC [95% CI]':<20}{'peak MB':>9}{'x GC':>7}"
            f"{'pred MB':>9}{'grad cos':>11}{'pred cos':>11}{'rel err':>9}{'fits':>6}  note")
    lines = [head, "-" * len(head)]
    for s in report.stats:
        t, p = s.tokens_per_s, s.peak_bytes
        speed = s.paired_vs_gc.format() if s.paired_vs_gc else _fmt(s.speed_vs_gc, '.2f')
        fits = {True: "yes", False: "no", None: "-"}[s.fits_ceiling]
        lines.append(
            f"{s.label:<15}{_fmt(t and t.median, '.0f'):>10}  {speed:<20}"
            f"{_fmt(p and p.median / 1e6, '.1f'):>9}{_fmt(s.peak_vs_gc, '.3f'):>7}"
            f"{_fmt(s.predicted_peak_bytes and s.predicted_peak_bytes / 1e6, '.1f'):>9}"
            f"{_fmt(s.cosine, '.6f'):>11}{_fmt(s.predicted_cosine, '.6f'):>11}{_fmt(s.rel_l2, '.1e'):>9}"
            f"{fits:>6}  {s.note}")
    return "\n".join(lines)


def format_targets(report: BenchReport) -> str:
    """One line per target (met / MISSED / not evaluated), then the ceiling and the recovery."""
    lines = []
    for t in report.targets:
        verdict = {True: "met   ", False: "MISSED", None: "n/a   "}[t.met]
        lines.append(f"  [{verdict}] {t.name}: {t.detail}")
    stats = {s.method: s for s in report.stats}
    store = stats.get("store-all")
    if store and store.tokens_per_s:
        lines.append(f"  store-all (ceiling): {store.tokens_per_s.median:.0f} tokens/s, "
                     f"{_fmt(store.speed_vs_gc, '.3f')} x GC, peak {_fmt(store.peak_vs_gc, '.2f')} x GC")
    if report.recovered is not None:
        lines.append(f"  HiLoRe recovers {report.recovered * 100:.0f}% of GC's recompute overhead "
                     "((t_GC - t_HiLoRe) / (t_GC - t_store))")
    elif stats.get("gc") and stats["gc"].speed_vs_gc and store and store.speed_vs_gc and store.speed_vs_gc <= 1:
        lines.append("  recovered share of GC's overhead: undefined (GC was not slower than store-all)")
    return "\n".join(lines)


def to_json(report: BenchReport) -> dict[str, Any]:
    """The result file: configuration, environment, per-method data, targets."""
    run = report.run
    methods = [run_record(s, r) for s, r in zip(report.stats, run.runs)]
    return {
        "schema": BENCH_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(run.config),
        "device": run.device,
        "environment": report.environment,
        "tokens_per_step": run.config.batch * run.config.seq_len,
        "memory_ceiling": MEMORY_CEILING,
        "methods": methods,
        "budget_search": run.budget_search.to_json() if run.budget_search else None,
        "targets": [asdict(t) for t in report.targets],
        "recovered_fraction": report.recovered,
        "run_dir": run.run_dir,
    }


def run_record(stats: MethodStats, run: MethodRun) -> dict[str, Any]:
    """One run in a result file: its statistics and every measurement behind them."""
    return {**asdict(stats), "info": run.info, "fidelity": run.fidelity, "peaks": list(run.peaks),
            "samples": [asdict(x) for x in run.samples], "warmup": [asdict(x) for x in run.warmup],
            "settle": [asdict(x) for x in run.settle]}

