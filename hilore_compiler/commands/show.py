"""``hilore show PLAN_OR_TRACE``: a plan or a trace as readable tables, 100 columns wide.

A plan: its buckets, then for each distinct plan among them, per layer and per
kind, the options chosen with bytes before (stored) and after (kept) and the
recovery time, then totals against gradient checkpointing (GC) and store-all.
With ``--plot``, the plan's predicted memory over the step as a PNG
(``memplot``); for a roofline plan, whether each bucket fits the card.
A trace: its recovery units summed per kind (``--units``: one row per unit,
wider), and with ``--curve`` or ``--png`` the memory-time Pareto curve over a
range of budgets, solved here (seconds of CBC per budget, hence opt-in).
"""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..jsonio import FormatError, check_output_path, read_object
from ..planfile import (
    COMPRESS_PREFIX,
    PEAK_PARTS,
    PLAN_SCHEMA,
    RECOMPUTE,
    STORE,
    BucketPlan,
    BucketSpec,
    Plan,
    PlanUnit,
)
from ..planload import plan_from_json
from ..solver import ParetoCurve, SolverOptions, pareto_curve
from ..solver.budget import format_bytes, format_seconds
from ..solver.devicefit import fit_lines
from ..solver.memory import cost_model
from ..solver.pareto import DEFAULT_POINTS
from ..solver.risk import format_error
from ..tracefile import TRACE_SCHEMA, Trace, eval_size, trace_from_json
from ..vocabulary import DEFAULT_CODECS
from . import SUMMARIES

#: Width the default output keeps to; ``--units`` may exceed it.
COLUMNS = 100

#: Seconds per ILP on the Pareto curve: a display, so a quick answer will do.
CURVE_TIME_LIMIT_S = 1.0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("show", help=SUMMARIES["show"])
    p.add_argument("path", help="hilore.plan/v1 or hilore.trace/v1 JSON file")
    p.add_argument("--units", action="store_true", help="trace only: one row per recovery unit (wide)")
    p.add_argument("--curve", action="store_true",
                   help="trace only: solve and print the memory-time Pareto curve (seconds per budget)")
    p.add_argument("--png", default=None, help="trace only: also draw the Pareto curve to this PNG")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="plan only: draw the predicted memory over the step (forward, loss, backward, layer "
                        "by layer) for each distinct bucket plan, GC and store-all, with the budget and the "
                        "card's memory, to this PNG")
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


def _grouped(plan: Plan, buckets: Sequence[BucketPlan], group: Callable[[PlanUnit], str]) -> str:
    """Per group of units: stored bytes, then the mix, kept bytes and time of one plan
    that ``buckets`` share."""
    cost = {(u.key, o.option): o for u in plan.units for o in u.options}
    chosen = dict(buckets[0].decisions)
    groups: dict[str, list[PlanUnit]] = {}
    for u in plan.units:
        groups.setdefault(group(u), []).append(u)
    rows = []
    for name, units in groups.items():
        picked = [cost[u.key, chosen[u.key]] for u in units]
        rows.append([name, len(units), format_bytes(sum(u.bytes for u in units)), _mix(chosen[u.key] for u in units),
                     format_bytes(sum(o.bytes for o in picked)), format_seconds(sum(o.time_s for o in picked))])
    return table(["", "units", "before", "options", "after", "time"], rows)


def distinct_plans(plan: Plan) -> list[list[BucketPlan]]:
    """The solved buckets grouped by their decisions: buckets that share a plan run one
    compiled variant, so they are shown once."""
    groups: dict[tuple, list[BucketPlan]] = {}
    for b in plan.buckets:
        if not b.skip:
            groups.setdefault(b.decisions, []).append(b)
    return list(groups.values())


def _ratio(n: int, ref: int) -> str:
    return f"{n / ref:.2f}x" if ref else "-"


def exposure_range(spec: BucketSpec) -> str:
    """A bucket's exposure range as ``vocabulary.in_bucket`` reads it: ``(lo, hi]``."""
    return f"({spec.lo:g}, inf)" if math.isinf(spec.hi) else f"({spec.lo:g}, {spec.hi:g}]"


def _notes(notes: Iterable[str]) -> list[str]:
    """Notes wrapped to COLUMNS, continuation lines indented."""
    return [textwrap.fill(n, COLUMNS, initial_indent="note: ", subsequent_indent="      ") for n in notes]


def _plan_sections(plan: Plan) -> list[str]:
    """Per layer and per kind, once for each distinct plan among the buckets."""
    lines = []
    for shared in distinct_plans(plan):
        names = ", ".join(b.bucket.name for b in shared)
        which = f"bucket {names}" if len(shared) == 1 else f"buckets {names} (one plan)"
        lines += ["", f"== per layer, {which}", "   before: bytes stored; after: bytes kept; time: recovery; "
                  "S store, R recompute",
                  _grouped(plan, shared, lambda u: "outside" if u.layer is None else f"layer {u.layer}"), "",
                  f"== per kind, {which}", _grouped(plan, shared, lambda u: u.kind)]
    return lines


def render_plan(plan: Plan) -> str:
    """The plan as sections: header, buckets, per layer, per kind, totals."""
    head = [
        f"== plan: {plan.model} (fingerprint {plan.fingerprint})",
        f"shape: batch {plan.batch}, seq_len {_lengths(plan)}; costs: {plan.cost_source}; "
        f"codecs: {', '.join(plan.codecs) or 'none'}",
        f"budget {plan.budget} = {format_bytes(plan.budget_bytes)}; GC {format_bytes(plan.gc_bytes)}; "
        f"store-all {format_bytes(plan.store_bytes)}",
        f"error budget: {format_error(plan.risk_budget)} of the whole update's gradient",
        *fit_lines(plan, COLUMNS),
        *_notes(plan.notes),
    ]
    bucket_rows = []
    for b in plan.buckets:
        s, solver = b.bucket, b.solver
        bucket_rows.append([
            s.name, "{0}" if b.skip else exposure_range(s), f"{s.exposure:g}",
            "skip" if b.skip else f"{math.sqrt(b.risk):.3g}", "yes" if b.proxy_sensitivity else "no",
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
        *head, "", "== buckets (rel. L2: the bucket's share of the update's predicted gradient error)",
        table(["bucket", "exposure", "planned at", "rel. L2", "proxy", "solver", "seconds", "gap"], bucket_rows),
        *_notes(notes), *_plan_sections(plan), "",
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


def _unit_rows(trace: Trace) -> list[list[object]]:
    """One row per recovery unit: every measured number (wide)."""
    return [[
        u.key, "-" if u.layer is None else u.layer, u.kind, u.op, format_bytes(u.bytes_at_trace),
        format_seconds(u.recompute_time_s) if u.recomputable else "no",
        " ".join(f"{n}:{format_bytes(eval_size(c.bytes, trace.batch, trace.seq_len))}/"
                 f"{format_seconds(c.time_s)}/{c.rel_l2:.1e}" + ("" if c.usable else "(unusable)")
                 for n, c in u.codecs.items()) or "-",
        " ".join(f"{n}:{v:.2e}" for n, v in u.sensitivity.items()) or "proxy",
    ] for u in trace.units]


def _kind_rows(trace: Trace, codecs: Sequence[str]) -> list[list[object]]:
    """Per unit kind: units, bytes at the traced shape, recompute time, and per codec the
    largest relative L2 error it leaves in one unit's activation."""
    kinds: dict[str, list] = {}
    for u in trace.units:
        kinds.setdefault(u.kind, []).append(u)
    rows = []
    for kind, units in kinds.items():
        recompute = [u.recompute_time_s for u in units if u.recomputable]
        errors = [max((u.codecs[c].rel_l2 for u in units if c in u.codecs and u.codecs[c].usable), default=None)
                  for c in codecs]
        rows.append([kind, len(units), format_bytes(sum(u.bytes_at_trace for u in units)),
                     format_seconds(sum(recompute)) if recompute else "no",
                     *("-" if e is None else f"{e:.0e}" for e in errors),
                     "yes" if all(u.sensitivity for u in units) else "proxy"])
    return rows


def render_trace(trace: Trace, curve: ParetoCurve | None = None, *, units: bool = False) -> str:
    """The trace as sections: header, units per kind (or one by one), the Pareto curve if solved."""
    codecs = sorted({c for u in trace.units for c in u.codecs})
    model = cost_model(trace, batch=trace.batch, seq_len=trace.seq_len, codecs=codecs)
    lines = [
        f"== trace: {trace.model} (fingerprint {trace.fingerprint})",
        f"shape: batch {trace.batch}, seq_len {trace.seq_len}; device {trace.device}; costs: "
        f"{trace.cost_source}; {trace.num_layers} layers, {len(trace.units)} recovery units",
        f"GC {format_bytes(model.gc_bytes)}; store-all {format_bytes(model.store_bytes)}; codecs measured: "
        f"{', '.join(codecs) or 'none'}",
        *_notes(trace.notes), "",
    ]
    if units:
        lines += ["== recovery units (recompute time; codecs name:bytes/time/rel_l2)",
                  table(["key", "layer", "kind", "op", "bytes", "recompute", "codecs", "sensitivity"],
                        _unit_rows(trace))]
    else:
        lines += ["== recovery units per kind (recompute: summed time; codec: largest rel. L2 error of "
                  "one", "   unit's activation; calib.: gradient sensitivity measured; --units: "
                  "one row per unit)",
                  table(["kind", "units", "bytes", "recompute", *codecs, "calib."],
                        _kind_rows(trace, codecs))]
    if curve is not None:
        points = [[format_bytes(p.budget_bytes), format_bytes(p.memory_bytes), _ratio(p.memory_bytes, curve.gc_bytes),
                   _ratio(p.memory_bytes, curve.store_bytes), format_seconds(p.time_s), p.stored, p.compressed,
                   p.recomputed, p.status] for p in curve.points]
        lines += ["", f"== memory-time Pareto curve (codecs {', '.join(curve_codecs(trace))}; error "
                  f"budget {format_error(curve.risk_budget)})",
                  table(["budget", "memory", "vs GC", "vs store-all", "recovery", "store", "compress",
                         "recompute", "solver"], points)]
    return "\n".join(lines)


def curve_codecs(trace: Trace) -> tuple[str, ...]:
    """The codecs the Pareto curve may use: the defaults, of those the trace measured."""
    measured = {c for u in trace.units for c in u.codecs}
    return tuple(c for c in DEFAULT_CODECS if c in measured)


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
    for output in (args.png, args.plot):
        if output:
            check_output_path(output, inputs=[args.path])
    loaded = load_any(args.path)
    if isinstance(loaded, Plan):
        if args.png or args.curve or args.units:
            raise ValueError("--png, --curve and --units are for a trace; this file is a plan")
        print(render_plan(loaded))
        if args.plot:
            from .memplot import draw_memory

            draw_memory(loaded, args.plot)
            print(f"wrote {args.plot}")
        return 0
    if args.plot:
        raise ValueError("--plot is for a plan; this file is a trace (--png draws its Pareto curve)")
    curve = None
    if args.curve or args.png:
        curve = pareto_curve(loaded, points=args.points, codecs=curve_codecs(loaded),
                             options=SolverOptions(time_limit_s=args.time_limit))
    print(render_trace(loaded, curve, units=args.units))
    if args.png:
        draw_curve(curve, loaded, args.png)
        print(f"wrote {args.png}")
    return 0
