"""HiLoRe against every other method at every ceiling, from a frontier result file.

The frontier's own table (``frontier_report``) names one method per ceiling,
the fastest other that fits. Whether HiLoRe holds the bar against *each* peer
(PyTorch's planners among them) needs every pairing: per ceiling, HiLoRe's
speed over each fitting method's point, paired by round with its 95%
interval, from the per-step samples the result file keeps. Run it on a
committed result:

    python -m hilore_compiler.bench.peer_table bench/results/frontier-small-T2048-t1-peers-fixedheap.json

``--fastest`` prints the same pairings by each run's fastest counted step
instead: on a shared machine interference only ever adds time, so where it
hits steps at random the fastest step is each plan's least disturbed time.
A point estimate without an interval, beside the paired one, not instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .frontier import DOES_NOT_FIT, MEASURED
from .measure import StepSample
from .paired import PairedRatio, paired_ratio


@dataclass(frozen=True, slots=True, kw_only=True)
class Pairing:
    """HiLoRe's point at one ceiling against one other method's point there."""

    ceiling: float
    method: str
    #: The other method's run at this ceiling (None: it has no point here).
    run: str | None
    #: Whether the other point's measured peak fits the ceiling.
    fits: bool
    #: HiLoRe's speed over the other's, paired by round (None: no common round, no point, or
    #: the other's point is HiLoRe's own run, its plan being HiLoRe's).
    ratio: PairedRatio | None
    #: The other method planned HiLoRe's very decisions, so the bench measured HiLoRe's run for it.
    own: bool = False
    #: The frontier point's status (``frontier.MEASURED``, ``DOES_NOT_FIT``, ...): why a point has no run.
    status: str = MEASURED
    #: HiLoRe's speed over the other's by each run's fastest counted step (None where ``ratio`` is).
    fastest: float | None = None


def _samples(run: Mapping[str, Any]) -> list[StepSample]:
    return [StepSample(**s) for s in run.get("samples", [])]  # as the result file writes them (``asdict``)


def _fastest_step(samples: list[StepSample]) -> float | None:
    counted = [s.seconds for s in samples if s.round is not None]
    return min(counted) if counted else None


def pairings(result: Mapping[str, Any]) -> list[Pairing]:
    """Every (ceiling, other method) of a ``hilore bench --ceilings`` result, HiLoRe's ratio over it."""
    hilore = result.get("hilore_method", "hilore")
    runs, tokens = result["runs"], result["tokens_per_step"]
    mine = {p["ceiling"]: p["run"] for p in result["points"] if p["method"] == hilore and p["run"]}
    found = []
    for p in result["points"]:
        if p["method"] == hilore or p["ceiling"] not in mine:
            continue
        ours, theirs = runs.get(mine[p["ceiling"]]), runs.get(p["run"]) if p["run"] else None
        ratio = fastest = None
        own = p["run"] == mine[p["ceiling"]]
        if not own and ours is not None and theirs is not None and theirs.get("status") == "ok":
            ratio = paired_ratio(_samples(ours), _samples(theirs), tokens)
            steps = _fastest_step(_samples(ours)), _fastest_step(_samples(theirs))
            fastest = steps[1] / steps[0] if None not in steps else None
        found.append(Pairing(ceiling=p["ceiling"], method=p["method"], run=p["run"], fits=bool(p.get("fits")),
                             ratio=ratio, own=own, status=p.get("status", MEASURED), fastest=fastest))
    return found


def weakest(found: list[Pairing]) -> dict[float, Pairing]:
    """Per ceiling, the fitting peer against which HiLoRe's lower 95% end is lowest."""
    worst: dict[float, Pairing] = {}
    for p in found:
        if not p.fits or p.ratio is None:
            continue
        low = p.ratio.low if p.ratio.low is not None else p.ratio.ratio
        held = worst.get(p.ceiling)
        if held is None or low < (held.ratio.low if held.ratio.low is not None else held.ratio.ratio):
            worst[p.ceiling] = p
    return worst


def format_table(found: list[Pairing], *, fastest: bool = False) -> str:
    """A markdown table: a row per ceiling, a column per method (ratio [95%], or why none);
    ``fastest``: the ratio by fastest steps (``Pairing.fastest``) instead."""
    ceilings = sorted({p.ceiling for p in found})
    methods = list(dict.fromkeys(p.method for p in found))
    cell = {(p.ceiling, p.method): p for p in found}

    def text(p: Pairing | None) -> str:
        if p is None or p.run is None:
            # A searched or planned method with no run there may have found nothing under the ceiling.
            return DOES_NOT_FIT if p is not None and p.status == DOES_NOT_FIT else "no point"
        if p.own:
            return "HiLoRe's plan"
        if not p.fits:
            return "does not fit"
        if p.ratio is None:
            return "failed"
        if fastest:
            return f"{p.fastest:.3f}" if p.fastest is not None else "no step"
        r = p.ratio
        return f"{r.ratio:.3f}" if r.low is None else f"{r.ratio:.3f} [{r.low:.3f}, {r.high:.3f}]"

    lines = ["| ceiling x GC | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for c in ceilings:
        lines.append(f"| {c:g} | " + " | ".join(text(cell.get((c, m))) for m in methods) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hilore_compiler.bench.peer_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a hilore bench --ceilings result (JSON)")
    parser.add_argument("--fastest", action="store_true",
                        help="pair by each run's fastest counted step instead of by round (no interval)")
    args = parser.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
        found = pairings(result)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"peer_table: error: {args.result} is not a readable frontier result ({error})", file=sys.stderr)
        return 2
    print(format_table(found, fastest=args.fastest))
    if args.fastest:
        return 0
    for c, p in sorted(weakest(found).items()):
        print(f"{c:g}x: weakest pairing against {p.method} ({p.run}): {p.ratio.format()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
