"""The lengths bench's figures from its records: ratios to GC paired by round at each length,
peaks against 1.10x GC's at the same length, failures kept as rows (no worker is started here)."""

from __future__ import annotations

import pytest

from hilore_compiler.bench.lengths import LengthsBenchConfig, render_lengths, summarise


def record(seconds: dict[int, list[float]], peaks: dict[int, int]) -> dict:
    """A method's record: per length, one step time per round."""
    samples = [{"seconds": s, "peak_bytes": 0, "length": n, "round": r}
               for n, per_round in seconds.items() for r, s in enumerate(per_round)]
    return {"status": "ok", "setup_s": 12.0, "samples": samples,
            "info": {"first_step_s": {str(n): 3.0 for n in seconds}, "dynamo_graphs": 2},
            "tensor_peak_bytes": {str(n): p for n, p in peaks.items()},
            "fidelity": {str(n): {"cosine": 1.0, "rel_l2": 0.0, "reference": "store-all"} for n in seconds}}


def test_ratios_are_paired_by_round_at_each_length_and_peaks_held_to_gcs_at_that_length():
    config = LengthsBenchConfig(lengths=(256, 512), methods=("gc", "hilore-range"), repeats=3)
    methods = {
        # The machine slows down in round 2 for both: the paired ratio is unmoved by it.
        "gc": record({256: [1.0, 2.0, 1.0], 512: [2.0, 4.0, 2.0]}, {256: 100, 512: 200}),
        "hilore-range": record({256: [0.8, 1.6, 0.8], 512: [2.0, 4.0, 2.0]}, {256: 105, 512: 230}),
        "hilore-static": {"status": "failed", "error": "WorkerError: out of memory"},
    }
    out = summarise(methods, config)
    rows = {r["method"]: r for r in out["256"]}
    assert rows["hilore-range"]["x_gc"]["ratio"] == pytest.approx(1.25)
    assert rows["hilore-range"]["x_gc"]["low"] == pytest.approx(1.25)  # no spread: the slow round cancels
    assert rows["hilore-range"]["fits"] and rows["hilore-range"]["x_gc_peak"] == pytest.approx(1.05)
    at_512 = {r["method"]: r for r in out["512"]}
    assert at_512["hilore-range"]["x_gc"]["ratio"] == pytest.approx(1.0)
    assert not at_512["hilore-range"]["fits"]  # 230 > 1.10 x 200
    assert rows["hilore-static"]["status"] == "failed"
    table = render_lengths({"lengths": out, "methods": methods})
    assert "### T = 512" in table and "failed: WorkerError: out of memory" in table
    assert "| hilore-range | 12.0 | 2 |" in table


def test_the_config_names_what_it_cannot_run():
    with pytest.raises(ValueError, match="gc always"):
        LengthsBenchConfig(methods=("store-all",))
    with pytest.raises(ValueError, match="two or more distinct"):
        LengthsBenchConfig(lengths=(512,))
