"""Paired rounds: how ``hilore bench`` orders its methods' steps, settles them, and pairs
their speeds into ratios with intervals (``bench/rounds.py``, ``bench/paired.py``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hilore_compiler.bench.measure import StepSample
from hilore_compiler.bench.paired import geometric_interval, paired_ratio, t_quantile_975
from hilore_compiler.bench.report import summarise, to_json
from hilore_compiler.bench.rounds import MethodRun
from hilore_compiler.bench.runner import BenchConfig, BenchRun


def test_geometric_interval_of_known_log_ratios():
    # log ratios 0.1, 0.2, 0.3: mean 0.2, sd 0.1, n 3, t(0.975, 2) = 4.303.
    pr = geometric_interval([math.exp(0.1), math.exp(0.2), math.exp(0.3)])
    half = 4.303 * 0.1 / math.sqrt(3)
    assert pr.rounds == 3 and pr.ratio == pytest.approx(math.exp(0.2))
    assert (pr.low, pr.high) == pytest.approx((math.exp(0.2 - half), math.exp(0.2 + half)))
    assert pr.format() == "1.22x [0.95, 1.57]"
    assert geometric_interval([1.5]).low is None and geometric_interval([]) is None
    assert t_quantile_975(7) == 2.365 and t_quantile_975(1000) == pytest.approx(1.96, abs=1e-3)


def test_paired_ratio_pairs_round_medians():
    def steps(seconds_by_round):
        return [StepSample(seconds=s, peak_bytes=0, round=r) for r, ss in enumerate(seconds_by_round) for s in ss]

    # Round 1 is slow for both (a busy machine): pairing cancels it, ratio 2 every round.
    fast = steps([[1.0, 1.0, 5.0], [3.0, 3.0]]) + [StepSample(seconds=9.0, peak_bytes=0)]  # warm-up: ignored
    slow = steps([[2.0, 2.0], [6.0, 6.0], [1.0]])  # round 2: fast did not run it
    pr = paired_ratio(fast, slow, tokens=100)
    assert pr.rounds == 2 and pr.ratio == pytest.approx(2.0) and pr.low == pytest.approx(2.0)


def test_rounds_rotate_and_every_other_round_runs_backwards():
    from hilore_compiler.bench.rounds import measure_rounds

    asked: list[str] = []

    class Worker:
        def __init__(self, name):
            self.name = name

        def request(self, cmd, steps):
            asked.append(self.name)
            return {"samples": [{"seconds": 1.0, "peak_bytes": 0}] * steps}

    runs = [MethodRun(method=m, worker=Worker(m)) for m in "abc"]
    measure_rounds(runs, BenchConfig(model="tiny", repeats=4, steps_per_round=1, settle_rounds=0), lambda _: None)
    # Rotated by one each round, and rounds 1 and 3 backwards: round 3 is round 0's order reversed,
    # so of two neighbours (a, b) neither always goes first and a drift within a round favours neither.
    assert [asked[i:i + 3] for i in range(0, 12, 3)] == [list("abc"), list("acb"), list("cab"), list("cba")]


def test_settling_rounds_run_alternating_and_stay_out_of_the_ratios():
    from hilore_compiler.bench.rounds import measure_rounds

    class Worker:
        """Each method's first two steps after set-up are slow, as after a long wait."""

        def __init__(self, seconds):
            self.seconds, self.steps = seconds, 0

        def request(self, cmd, steps):
            self.steps += steps
            slow = [3.0 if i < 2 else 1.0 for i in range(self.steps - steps, self.steps)]
            return {"samples": [{"seconds": self.seconds * f, "peak_bytes": 0} for f in slow]}

    runs = [MethodRun(method="gc", worker=Worker(2.0)), MethodRun(method="hilore", worker=Worker(1.0))]
    said: list[str] = []
    config = BenchConfig(model="tiny", repeats=3, steps_per_round=2, settle_rounds=1)
    measure_rounds(runs, config, said.append)
    for run in runs:
        assert [s.round for s in run.settle] == [-1, -1] and [s.round for s in run.samples] == [0, 0, 1, 1, 2, 2]
    gc, hilore = runs
    assert paired_ratio(hilore.samples, gc.samples, tokens=1).ratio == pytest.approx(2.0)
    assert gc.settle[0].seconds == 6.0 and len(gc.samples) == 3 * 2
    assert said[0].startswith("settling round 1/1 (not counted)") and said[-1].startswith("round 3/3")
    # Without settling, the slow steps land in round 0 (tokens/s, not seconds, are paired).
    unsettled = [MethodRun(method="gc", worker=Worker(2.0)), MethodRun(method="hilore", worker=Worker(1.0))]
    measure_rounds(unsettled, dataclasses.replace(config, settle_rounds=0), lambda _: None)
    assert unsettled[0].samples[0].round == 0 and unsettled[0].samples[0].seconds == 6.0
    assert "settle" in to_json(summarise(BenchRun(config=config, device="cpu", runs=tuple(runs), budget_search=None,
                                                  run_dir=None)))["methods"][0]
    with pytest.raises(ValueError, match="settle_rounds"):
        BenchConfig(settle_rounds=-1)
