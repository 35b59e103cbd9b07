"""The frontier's figures: every point's statistics, and per ceiling the fastest method that fits.

A point fits its ceiling when its measured peak (median, ``report.method_stats``)
is at most the ceiling times GC's measured peak: the rule the report holds
every method to, planned or not. Per ceiling the table names the fastest other
method that fits (HiLoRe's own plan measured for another method's point, e.g.
the exposure-blind plan when its decisions are HiLoRe's, is not "other"),
HiLoRe's speed over it paired by round with its 95% interval, and the share of
GC's overhead HiLoRe recovers, ``(t_GC - t_HiLoRe) / (t_GC - t_store-all)``.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from typing import Any

from .frontier import DOES_NOT_FIT, FrontierRun, Point
from .host import environment
from .launcher import REFERENCE_GC
from .methods import LABELS
from .paired import PairedRatio, paired_ratio
from .report import MethodStats, method_stats, run_record

FRONTIER_SCHEMA = "hilore.frontier/v1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """A point with its run's statistics and whether that run's measured peak fits the ceiling."""

    point: Point
    stats: MethodStats | None
    fits: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class CeilingRow:
    """One ceiling: HiLoRe's point, the fastest other point that fits, and how they compare."""

    ceiling: float
    ceiling_bytes: float | None
    hilore: Cell | None
    fastest_other: Cell | None
    #: HiLoRe's speed over the fastest other fitting point's, paired by round.
    vs_fastest: PairedRatio | None
    #: HiLoRe's share of GC's overhead recovered.
    recovered: float | None
    #: The exposure-blind plan's point and HiLoRe's speed over it (None: not run, or one plan).
    blind: Cell | None
    vs_blind: PairedRatio | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontierReport:
    """A frontier run's statistics, its cells and one row per ceiling, ready to print or save."""

    run: FrontierRun
    #: Statistics of every run, by run name.
    stats: dict[str, MethodStats]
    cells: tuple[Cell, ...]
    rows: tuple[CeilingRow, ...]
    #: Which HiLoRe method the rows follow (``hilore``, else ``hilore-step``) and its GC.
    hilore_method: str
    gc_method: str
    environment: dict[str, Any]


def summarise_frontier(run: FrontierRun) -> FrontierReport:
    """Every run's statistics against its GC, every point's fit, one row per ceiling."""
    tokens = run.config.batch * run.config.seq_len
    hilore = "hilore" if "hilore" in run.config.methods else "hilore-step"
    gc_method = REFERENCE_GC.get(hilore, "gc")
    gc = run.runs.get(gc_method)
    stats = {name: method_stats(r, tokens, gc) for name, r in run.runs.items()}
    gc_stats = stats.get(gc_method)
    gc_peak = gc_stats.peak_bytes.median if gc_stats and gc_stats.peak_bytes else None
    cells = tuple(_cell(p, stats, gc_peak) for p in run.points)
    rows = tuple(_row(run, c, cells, stats, hilore, gc_peak, tokens) for c in run.config.ceilings)
    return FrontierReport(run=run, stats=stats, cells=cells, rows=rows, hilore_method=hilore, gc_method=gc_method,
                          environment=environment(run.device))


def _cell(point: Point, stats: dict[str, MethodStats], gc_peak: float | None) -> Cell:
    s = stats.get(point.run) if point.run else None
    if s is None or s.peak_bytes is None or gc_peak is None:
        return Cell(point=point, stats=s, fits=False if point.status == DOES_NOT_FIT else None)
    return Cell(point=point, stats=s, fits=s.peak_bytes.median <= point.ceiling * gc_peak)


def fastest_fitting(cells: list[Cell], exclude: str | None = None) -> Cell | None:
    """The fastest cell whose run fits, other than those measured by run ``exclude``."""
    fits = [c for c in cells if c.fits and c.stats and c.stats.tokens_per_s and c.point.run != exclude]
    return max(fits, key=lambda c: c.stats.tokens_per_s.median, default=None)


def _row(run: FrontierRun, ceiling: float, cells: tuple[Cell, ...], stats: dict[str, MethodStats],
         hilore: str, gc_peak: float | None, tokens: int) -> CeilingRow:
    here = [c for c in cells if c.point.ceiling == ceiling]
    mine = next((c for c in here if c.point.method == hilore), None)
    blind = next((c for c in here if c.point.method == "hilore-blind"), None)
    own_run = mine.point.run if mine else None
    others = [c for c in here if c.point.method != hilore]
    fastest = fastest_fitting(others, exclude=own_run)

    def paired(other: Cell | None) -> PairedRatio | None:
        if not (mine and mine.stats and other and other.point.run and own_run):
            return None
        return paired_ratio(run.runs[own_run].samples, run.runs[other.point.run].samples, tokens)

    return CeilingRow(ceiling=ceiling, ceiling_bytes=ceiling * gc_peak if gc_peak else None, hilore=mine,
                      fastest_other=fastest, vs_fastest=paired(fastest),
                      recovered=recovered(mine.stats if mine else None, stats),
                      blind=blind, vs_blind=paired(blind) if blind and blind.point.run != own_run else None)


def recovered(point: MethodStats | None, stats: dict[str, MethodStats]) -> float | None:
    """(t_GC - t) / (t_GC - t_store-all) of ``point``'s median step; None without the three or
    where GC is no slower than store-all (nothing to recover)."""
    times = {k: 1.0 / s.tokens_per_s.median for k, s in (("gc", stats.get("gc") or stats.get("gc-chunked")),
                                                          ("store", stats.get("store-all")), ("point", point))
             if s and s.tokens_per_s}
    if len(times) < 3 or times["gc"] <= times["store"]:
        return None
    return (times["gc"] - times["point"]) / (times["gc"] - times["store"])


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _speed(s: MethodStats | None) -> str:
    if s is None or s.tokens_per_s is None:
        return "-"
    return s.paired_vs_gc.format() if s.paired_vs_gc else _fmt(s.speed_vs_gc, ".2f")


def _hilore_note(row: CeilingRow) -> str:
    """What a reader must know about HiLoRe's point: not fitting, another run's plan, over its ceiling."""
    mine = row.hilore
    if mine is None:
        return "HiLoRe not run"
    notes = [mine.point.note] if mine.point.note and mine.point.status != DOES_NOT_FIT else []
    if mine.stats is not None and mine.fits is False:
        notes.append(f"HiLoRe's measured peak is over the ceiling ({mine.stats.peak_vs_gc:.3f} x GC)")
    if row.blind is not None and row.blind.point.run and row.blind.point.run == mine.point.run:
        notes.append("blind: the same plan")
    elif row.vs_blind is not None:
        notes.append(f"vs blind {row.vs_blind.format()}")
    return "; ".join(notes)


def format_ceiling_table(report: FrontierReport) -> str:
    """Per ceiling (markdown): HiLoRe's point, the fastest other that fits, HiLoRe over it, recovery."""
    lines = ["| ceiling x GC | MB | HiLoRe x GC [95% CI] | peak x GC | grad cosine | fastest other that fits "
             "| its x GC | HiLoRe / it [95% CI] | GC overhead recovered | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report.rows:
        mine = row.hilore
        s = mine.stats if mine else None
        if mine is not None and mine.point.status == DOES_NOT_FIT:
            first = f"does not fit: needs {mine.point.min_budget_bytes / 1e6:.1f} MB | - | -"
        else:
            first = f"{_speed(s)} | {_fmt(s and s.peak_vs_gc, '.3f')} | {_fmt(s and s.cosine, '.6f')}"
        other = row.fastest_other
        name = other.stats.label + (f" ({other.point.note})" if other.point.note else "") if other else "none"
        lines.append(f"| {row.ceiling:g} | {_fmt(row.ceiling_bytes and row.ceiling_bytes / 1e6, '.1f')} | {first} "
                     f"| {name} | {_speed(other.stats if other else None)} "
                     f"| {row.vs_fastest.format() if row.vs_fastest else '-'} "
                     f"| {_fmt(row.recovered and row.recovered * 100, '.0f')}{'%' if row.recovered is not None else ''} "
                     f"| {_hilore_note(row)} |")
    return "\n".join(lines)


def format_points_table(report: FrontierReport) -> str:
    """Every method at every ceiling (markdown): its run's speed and peak, or why there is none."""
    lines = ["| method | ceiling x GC | tokens/s | x GC [95% CI] | peak MB | x GC peak | fits | grad cosine | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(report.cells, key=lambda c: (list(LABELS).index(c.point.method), c.point.ceiling)):
        s, p = c.stats, c.point
        fits = {True: "yes", False: "no", None: "-"}[c.fits]
        note = p.note if p.status != "measured" or p.note else ""
        if p.status not in ("measured",) and p.status not in note:
            note = f"{p.status}: {note}" if note else p.status
        tps = s.tokens_per_s.median if s and s.tokens_per_s else None
        lines.append(f"| {LABELS[p.method]} | {p.ceiling:g} | {_fmt(tps, '.0f')} | {_speed(s)} "
                     f"| {_fmt(s and s.peak_bytes and s.peak_bytes.median / 1e6, '.1f')} "
                     f"| {_fmt(s and s.peak_vs_gc, '.3f')} | {fits} | {_fmt(s and s.cosine, '.6f')} | {note} |")
    return "\n".join(lines)


def to_json(report: FrontierReport) -> dict[str, Any]:
    """The result file: configuration, environment, every run's data, every point, every row."""
    run = report.run
    runs = {name: run_record(report.stats[name], r) for name, r in run.runs.items()}
    rows = [{"ceiling": r.ceiling, "ceiling_bytes": r.ceiling_bytes,
             "hilore": asdict(r.hilore.point) if r.hilore else None, "hilore_fits": r.hilore.fits if r.hilore else None,
             "fastest_other": asdict(r.fastest_other.point) if r.fastest_other else None,
             "vs_fastest": asdict(r.vs_fastest) if r.vs_fastest else None, "recovered_fraction": r.recovered,
             "vs_blind": asdict(r.vs_blind) if r.vs_blind else None} for r in report.rows]
    return {"schema": FRONTIER_SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": asdict(run.config), "device": run.device, "environment": report.environment,
            "tokens_per_step": run.config.batch * run.config.seq_len, "gc_peaks": run.gc_peaks,
            "hilore_method": report.hilore_method, "gc_method": report.gc_method,
            "points": [{**asdict(c.point), "fits": c.fits} for c in report.cells], "rows": rows,
            "runs": runs, "pt_budget_probes": [asdict(p) for p in run.probes], "run_dir": run.run_dir}

