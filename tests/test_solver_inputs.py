"""What the solver takes: shapes other than the traced one, codecs, buckets, budgets, and bad input."""

from __future__ import annotations

import math

import pulp
import pytest

from hilore_compiler.planfile import COMPRESS_PREFIX
from hilore_compiler.solver import BucketSpec, SolverUnavailableError, default_buckets, parse_budget, solve
from hilore_compiler.solver.risk import bucket_specs
from hilore_compiler.solver.synthetic import SyntheticConfig, random_trace, synthetic_trace
from hilore_compiler.vocabulary import in_bucket

ONE_BUCKET = [BucketSpec("b", 0.0, math.inf, 1.0)]  # holds every nonzero sample: mass share 1
RISK = 1e-3  # binds on the random graphs: their squared sensitivities are 2.5e-5..1e-2


def test_other_shape_reevaluates_sizes_and_scales_times():
    small = SyntheticConfig(num_layers=1, hidden=64, intermediate=172, heads=4, kv_heads=2, vocab=128,
                            batch=2, seq_len=16)
    trace = synthetic_trace(small)
    here = solve(trace, "0.85x-store", buckets=1, codecs="int8")
    there = solve(trace, "0.85x-store", buckets=1, codecs="int8", batch=4, seq_len=32)
    assert (there.batch, there.seq_len) == (4, 32)
    assert there.gc_bytes == 4 * here.gc_bytes and there.store_bytes == 4 * here.store_bytes
    unit_here, unit_there = here.units[3], there.units[3]
    assert unit_there.bytes == 4 * unit_here.bytes
    cost = {o.option: o.time_s for o in unit_here.options}
    for o in unit_there.options:
        assert o.time_s == pytest.approx(4 * cost[o.option])
    assert any("seconds scaled by bytes" in n for n in there.notes)


def test_codec_selection_and_unknown_codec():
    trace = random_trace(3, num_units=5)
    plain = solve(trace, "1x-store", risk_budget=RISK, buckets=ONE_BUCKET, codecs=[])
    assert not any(o.startswith(COMPRESS_PREFIX) for o in plain.decisions("b").values())
    assert plain.codecs == ()
    with pytest.raises(ValueError, match=r"unknown codec\(s\) \['zstd'\].*measured \['bf16', 'int8'\]"):
        solve(trace, "0.9x-store", codecs="int8,zstd")


def test_buckets_default_and_explicit():
    specs = default_buckets(3)
    assert [s.name for s in specs] == ["b0", "b1", "b2"]
    assert specs[0].lo == 0.0 and math.isinf(specs[-1].hi)
    assert all(a.hi == b.lo for a, b in zip(specs, specs[1:]))  # contiguous
    # Quantiles of GRPO's default mix: each bucket holds a fair share of the nonzero samples.
    from hilore_compiler.solver.mix import bucket_shares, default_exposure_mix, zero_share
    mix = default_exposure_mix()
    assert zero_share(mix) == pytest.approx(2 / 9)  # groups of 8 all right or all wrong
    shares = bucket_shares(specs, mix)
    assert all(0.1 < s.samples < 0.5 for s in shares)
    assert sum(s.samples for s in shares) == pytest.approx(7 / 9)
    assert sum(s.mass for s in shares) == pytest.approx(1.0)
    # A bucket's error share is its share of the squared exposures: the top
    # bucket's few high-exposure samples weigh more than their mass share.
    squares = [sum(x * x for x in mix if x > 0 and in_bucket(x, s.spec.lo, s.spec.hi)) for s in shares]
    assert [s.error for s in shares] == pytest.approx([q / sum(squares) for q in squares])
    assert shares[0].error < shares[0].mass and shares[-1].error > shares[-1].mass
    # Off-policy: bounds pick the buckets, expected exposures weigh them. A
    # bound that overstates the top bucket's samples must not lower b0's share.
    bounds = [2 * x if x > 1 else x for x in mix]
    split = bucket_specs(3, bounds)
    weighted = bucket_shares(split, bounds, gradient_exposures=mix)
    by_bound = bucket_shares(split, bounds)
    assert [s.samples for s in weighted] == [s.samples for s in by_bound]
    assert weighted[0].error > by_bound[0].error and weighted[-1].error < by_bound[-1].error
    with pytest.raises(ValueError, match="gradient_exposures"):
        bucket_shares(split, bounds, gradient_exposures=mix[:-1])
    trace = random_trace(5, num_units=4)
    plan = solve(trace, "0.9x-store", buckets=[("lo", 0, 1, 1), BucketSpec("hi", 1, math.inf, 8)])
    assert plan.bucket_names == ("zero", "lo", "hi")
    for bad in ([("zero", 0, 1, 1)], [("a", 0, 2, 1), ("b", 1, 3, 2)], [("a", 1, 0, 1)], 0, []):
        with pytest.raises(ValueError):
            solve(trace, "0.9x-store", buckets=bad)


@pytest.mark.parametrize("text, expected", [
    ("123456", 123456), (123456, 123456), ("6GiB", 6 * 2**30), ("750MB", 750 * 10**6),
    ("1.5 KiB", 1536), ("2kb", 2000), ("1e3", 1000), ("1.10x-gc", 1100), ("0.5x-store", 5000),
    ("2X-GC", 2000),
])
def test_budget_forms(text, expected):
    assert parse_budget(text).bytes_at(gc_bytes=1000, store_bytes=10000) == expected


@pytest.mark.parametrize("text", ["-1GB", "-0.5x-gc", "0", "0x-gc", "abc", "5 parsecs", "1.1x-foo",
                                  "", "x-gc", None, True, "0.5"])
def test_bad_budgets_name_the_accepted_forms(text):
    with pytest.raises(ValueError, match="accepted: .*'6GiB'.*'1.10x-gc'.*'0.5x-store'"):
        parse_budget(text)


def test_negative_risk_budget_and_bad_shape():
    trace = random_trace(1, num_units=4)
    with pytest.raises(ValueError, match="risk budget"):
        solve(trace, "0.9x-store", risk_budget=-1)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        solve(trace, "0.9x-store", seq_len=0)


def test_missing_cbc_says_how_to_get_it(monkeypatch):
    for name in ("PULP_CBC_CMD", "COIN_CMD"):
        monkeypatch.setattr(getattr(pulp, name), "available", lambda self: False)
    with pytest.raises(SolverUnavailableError, match="pip install pulp.*coinor-cbc.*PULP_CBC_CMD"):
        solve(random_trace(1, num_units=4), "0.9x-store")


def test_a_plan_file_is_not_a_trace(tmp_path):
    trace = random_trace(1, num_units=4)
    path = solve(trace, "0.9x-store").save(tmp_path / "plan.json")
    with pytest.raises(ValueError, match="it is a plan, not a trace"):
        solve(path, "0.9x-store")
    with pytest.raises(TypeError):
        solve({"schema": "hilore.trace/v1"}, "0.9x-store")
