"""CBC, the MILP solver behind the ILP: finding it, running it, reading what it proved.

PuLP builds the problem (``ilp.py``); this module finds a CBC binary PuLP can
run, says how to get one when there is none, runs it under a time limit and
reads its status, objective and, when it stopped early, its proven bound.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pulp

from ..progress import PROGRESS_INTERVAL_S

__all__ = ["CbcRun", "NoPlanInTime", "SolverOptions", "SolverUnavailableError", "check_cbc", "reporting",
           "run_cbc"]

#: Who hears how a running CBC is doing (``reporting``); None: nobody.
_LISTENER: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "hilore_cbc_listener", default=None)


class SolverUnavailableError(RuntimeError):
    """CBC, the MILP solver the planner runs, cannot be found."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SolverOptions:
    """How hard CBC works on each bucket."""

    #: Wall seconds per ILP; then CBC returns its best plan so far (status
    #: ``feasible``, with the gap it proved). Traces of one or two layers and the
    #: small graphs of the tests solve to optimality in a second or less. On a
    #: 32-layer trace CBC's feasibility pump finds its plan within ~3 s but cannot
    #: prove it optimal in minutes (the layers are near-identical, so branching
    #: on which of 32 alike layers takes which pattern does not move the bound);
    #: the proven gap at 4 s is about 0.5-1.5% of recovery time.
    time_limit_s: float = 4.0
    #: Relative MIP gap at which CBC may stop; 0 asks for proven optimality.
    gap_rel: float = 0.0
    #: CBC threads; None leaves CBC's default (one).
    threads: int | None = None
    #: Decide the members of a block class by a few shared patterns
    #: (``tying.py``), so the ILP's size does not grow with depth; False
    #: solves the full ILP, one decision per unit.
    tie_blocks: bool = True


class NoPlanInTime(RuntimeError):
    """CBC stopped at the time limit without any plan."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CbcRun:
    """What one CBC run found, in the problem's own units."""

    #: True when CBC proved the objective optimal (else it stopped at the time limit).
    optimal: bool
    objective: float
    #: CBC's proven lower bound when it stopped early; None if its log has none.
    bound: float | None
    seconds: float


def cbc_solver(**options: object) -> pulp.LpSolver | None:
    """A CBC that PuLP can run: the binary bundled with PuLP, else one on PATH.

    PuLP 3.3 deprecates PULP_CBC_CMD (the bundled binary) in favour of COIN_CMD
    with ``pip install pulp[cbc]``; until 4.0 the bundled one is what ``pip
    install pulp`` provides, so its deprecation warning is silenced here only.
    """
    for name in ("PULP_CBC_CMD", "COIN_CMD"):
        kind = getattr(pulp, name, None)
        if kind is None:
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
            solver = kind(**options)
        if solver.available():
            return solver
    return None


def check_cbc() -> None:
    """Raise SolverUnavailableError, saying how to get CBC, if PuLP cannot run it."""
    if cbc_solver(msg=False) is None:
        raise SolverUnavailableError(
            "the CBC solver is not available to PuLP: pulp.PULP_CBC_CMD().available() is "
            "false. `pip install pulp` ships a CBC binary for common platforms (PuLP >= 3.3: "
            "`pip install pulp[cbc]`); otherwise install it (`apt-get install coinor-cbc`) "
            "and point PuLP at it with pulp.PULP_CBC_CMD(path='/usr/bin/cbc')"
        )


def run_cbc(prob: pulp.LpProblem, *, time_limit_s: float, options: SolverOptions,
            warm_start: bool = False) -> CbcRun | None:
    """Solve ``prob`` with CBC within ``time_limit_s``; None if it is infeasible.

    Raises:
        SolverUnavailableError: no CBC PuLP can run.
        NoPlanInTime: CBC stopped at the time limit without any solution.
    """
    with tempfile.TemporaryDirectory(prefix="hilore-cbc-") as tmp:
        log = Path(tmp) / "cbc.log"
        cbc = cbc_solver(msg=False, timeLimit=time_limit_s, gapRel=options.gap_rel,
                         threads=options.threads, logPath=str(log), warmStart=warm_start)
        if cbc is None:
            check_cbc()  # raises, saying how to get CBC
        began = time.perf_counter()
        with _watched(log, time_limit_s):
            prob.solve(cbc)
        seconds = time.perf_counter() - began
        text = log.read_text() if log.exists() else ""
    if prob.status == pulp.LpStatusInfeasible:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise NoPlanInTime(f"CBC found no plan within {time_limit_s} s "
                           f"(status {pulp.LpStatus[prob.status]}); raise the time limit")
    # Stopped at the relative gap (``gap_rel``): PuLP says optimal, CBC's log
    # says within the tolerance and gives the bound, which the plan then states.
    optimal = prob.sol_status == pulp.LpSolutionOptimal and "within gap tolerance" not in text
    return CbcRun(optimal=optimal, objective=pulp.value(prob.objective) or 0.0,
                  bound=None if optimal else _lower_bound(text), seconds=seconds)


def _lower_bound(log: str) -> float | None:
    """CBC's best bound when it stopped early, from its log, in ILP units.

    (CBC's own "Gap:" line is rounded to two decimals, too coarse to report.)
    """
    found = re.search(r"^Lower bound:\s*([-+0-9.eE]+)", log, re.MULTILINE)
    return float(found[1]) if found else None


@contextlib.contextmanager
def reporting(say: Callable[[str], None]) -> Iterator[None]:
    """While inside, every CBC run lasting over ``PROGRESS_INTERVAL_S`` tells ``say`` how it is
    doing, once per interval: seconds spent of its limit, whether it has a plan yet, the gap proven.

    A context rather than an argument, since the runs sit several solve
    strategies below the planner that owns the progress lines.
    """
    token = _LISTENER.set(say)
    try:
        yield
    finally:
        _LISTENER.reset(token)


@contextlib.contextmanager
def _watched(log: Path, time_limit_s: float) -> Iterator[None]:
    """Report on the CBC run writing ``log`` from a thread, while the caller waits on it."""
    say = _LISTENER.get()
    if say is None:
        yield
        return
    done = threading.Event()
    began = time.monotonic()

    def watch() -> None:
        while not done.wait(PROGRESS_INTERVAL_S):
            say(cbc_status(log.read_text() if log.exists() else "", time.monotonic() - began, time_limit_s))

    thread = threading.Thread(target=watch, name="hilore-cbc-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def cbc_status(log: str, elapsed_s: float, time_limit_s: float) -> str:
    """One progress line from what CBC has logged so far.

    CBC's log reaches the file in blocks (its output is buffered), so the
    latest plan and bound may lag a little; the seconds do not.
    """
    # Incumbents appear as "Integer solution of X" and, in node reports, "X best solution".
    found = re.findall(r"Integer solution of\s+([-+0-9.eE]+)|([-+0-9.eE]+) best solution", log)
    found = [a or b for a, b in found]
    bounds = re.findall(r"best possible\s+([-+0-9.eE]+)", log)
    where = f"CBC has run {elapsed_s:.0f} s of at most {time_limit_s:.0f} s"
    if not found:
        return f"{where}; no plan yet"
    best = float(found[-1])
    if bounds and best > 0:
        gap = max(best - float(bounds[-1]), 0.0) / best
        return f"{where}; a plan found, within {gap:.1%} of optimal"
    return f"{where}; a plan found, improving it"
