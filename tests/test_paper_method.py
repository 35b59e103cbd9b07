"""The ``paper`` method's recovery units (R, H, L) and its allocator."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from hilore_compiler.bench.paper_allocator import allocate
from hilore_compiler.bench.paper_layers import PaperRecovery
from hilore_compiler.bench.paper_recovery import ACTIONS, AFTER_CAPTURE

# --- the recovery units: R, H, L ---------------------------------------------------

class _ToyLayer(torch.nn.Module):
    """A layer whose MLP saves one tensor of its own (tanh's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).sum(-1, keepdim=True) * x


@pytest.mark.parametrize("capture", ["H", "L"])
def test_l_is_unavailable_where_the_fp8_value_is_not_finite(capture):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_ToyLayer()])
    recovery = PaperRecovery(model)
    x = torch.randn(3, 4)
    x[0, 0] = math.nan  # tanh's output, the L tensor, is NaN in that row
    recovery.begin([capture])
    out = model.layers[0](x.requires_grad_())
    bundle = recovery.bundles[0]
    assert bundle.selected is not None and bundle.in_mlp[bundle.selected]
    if capture == "L":  # found while packing: L is not offered
        assert bundle.nonfinite and bundle.available == {"R"}
        with pytest.raises(ValueError, match="not available"):
            recovery.select(["L"])
        recovery.select(["R"])
    else:  # found when H turns to L after the forward: the layer falls back to R
        assert recovery.select(["L"]) == ["R"] and bundle.nonfinite
    out.sum().backward()  # R replays the layer
    assert bundle.replays == 1
    recovery.close()
    assert "forward" not in vars(model.layers[0])


# --- the allocator -------------------------------------------------------------------

def _brute_force(utility, memory, risk, captures, available, memory_left, risk_left, intervals) -> float:
    """The best utility over every combination of actions, each cost rounded up to whole steps."""
    def options(i):
        for a, action in enumerate(ACTIONS):
            if action == "R":
                yield a, 0, 0
                continue
            if action not in AFTER_CAPTURE[captures[i]] or action not in available[i] or utility[i][a] <= 0:
                continue
            if action == "L" and risk_left == 0:
                continue
            cost_m, cost_r = memory[i][a], risk[i] if action == "L" else 0.0
            if (memory_left == 0 and cost_m > 0) or cost_m > memory_left or cost_r > risk_left:
                continue
            steps_m = 0 if memory_left == 0 else math.ceil(cost_m / (memory_left / intervals))
            steps_r = 0 if risk_left == 0 else math.ceil(cost_r / (risk_left / intervals))
            yield a, steps_m, steps_r

    best = -math.inf
    for combo in itertools.product(*(list(options(i)) for i in range(len(captures)))):
        if sum(c[1] for c in combo) <= intervals and sum(c[2] for c in combo) <= intervals:
            best = max(best, sum(utility[i][c[0]] for i, c in enumerate(combo)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_allocator_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    intervals = 16  # coarse enough that rounding up matters
    mixed = 0
    for _ in range(25):
        n = rng.randint(1, 5)
        captures = [rng.choice("RHHHLL") for _ in range(n)]
        available = [tuple(a for a in ACTIONS if a == "R" or rng.random() < 0.8) for _ in range(n)]
        utility = [[0.0, rng.uniform(-0.2, 1.0), rng.uniform(-0.2, 1.0)] for _ in range(n)]
        memory = [[0.0, rng.choice([0.0, rng.uniform(0, 100)]), rng.uniform(0, 60)] for _ in range(n)]
        risk = [rng.uniform(0, 0.05) for _ in range(n)]
        # Some budgets are zero, one is negative (the all-R plan alone does not fit): then all R.
        memory_left = rng.choice([0.0, -1.0, *(rng.uniform(0, 250) for _ in range(4))])
        risk_left = rng.choice([0.0, *(rng.uniform(0, 0.1) for _ in range(3))])
        got = allocate(utility, memory, risk, captures, available, memory_left, risk_left, intervals=intervals)
        best = _brute_force(utility, memory, risk, captures, available, memory_left, risk_left, intervals)
        if memory_left < 0:
            assert got.actions == ("R",) * n
        mixed += set(got.actions) != {"R"}
        assert got.utility == pytest.approx(best, abs=1e-12)
        assert sum(utility[i][ACTIONS.index(a)] for i, a in enumerate(got.actions)) == pytest.approx(best, abs=1e-12)
        assert sum(memory[i][ACTIONS.index(a)] for i, a in enumerate(got.actions)) <= max(memory_left, 0.0)
        assert sum(risk[i] for i, a in enumerate(got.actions) if a == "L") <= risk_left
        assert all(a in AFTER_CAPTURE[c] and a in av for a, c, av in zip(got.actions, captures, available))
    assert mixed >= 5  # many cases choose more than all R: the search is exercised


def test_the_allocator_gives_all_r_when_nothing_fits_and_breaks_ties_as_the_reference():
    utility, memory, risk = [[0.0, 1.0, 1.0]] * 2, [[0.0, 10.0, 5.0]] * 2, [0.01] * 2
    both = (("R", "H", "L"),) * 2
    # The all-R plan alone over the budget, or every cost over it: all R.
    assert allocate(utility, memory, risk, "HH", both, -1.0, 0.1).actions == ("R", "R")
    assert allocate(utility, memory, risk, "HH", both, 4.0, 0.1).actions == ("R", "R")
    # H and L save the same time: among equal utilities the lowest risk wins (H, H) ...
    assert allocate(utility, memory, risk, "HH", both, 100.0, 0.1).actions == ("H", "H")
    # ... and where only one H fits, H + L and L + H tie in every cost: at one state an action
    # wins only when strictly better, R, H, L in turn, so the last layer takes H.
    assert allocate(utility, memory, risk, "HH", both, 16.0, 0.1).actions == ("L", "H")
    assert allocate(utility, memory, risk, "HH", both, 16.0, 0.0).actions == ("H", "R")  # no risk budget, no L
    # Costs are rounded up: 10 + 5 bytes of a 15-byte budget take 683 + 342 > 1024 steps.
    assert allocate(utility, memory, risk, "HH", both, 15.0, 0.1).actions == ("L", "L")
    with pytest.raises(ValueError, match="R saves no time"):
        allocate([[1.0, 1.0, 1.0]], [[0.0, 1.0, 1.0]], [0.0], "H", both[:1], 1.0, 1.0)
