"""The paper's per-step allocation: a dynamic program over (memory left, risk left).

HiLoRe's reference allocator (``ChnIRuI/HiLoRe``, ``hilore/allocator.py``, the paper's
Appendices B.2-B.3) in our own code. Each layer takes one action of ``ACTIONS`` = R, H, L;
the program maximises the measured time saved, sum of ``utility[i, a]`` (seconds), subject to

    sum_i memory[i, a_i] <= memory_left     (marginal peak bytes over the all-R plan's peak)
    sum_i risk[i]  [a_i = L] <= risk_left    (predicted gradient error of L)

Both axes are cut into ``INTERVALS`` equal steps and every cost is rounded *up* to whole steps,
so a choice that fits the steps fits the real budgets. As the reference: R costs and saves
nothing and is always allowed; H and L are allowed only where the capture kept them, the
step's bundle offers them and their utility is positive; a cost over its budget rules its
action out; a zero memory budget allows only zero-memory actions, a zero risk budget no L.
Ties: at each state an action replaces the best so far only when strictly better, in the order
R, H, L (R wins a tie); among the final states the lowest risk, then the lowest memory, wins.
One addition: a negative ``memory_left`` (the all-R plan alone over the budget, which the
reference's scheduler avoids by falling back to its all-R capture) gives all R, not an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .recovery import ACTIONS, AFTER_CAPTURE

#: Steps per budget axis (the reference's ``memory_intervals`` and ``risk_intervals``).
INTERVALS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    """The allocator's answer for one step."""

    #: One action of ``ACTIONS`` per layer.
    actions: tuple[str, ...]
    #: Seconds the actions save over all R, as the program sums them.
    utility: float


def allocate(utility: Sequence[Sequence[float]], memory: Sequence[Sequence[float]], risk: Sequence[float],
             captures: Sequence[str], available: Sequence[Sequence[str]], memory_left: float, risk_left: float,
             intervals: int = INTERVALS) -> Allocation:
    """The best actions: ``utility``/``memory`` (n, 3) in ``ACTIONS``' columns, ``risk`` (n,) L's risk,
    ``available`` each layer's offered actions; see the module docstring."""
    u, m, r = (np.asarray(x, dtype=np.float64) for x in (utility, memory, risk))
    n = len(captures)
    _check(u, m, r, n, risk_left)
    if memory_left < 0:  # the all-R plan's peak is already over the budget
        return Allocation(actions=("R",) * n, utility=0.0)
    allowed = _allowed(u, captures, available, risk_left)
    mem_steps, allowed = _steps(m, memory_left, intervals, allowed, columns=(0, 1, 2))
    risk_cost = np.zeros_like(m)
    risk_cost[:, 2] = r
    risk_steps, allowed = _steps(risk_cost, risk_left, intervals, allowed, columns=(2,))
    nb = intervals if memory_left > 0 else 0
    nr = intervals if risk_left > 0 else 0
    chosen, value = _solve(u, mem_steps, risk_steps, allowed, nb, nr)
    return Allocation(actions=tuple(ACTIONS[a] for a in chosen), utility=value)


def _check(u: np.ndarray, m: np.ndarray, r: np.ndarray, n: int, risk_left: float) -> None:
    if u.shape != (n, len(ACTIONS)) or m.shape != u.shape or r.shape != (n,):
        raise ValueError(f"utility and memory must be ({n}, 3) and risk ({n},)")
    if not (np.isfinite(u).all() and np.isfinite(m).all() and np.isfinite(r).all()):
        raise ValueError("allocation inputs must be finite")
    if (m < 0).any() or (r < 0).any():
        raise ValueError("memory and risk costs must be non-negative")
    if (u[:, 0] != 0).any() or (m[:, 0] != 0).any():
        raise ValueError("R saves no time and costs no memory: its column must be zero")
    if not (math.isfinite(risk_left) and risk_left >= 0):
        raise ValueError(f"the risk budget must be finite and non-negative, got {risk_left}")


def _allowed(u: np.ndarray, captures: Sequence[str], available: Sequence[Sequence[str]],
             risk_left: float) -> np.ndarray:
    """(n, 3) bool: kept by the capture, offered by the bundle, and (H, L) saving time."""
    allowed = np.zeros(u.shape, dtype=bool)
    for i, (capture, offered) in enumerate(zip(captures, available, strict=True)):
        if "R" not in offered:
            raise ValueError(f"layer {i}: R must always be available, got {sorted(offered)}")
        for a, action in enumerate(ACTIONS):
            allowed[i, a] = action in AFTER_CAPTURE[capture] and action in offered and (a == 0 or u[i, a] > 0)
    if risk_left == 0:
        allowed[:, 2] = False
    return allowed


def _steps(cost: np.ndarray, left: float, intervals: int, allowed: np.ndarray,
           columns: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Costs in whole steps of ``left / intervals``, rounded up; actions whose cost exceeds ``left``
    (with ``left`` 0: any positive cost) ruled out."""
    steps = np.zeros(cost.shape, dtype=np.int64)
    allowed = allowed.copy()
    for a in columns:
        if left == 0:
            allowed[:, a] &= cost[:, a] == 0
            continue
        over = cost[:, a] > left
        allowed[over, a] = False
        step = left / intervals
        steps[~over, a] = [math.ceil(c / step) for c in cost[~over, a]]
    return steps, allowed


def _solve(u: np.ndarray, mem: np.ndarray, risk: np.ndarray, allowed: np.ndarray, nb: int,
           nr: int) -> tuple[list[int], float]:
    """The program over exact usage states (m, r): ``best[m, r]`` is the most utility with the
    layers so far using exactly m memory and r risk steps; returns the actions and their utility.

    ``best`` covers only the states the layers so far can reach (a box growing from (0, 0)),
    every state outside it unreachable (-inf in the reference's full table), so the answer
    is the reference's, in a fraction of the work while the budgets are far from full.
    """
    best = np.zeros((1, 1))
    choices = []
    for i in range(u.shape[0]):
        # A cost rounded up past the last step fits no state.
        steps = [(a, mem[i, a], risk[i, a]) for a in range(len(ACTIONS))
                 if allowed[i, a] and mem[i, a] <= nb and risk[i, a] <= nr]
        shape = (min(nb, best.shape[0] - 1 + max(s[1] for s in steps)) + 1,
                 min(nr, best.shape[1] - 1 + max(s[2] for s in steps)) + 1)
        current = np.full(shape, -np.inf)
        choice = np.full(shape, -1, dtype=np.int8)
        for a, dm, dr in steps:  # R, H, L: a later action must be strictly better to win a state
            rows, cols = min(best.shape[0], shape[0] - dm), min(best.shape[1], shape[1] - dr)
            source = best[:rows, :cols] + u[i, a]
            target = current[dm:dm + rows, dr:dr + cols]
            better = source > target
            np.copyto(target, source, where=better)
            choice[dm:dm + rows, dr:dr + cols][better] = a
        best = current
        choices.append(choice)
    # Row-major over (r, m): the first maximum has the lowest risk, then the lowest memory.
    r_end, m_end = divmod(int(np.argmax(best.T)), best.shape[0])
    value = float(best[m_end, r_end])
    chosen = [0] * u.shape[0]
    for i in range(u.shape[0] - 1, -1, -1):
        a = int(choices[i][m_end, r_end])
        chosen[i] = a
        m_end, r_end = m_end - mem[i, a], r_end - risk[i, a]
    return chosen, value
