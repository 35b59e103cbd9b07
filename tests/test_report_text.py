"""What hilore prints for people: cosines that are bounds, lines that fit a terminal."""

from __future__ import annotations

from hilore_compiler.progress import LINE_WIDTH, wrap_line
from hilore_compiler.solver.risk import format_cosine, format_error


def test_a_cosine_past_six_nines_is_never_printed_as_a_bound_of_one():
    assert format_error(1e-8) == "rel. L2 0.0001 (cos >= 1 - 5e-09)"
    assert format_error(0.0) == "rel. L2 0 (cos = 1)"
    assert format_cosine(0.999) == "cos >= 0.999"
    assert format_cosine(0.9999996) == "cos >= 1 - 4e-07"


def test_progress_lines_fold_at_the_line_width_and_keep_paths_whole():
    path = "/root/.cache/hilore/" + "a" * 64 + ".json"
    text = ("hilore: traced 316 recovery units and solved a 1.10x-gc plan with 4 buckets for sequences "
            f"512 to 2048 in 2 length buckets; plan: {path} (inspect: hilore show)")
    lines = wrap_line(text).splitlines()
    assert len(lines) > 1 and all(line.startswith("    ") for line in lines[1:])
    assert all(len(line) <= LINE_WIDTH for line in lines if path not in line)
    assert any(path in line for line in lines)  # never split inside a path


def test_a_compile_says_where_its_seconds_went():
    from hilore_compiler.backend.compiler import compile_breakdown

    line = compile_breakdown(30.0, {"capture": 2.0, "profiling": 5.5, "solving": 0.5}, 2)
    assert line == ("compiled this graph in 30.0 s: capture 2.0 s, profiling 5.5 s, solving 0.5 s, "
                    "Inductor 22.0 s (2 variants)")
