"""The step bench's figures: throughput against peak memory, one labelled point per method, and the
frontier's, one line per method across the memory ceilings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .frontier_report import FrontierReport
from .methods import LABELS
from .report import MEMORY_CEILING, BenchReport


def _label_offsets(ax: Any, points: list[tuple[float, float]], labels: list[str]) -> list[tuple[float, float]]:
    """Each label's offset (typographic points) from its point: up and right,
    pushed down below labels already placed (highest point first) until none overprints.

    Methods at the memory ceiling (HiLoRe, its blind plan, uniform int8)
    land on nearly one point; their labels would otherwise be unreadable.
    """
    scale = ax.figure.dpi / 72  # display pixels per typographic point
    height, char = 12 * scale, 6.5 * scale  # a 10 pt line, an average glyph
    placed: list[tuple[float, float, float]] = []  # (left, right, baseline) in pixels
    offsets: list[tuple[float, float]] = [(5.0, 5.0)] * len(points)
    for i in sorted(range(len(points)), key=lambda i: -points[i][1]):
        px, py = ax.transData.transform(points[i])
        left, right, y = px + 5 * scale, px + 5 * scale + char * len(labels[i]), py + 5 * scale
        # Half a pixel of slack: a label moved exactly one line down must not clash by rounding.
        while clash := [b for b in placed if left < b[1] and b[0] < right and abs(y - b[2]) < height - 0.5]:
            y = min(b[2] for b in clash) - height
        placed.append((left, right, y))
        offsets[i] = (5.0, (y - py) / scale)
    return offsets


def save_png(report: BenchReport, path: str | os.PathLike) -> Path | None:
    """Throughput against peak memory, one point per method; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gc_peak = None
    points = [(s, s.peak_bytes.median / 1e6, s.tokens_per_s) for s in report.stats if s.tokens_per_s and s.peak_bytes]
    colours = []
    for s, x, t in points:
        drawn = ax.errorbar([x], [t.median], yerr=[[t.median - t.min], [t.max - t.median]], fmt="o", capsize=3)
        colours.append(drawn.lines[0].get_color())
    ax.autoscale_view()
    offsets = _label_offsets(ax, [(x, t.median) for _, x, t in points], [s.label for s, *_ in points])
    for (s, x, t), colour, offset in zip(points, colours, offsets):
        ax.annotate(s.label, (x, t.median), textcoords="offset points", xytext=offset, color=colour)
        if s.method == "gc":
            gc_peak = x
    if gc_peak is not None:
        ax.axvline(MEMORY_CEILING * gc_peak, linestyle="--", color="grey", label="1.10 x GC peak")
        ax.legend(loc="lower right")
    cfg = report.run.config
    ax.set(xlabel="peak memory of the step (MB)", ylabel="tokens / s (median, min-max)",
           title=f"{cfg.model}, B={cfg.batch}, T={cfg.seq_len}, {report.run.device}")
    return _save(fig, path)


def _save(fig: Any, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG atomically (readers never see a half-written image, as with the JSON)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


#: One marker per frontier line, so lines that share a colour (past 10) still differ.
FRONTIER_MARKERS = "os^Dv<>pPX*h"


def frontier_lines(report: FrontierReport) -> dict[str, list[tuple[float, float]]]:
    """Per method label, its distinct measured points (peak MB, median tokens/s), by peak."""
    lines: dict[str, set[tuple[float, float]]] = {}
    for c in report.cells:
        s = c.stats
        if s is not None and s.tokens_per_s and s.peak_bytes:
            lines.setdefault(LABELS[c.point.method], set()).add((s.peak_bytes.median / 1e6, s.tokens_per_s.median))
    return {label: sorted(points) for label, points in lines.items()}


def save_frontier_png(report: FrontierReport, path: str | os.PathLike) -> Path | None:
    """Tokens/s against measured peak, one line per method, the ceilings marked; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (label, points) in enumerate(frontier_lines(report).items()):
        xs, ys = zip(*points)
        # Matplotlib cycles 10 colours; a marker of its own keeps the 11th line apart from the first.
        ax.plot(xs, ys, marker=FRONTIER_MARKERS[i % len(FRONTIER_MARKERS)],
                linestyle="-" if len(points) > 1 else "none", label=label)
    for row in report.rows:
        if row.ceiling_bytes:
            ax.axvline(row.ceiling_bytes / 1e6, linestyle=":", color="grey", linewidth=0.8)
            ax.annotate(f"{row.ceiling:g}x", (row.ceiling_bytes / 1e6, 1), xycoords=("data", "axes fraction"),
                        xytext=(2, -10), textcoords="offset points", color="grey", fontsize=8)
    cfg = report.run.config
    ax.legend(loc="best", fontsize=8)  # a fixed corner hid store-all's point on the whole-step plot
    ax.set(xlabel="measured peak memory of the step (MB)", ylabel="tokens / s (median)",
           title=f"{cfg.model} {cfg.dtype}, B={cfg.batch}, T={cfg.seq_len}: ceilings in x GC's peak (dotted)")
    return _save(fig, path)
