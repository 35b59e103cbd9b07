"""Plans over a range of sequence lengths (``solver/lengths.py``): each plan holds
its ceiling at every length it was checked at, x-gc ceilings follow GC's peak there, time is
minimised over the length mix, and length buckets cover the range and pay for themselves."""

from __future__ import annotations

import math

import pytest

from hilore_compiler.planload import load_plan
from hilore_compiler.solver import solve
from hilore_compiler.solver.lengths import (LENGTH_BUCKET_PRICE, length_grid, length_weights, mixed_time_s,
                                            plan_for_length, solve_length_buckets, solve_range)
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

#: Two layers at a sequence of 256: a few dozen units, an ILP of a second or so.
CONFIG = SyntheticConfig(num_layers=2, hidden=256, intermediate=688, heads=4, kv_heads=2, vocab=512,
                         batch=2, seq_len=256, codecs=("bf16", "int8"))


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(CONFIG)


def test_grid_spans_the_range_evenly_in_log_length():
    grid = length_grid(256, 4096)
    assert grid == (256, 512, 1024, 2048, 4096)
    assert length_grid(300, 300) == (300,)
    with pytest.raises(ValueError, match="lo <= hi"):
        length_grid(512, 256)


def test_uniform_mix_weighs_each_grid_length_by_the_lengths_nearest_it():
    weights = length_weights((256, 512, 1024), None)
    assert math.isclose(sum(weights), 1.0)
    # 256 stands for [256, 384), 512 for [384, 768), 1024 for [768, 1024]
    assert weights == pytest.approx((128 / 768, 384 / 768, 256 / 768))
    assert length_weights((256, 512, 1024), [250, 260, 1000, 1100]) == (0.5, 0.0, 0.5)


def test_a_range_plan_fits_each_lengths_own_ceiling(trace):
    plan = solve_range(trace, (64, 1024), "1.0x-gc", buckets=1)
    assert plan.seq_range == (64, 1024) and plan.seq_len == 1024 and plan.covers(300) and not plan.covers(2000)
    assert [p.seq_len for p in plan.lengths] == list(length_grid(64, 1024))
    for point in plan.lengths:
        # x-gc: the ceiling at each length is GC's modelled peak there, not a scaled copy of hi's.
        assert point.budget_bytes == math.floor(1.0 * point.gc_bytes)
        assert max(point.memory_bytes.values()) <= point.budget_bytes, point
    assert plan.lengths[0].budget_bytes < plan.budget_bytes


def test_the_range_plan_is_timed_over_the_mix_and_saved_as_data(trace, tmp_path):
    short = solve_range(trace, (64, 1024), "1.0x-gc", buckets=1, length_mix=[64] * 9 + [1024])
    long = solve_range(trace, (64, 1024), "1.0x-gc", buckets=1, length_mix=[64] + [1024] * 9)
    assert short.lengths[0].weight == pytest.approx(0.9) and long.lengths[-1].weight == pytest.approx(0.9)
    path = short.save(tmp_path / "range.json")
    again = load_plan(path)
    assert again.seq_range == short.seq_range and again.lengths == short.lengths


def test_one_length_is_the_static_plan(trace):
    ranged = solve_range(trace, (512, 512), "1.0x-gc", buckets=1)
    static = solve(trace, "1.0x-gc", buckets=1, seq_len=512)
    assert ranged.seq_range is None and ranged.lengths == ()
    assert ranged.bucket("b0").decisions == static.bucket("b0").decisions


@pytest.mark.slow
def test_length_buckets_cover_the_range_and_pay_their_price(trace):
    plans = solve_length_buckets(trace, (64, 1024), "0.9x-gc", max_buckets=3, buckets=1)
    ranges = [p.length_range for p in plans]
    assert ranges[0][0] == 64 and ranges[-1][1] == 1024
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:])), f"gaps or overlaps in {ranges}"
    assert plan_for_length(plans, 700).covers(700) and plan_for_length(plans, 5000) is None
    for plan in plans:
        for point in plan.lengths:
            assert max(point.memory_bytes.values()) <= point.budget_bytes
    if len(plans) > 1:  # a split is kept only where it saves more than its price
        one = solve_range(trace, (64, 1024), "0.9x-gc", buckets=1)
        weights = length_weights(length_grid(64, 1024), None)
        split = sum(sum(w for w, p in zip(weights, one.lengths) if plan.covers(p.seq_len)) * mixed_time_s(plan)
                    for plan in plans)
        assert split + LENGTH_BUCKET_PRICE * mixed_time_s(one) * (len(plans) - 1) < mixed_time_s(one)


def test_the_backend_takes_length_bucket_plans_as_a_list(trace):
    """``options={"plan": [...]}``: the length buckets' plan files, in any order; a range they do not
    cover, without a trace to re-solve from, is refused with both ranges named."""
    import dataclasses

    from hilore_compiler.backend.lengths import PlanShapeError
    from hilore_compiler.backend.options import BackendOptions
    from hilore_compiler.backend.planning import given_plans

    # As read from files: no trace comes with them.
    short = dataclasses.replace(solve_range(trace, (64, 255), "1.0x-gc", buckets=1), trace=None)
    long = dataclasses.replace(solve_range(trace, (256, 1024), "1.0x-gc", buckets=1), trace=None)
    options = BackendOptions.from_mapping({"plan": [long, short]})
    assert given_plans(options, 2, (100, 900)) == (short, long)
    with pytest.raises(PlanShapeError, match=r"64-255, 256-1024 .* sequences 100 to 2000"):
        given_plans(options, 2, (100, 2000))
    with pytest.raises(ValueError, match="a list of them"):
        BackendOptions.from_mapping({"plan": []})


def test_a_plan_from_solve_carries_its_trace_and_is_re_solved_for_a_new_length(trace):
    """The README's plan (``solve``) at a length it was not made for: re-solved from the trace it
    carries; one read from a file takes ``options['trace']`` as a ``Trace`` or a path."""
    import dataclasses

    from hilore_compiler.backend.options import BackendOptions
    from hilore_compiler.backend.planning import given_plans

    plan = solve(trace, "1.0x-gc", buckets=1, seq_len=256)
    assert plan.trace is trace and "trace" not in plan.to_json()
    (again,) = given_plans(BackendOptions.from_mapping({"plan": plan, "verbose": False}), 2, (96, 96))
    assert (again.batch, again.seq_len) == (2, 96) and again.fingerprint == plan.fingerprint
    from_file = dataclasses.replace(plan, trace=None)
    options = BackendOptions.from_mapping({"plan": from_file, "trace": trace, "verbose": False})
    assert given_plans(options, 2, (96, 96))[0].bucket("b0").decisions == again.bucket("b0").decisions


def test_a_wrong_trace_option_names_its_type_in_one_line(trace):
    from hilore_compiler.backend.options import BackendOptions

    with pytest.raises(ValueError) as info:
        BackendOptions.from_mapping({"trace": [trace]})
    message = str(info.value)
    assert "a Trace, a path to a trace JSON, or None" in message and len(message) < 300, message
