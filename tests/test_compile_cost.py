"""``hilore bench --compile-cost``: the report's ratios and table (the compiles themselves are the bench's)."""

from __future__ import annotations

import pytest

from hilore_compiler.bench.compile_cost import format_table, ratios
from hilore_compiler.cli import build_parser

ROWS = [
    {"layers": 2, "method": "inductor", "status": "ok", "first_s": 100.0, "step_s": 0.5, "kernels": 18},
    {"layers": 2, "method": "hilore", "status": "ok", "first_s": 125.0, "step_s": 0.45, "kernels": 20},
    {"layers": 8, "method": "inductor", "status": "ok", "first_s": 110.0, "step_s": 1.0, "kernels": 18},
    {"layers": 8, "method": "hilore", "status": "failed: boom"},
]


def test_ratios_are_hilore_over_inductor_at_each_depth_that_ran():
    (two,) = ratios(ROWS)
    assert two["layers"] == 2
    assert two["first_compile"] == pytest.approx(1.25) and two["step"] == pytest.approx(0.9)
    assert two["kernels"] == (20, 18)


def test_table_names_failures_and_ratios():
    table = format_table({"rows": ROWS, "ratios": ratios(ROWS)})
    assert "failed: boom" in table and "first compile 1.25x" in table


def test_flag_parses_depths():
    args = build_parser().parse_args(["bench", "--compile-cost", "--depths", "2,8,32"])
    assert args.compile_cost and args.depths == (2, 8, 32)


def test_hilores_folded_verbose_line_is_read_whole():
    from hilore_compiler.bench.compile_cost import breakdowns
    from hilore_compiler.progress import wrap_line

    message = ("hilore: compiled this graph in 100.0 s: capture 20.4 s, profiling 42.3 s, solving 0.4 s, "
               "Inductor 36.9 s (1 variant)")
    stderr = "\n".join(["bench: something", wrap_line(message), "bench: something else",
                        "hilore: plan cached"])
    assert breakdowns(stderr) == [message.removeprefix("hilore: ")]
