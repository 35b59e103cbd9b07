"""How far one plan may go: the most recovery units a trace may have, and the wall time of its ILPs.

Planning runs inside a compile (the backend) and in ``hilore plan``; neither
may hang or grow without bound. A trace with more units than ``max_units`` is
refused before it is validated or costed (reading 100,000 units' sizes takes
about 40 s on its own), and one plan's ILP builds and CBC runs share one
deadline: each CBC run gets at most its share of the time left, and a phase
that would start past the deadline raises ``PlanningTimeoutError``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from ..jsonio import read_json
from ..tracefile import TRACE_SCHEMA, Trace, trace_from_json
from .cbc import SolverOptions

#: The most recovery units one plan is made for. A 32-layer, hidden-4096
#: decoder has about 600 and a per-block compile a few dozen; the synthetic
#: 10,000-unit trace plans in about 25 s (block classes tied, ``tying.py``).
#: Above this the trace alone takes tens of seconds to read and validate.
MAX_UNITS = 20_000

#: Wall seconds one plan's ILP builds and CBC runs may take together. The
#: 10,000-unit synthetic trace needs about 25 s; real models' traces a few.
TOTAL_TIME_S = 120.0

#: The least time a CBC run is given, however little is left: below about a
#: second CBC cannot even read a large problem, and a run that finds nothing
#: is worth less than one that overshoots the deadline by a second.
MIN_CBC_S = 1.0


class TooManyUnitsError(ValueError):
    """The trace has more recovery units than one plan is made for."""


class PlanningTimeoutError(RuntimeError):
    """Planning ran past its total time limit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanningLimits:
    """Bounds on one plan: its size and its time."""

    #: Traces with more recovery units are refused (``TooManyUnitsError``).
    max_units: int = MAX_UNITS
    #: Wall seconds for every ILP build and CBC run of one plan together.
    total_time_s: float = TOTAL_TIME_S

    def __post_init__(self) -> None:
        if isinstance(self.max_units, bool) or not isinstance(self.max_units, int) or self.max_units < 1:
            raise ValueError(f"max_units must be a positive int, got {self.max_units!r}")
        if not (isinstance(self.total_time_s, (int, float)) and self.total_time_s > 0):
            raise ValueError(f"total_time_s must be a positive number of seconds, got {self.total_time_s!r}")


def check_units(count: int, what: str, limits: PlanningLimits) -> None:
    """Raise TooManyUnitsError if ``count`` units are more than ``limits`` plan."""
    if count > limits.max_units:
        raise TooManyUnitsError(
            f"{what} has {count} recovery units, more than the {limits.max_units} one plan is made for "
            "(PlanningLimits.max_units): trace the model per decoder block (distributed.compile_blocks) "
            "or plan a shallower stand-in, whose plan holds per layer")


def load_bounded(path: str | os.PathLike, limits: PlanningLimits) -> Trace:
    """Read a trace file, refusing one with too many units before its sizes are parsed and checked."""
    payload = read_json(path, TRACE_SCHEMA)
    units = payload.get("units")
    check_units(len(units) if isinstance(units, list) else 0, f"the trace {path}", limits)
    return trace_from_json(payload, where=str(path))


class Deadline:
    """The wall-clock end of one plan's ILP builds and CBC runs."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def check(self, phase: str) -> None:
        """Raise PlanningTimeoutError if the deadline passed before ``phase`` starts."""
        if self.remaining() <= 0:
            raise PlanningTimeoutError(
                f"planning ran past its {self.seconds:g} s limit before {phase} (PlanningLimits.total_time_s): "
                "allow more time, or fewer buckets or units")

    def share(self, options: SolverOptions, runs: int) -> SolverOptions:
        """``options`` with each CBC run limited to 1/``runs`` of the time left (at least ``MIN_CBC_S``)."""
        per_run = max(MIN_CBC_S, min(options.time_limit_s, self.remaining() / max(runs, 1)))
        return dataclasses.replace(options, time_limit_s=per_run)
