"""Measured costs summarised to a stated resolution, so that timing noise does not choose plans.

A measured trace holds each unit's median of a few timed runs. Two fresh
processes measure alike units (the same op in every layer) a few percent
apart, and the ILP then breaks the tie between near-equal options by that
noise: seven processes compiling one model gave five different plans. Rounded
to ``SIGNIFICANT_DIGITS``, alike units cost exactly the same, ties are broken
by the ILP's own (deterministic) order, and two processes agree unless a
median crosses a rounding boundary. Roofline and synthetic costs are
predictions, not measurements, and are left as they are.
"""

from __future__ import annotations

import dataclasses
import math

from ..tracefile import CodecCost, RecoveryUnit, Trace

#: Significant digits kept of a measured time: 2 keeps costs within 5% (the
#: largest rounding step, at 1.0x10^k) while medians of alike units, a few
#: percent apart on a busy 2-core machine, mostly land on one value.
SIGNIFICANT_DIGITS = 2

#: The cost source whose seconds are rounded.
MEASURED = "measured"


def round_seconds(seconds: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    """``seconds`` to ``digits`` significant digits (0 and non-finite values unchanged)."""
    if seconds == 0 or not math.isfinite(seconds):
        return seconds
    return round(seconds, digits - 1 - math.floor(math.log10(abs(seconds))))


def _codec(cost: CodecCost) -> CodecCost:
    if cost.source != MEASURED:
        return cost
    return dataclasses.replace(cost, time_s=round_seconds(cost.time_s))


def _unit(unit: RecoveryUnit) -> RecoveryUnit:
    recompute = round_seconds(unit.recompute_time_s) if unit.recompute_source == MEASURED else unit.recompute_time_s
    return dataclasses.replace(unit, recompute_time_s=recompute,
                               codecs={name: _codec(c) for name, c in unit.codecs.items()})


def round_measured_costs(trace: Trace) -> Trace:
    """``trace`` with every measured time rounded to ``SIGNIFICANT_DIGITS`` (``round_seconds``)."""
    return dataclasses.replace(trace, units=tuple(_unit(u) for u in trace.units))
