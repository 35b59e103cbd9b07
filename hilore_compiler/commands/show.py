"""``hilore show PLAN_OR_TRACE [--png FILE]``: a plan or a trace as readable tables.

A plan: its buckets, then per layer and per kind the options chosen in each
bucket with bytes before (stored) and after (kept) and the recovery time, then
totals against gradient checkpointing and store-all. A trace: its recovery
units and the memory-time Pareto curve over a range of budgets (solved here),
drawn to a PNG with ``--png`` when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..jsonio import FormatError, check_output_path, read_object
from ..planfile import (
    COMPRESS_PREFIX,
    PEAK_PARTS,
    PLAN_SCHEMA,
    RECOMPUTE,
    STORE,
    BucketSpec,
    Plan,
    PlanUnit,
    plan_from_json,
)
from ..solver import ParetoCurve, SolverOptions, pareto_curve
from ..solver.budget import format_bytes, format_seconds
from ..solver.pareto import DEFAULT_POINTS
from ..tracefile import TRACE_SCHEMA, Trace, eval_size, trace_from_json

#: Seconds per ILP on the Pareto curve: a display, so a quick answer will do.
CURVE_TIME_LIMIT_S = 1.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("show", help="a plan or trace as readable tables and a summary")
    p.add_argument("path", help="hilore.plan/v1 or hilore.trace/v1 JSON file")
    p.add_argument("--png", default=None, help="trace only: also draw the Pareto curve to this PNG")
    p.add_argument("--points", type=int, default=DEFAULT_POINTS, help="budgets on a trace's Pareto curve")
    p.add_argument("--time-limit", type=float, default=CURVE_TIME_LIMIT_S,
                   help="seconds CBC may spend per budget on the curve")
    p.set_defaults(run=run)


def load_any(path: str | Path) -> Plan | Trace:
    """Read a plan or a trace, whichever the file's ``schema`` says."""
    payload = read_object(path)
    schema = payload.get("schema")
    if schema == PLAN_SCHEMA:
        return plan_from_json(payload, where=str(path))
    if schema == TRACE_SCHEMA:
        return trace_from_json(payload, where=str(path))
    raise FormatError(f"{path}: schema is {schema!r}, expected {PLAN_SCHEMA!r} or {TRACE_SCHEMA!r}")


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Plain-text columns: text left-aligned, numbers right-aligned."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


_NUMBER = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?[x%]?")


def _numeric(cell: str) -> bool:
    """A number, possibly with a unit after a space (``1.5 GiB``, ``0.96x``)."""
    return _NUMBER.fullmatch(cell.split(" ", 1)[0]) is not None


def _mix(options: Iterable[str]) -> str:
    """Option counts, e.g. ``S3 int8:2 R12`` (S store, R recompute, codec names)."""
    counts: dict[str, int] = {}
    for o in options:
        label = "S" if o == STORE else "R" if o == RECOMPUTE else o.removeprefix(COMPRESS_PREFIX) + ":"
        counts[label] = counts.get(label, 0) + 1
    order = sorted(counts, key=lambda k: (k != "S", k == "R", k))
    return " ".join(f"{k}{counts[k]}" for k in order)


def _grouped(plan: Plan, group: Callable[[PlanUnit], str]) -> str:
    """Per group of units: stored bytes, then per bucket the mix, kept bytes, time."""
    solved = [b for b in plan.buckets if not b.skip]
    cost = {(u.key, o.option): o for u in plan.units for o in u.options}
    groups: dict[str, list[PlanUnit]] = {}
    for u in plan.units:
        groups.setdefault(group(u), []).append(u)
    headers = ["", "units", "before"]
    for b in solved:
        headers += [f"{b.bucket.name} options", "after", "time"]
    rows = []
    for name, units in groups.items():
        row: list[object] = [name, len(units), format_bytes(sum(u.bytes for u in units))]
        for b in solved:
            chosen = dict(b.decisions)
            picked = [cost[u.key, chosen[u.key]] for u in units]
            row += [_mix(chosen[u.key] for u in units), format_bytes(sum(o.bytes for o in picked)),
                    format_seconds(sum(o.time_s for o in picked))]
        rows.append(row)
    return table(headers, rows)


def _ratio(n: int, ref: int) -> str:
    return f"{n / ref:.2f}x" if ref else "-"


def exposure_range(spec: BucketSpec) -> str:
    """A bucket's exposure range as ``vocabulary.in_bucket`` reads it: ``(lo, hi]``."""
    return f"({spec.lo:g}, inf)" if math.isinf(spec.hi) else f"({spec.lo:g}, {spec.hi:g}]"


def render_plan(plan: Plan) -> str:
    """The plan as sections: header, buckets, per layer, per kind, totals."""
    head = [
        f"== plan: {plan.model} (fingerprint {plan.fingerprint})",
        f"shape: batch {plan.batch}, seq_len {_lengths(plan)}; costs: {plan.cost_source}; "
        f"codecs: {', '.join(plan.codecs) or 'none'}",
        f"budget {plan.budget} = {format_bytes(plan.budget_bytes)}; GC {format_bytes(plan.gc_bytes)}; "
        f"store-all {format_bytes(plan.store_bytes)}; risk budget {plan.risk_budget:g}",
        *(f"note: {n}" for n in plan.notes),
    ]
    bucket_rows = []
    for b in plan.buckets:
        s, solver = b.bucket, b.solver
        bucket_rows.append([
            s.name, "{0}" if b.skip else exposure_range(s), f"{s.exposure:g}",
            "skip" if b.skip else f"{b.risk:.3g}", "yes" if b.proxy_sensitivity else "no",
            solver.status if solver else "-", f"{solver.seconds:.2f}" if solver else "-",
            "-" if solver is None or solver.gap is None else f"{solver.gap:.2%}",
        ])
    totals = [[b.bucket.name, format_bytes(b.kept_bytes), format_bytes(b.transient_bytes),
               format_bytes(b.memory_bytes), _ratio(b.memory_bytes, plan.gc_bytes),
               _ratio(b.memory_bytes, plan.store_bytes), format_seconds(b.time_s)]
              for b in plan.buckets if not b.skip]
    peaks = [[b.bucket.name, b.peak_at, *(format_bytes(b.peak_parts[n]) for n in PEAK_PARTS)]
             for b in plan.buckets if not b.skip and b.peak_at is not None]
    notes = sorted({n for b in plan.buckets for n in b.notes})
    return "\n".join([
        *head, "", "== buckets",
        table(["bucket", "exposure", "planned at", "risk", "proxy", "solver", "seconds", "gap"], bucket_rows),
        *(f"note: {n}" for n in notes), "",
        "== per layer (before: bytes stored; after: bytes kept; time: recovery; S store, R recompute)",
        _grouped(plan, lambda u: "outside" if u.layer is None else f"layer {u.layer}"), "",
        "== per kind", _grouped(plan, lambda u: u.kind), "",
        "== totals against GC and store-all",
        table(["bucket", "kept", "transient", "memory", "vs GC", "vs store-all", "recovery"], totals),
        *(["", "== where the peak falls (transient = rebuilt + workspace + weight gradients + outputs)",
           table(["bucket", "at", "rebuilt", "workspace", "weight grads", "outputs", "freed"], peaks)] if peaks else []),
        *(["", "== across the range (ceiling: the budget at that length; peak and recovery per bucket)",
           _length_table(plan)] if plan.lengths else []),
    ])


def _lengths(plan: Plan) -> str:
    lo, hi = plan.length_range
    return f"{hi}" if lo == hi else f"{lo} to {hi} (sizes and predictions below at {hi})"


def _length_table(plan: Plan) -> str:
    """A range plan's predicted peak and recovery time at each of its checked lengths."""
    names = [b.bucket.name for b in plan.buckets if not b.skip]
    rows = [[p.seq_len, f"{p.weight:.0%}", format_bytes(p.budget_bytes),
             *(f"{format_bytes(p.memory_bytes[n])} / {format_seconds(p.time_s[n])}" for n in names),
             _ratio(max(p.memory_bytes.values()), p.gc_bytes)]
            for p in plan.lengths]
    return table(["seq_len", "mix", "ceiling", *(f"{n} peak / recovery" for n in names), "peak vs GC"], rows)


def render_trace(trace: Trace, curve: ParetoCurve) -> str:
    """The trace as sections: header, units, memory-time Pareto curve."""
    units = [[
        u.key, "-" if u.layer is None else u.layer, u.kind, u.op, format_bytes(u.bytes_at_trace),
        format_seconds(u.recompute_time_s) if u.recomputable else "no",
        " ".join(f"{n}:{format_bytes(eval_size(c.bytes, trace.batch, trace.seq_len))}/"
                 f"{format_seconds(c.time_s)}/{c.rel_l2:.1e}" + ("" if c.usable else "(unusable)")
                 for n, c in u.codecs.items()) or "-",
        " ".join(f"{n}:{v:.2e}" for n, v in u.sensitivity.items()) or "proxy",
    ] for u in trace.units]
    points = [[format_bytes(p.budget_bytes), format_bytes(p.memory_bytes), _ratio(p.memory_bytes, curve.gc_bytes),
               _ratio(p.memory_bytes, curve.store_bytes), format_seconds(p.time_s), p.stored, p.compressed,
               p.recomputed, p.status] for p in curve.points]
    return "\n".join([
        f"== trace: {trace.model} (fingerprint {trace.fingerprint})",
        f"shape: batch {trace.batch}, seq_len {trace.seq_len}; device {trace.device}; costs: "
        f"{trace.cost_source}; {trace.num_layers} layers, {len(trace.units)} recovery units",
        f"GC {format_bytes(curve.gc_bytes)}; store-all {format_bytes(curve.store_bytes)}",
        *(f"note: {n}" for n in trace.notes), "",
        "== recovery units (recompute time; codecs name:bytes/time/rel_l2)",
        table(["key", "layer", "kind", "op", "bytes", "recompute", "codecs", "sensitivity"], units), "",
        f"== memory-time Pareto curve (exposure {curve.exposure:g}, risk budget {curve.risk_budget:g})",
        table(["budget", "memory", "vs GC", "vs store-all", "recovery", "store", "compress",
               "recompute", "solver"], points),
    ])


def draw_curve(curve: ParetoCurve, trace: Trace, path: str) -> None:
    """Draw memory against recovery time, with GC and store-all marked."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise RuntimeError("--png needs matplotlib: pip install 'hilore-compiler[plot]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    gib = 2**30
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.memory_bytes / gib for p in curve.points], [p.time_s * 1e3 for p in curve.points],
            marker="o", label="HiLoRe plan")
    for ref, name, style in ((curve.gc_bytes, "GC", "--"), (curve.store_bytes, "store-all", ":")):
        ax.axvline(ref / gib, linestyle=style, color="gray", label=name)
    ax.set_xlabel("activation memory (GiB)")
    ax.set_ylabel("recovery time (ms)")
    ax.set_title(f"{trace.model}: memory-time Pareto curve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.png:
        check_output_path(args.png, inputs=[args.path])
    loaded = load_any(args.path)
    if isinstance(loaded, Plan):
        if args.png:
            raise ValueError("--png draws a trace's Pareto curve; this file is a plan")
        print(render_plan(loaded))
        return 0
    curve = pareto_curve(loaded, points=args.points, options=SolverOptions(time_limit_s=args.time_limit))
    print(render_trace(loaded, curve))
    if args.png:
        draw_curve(curve, loaded, args.png)
        print(f"wrote {args.png}")
    return 0
