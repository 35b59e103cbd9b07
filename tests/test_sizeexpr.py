"""The size grammar: whitelisted parsing, bounded, and a lossless writer."""

from __future__ import annotations

import time

import pytest
import sympy

from hilore_compiler.jsonio import FormatError
from hilore_compiler.sizeexpr import B, MAX_CHARS, S, eval_size, format_size, parse_size
from hilore_compiler.tracefile import load_trace

SHAPES = [(1, 1), (1, 7), (2, 31), (3, 2048), (8, 4097)]


def _values(expr: sympy.Expr) -> list[int]:
    """The expression at every test shape, floored like a size (sympy's own arithmetic)."""
    return [int(sympy.floor(expr.xreplace({B: b, S: s}))) for b, s in SHAPES]


@pytest.mark.parametrize("text, at_3_2048", [
    ("4*B*S*64", 4 * 3 * 2048 * 64),
    ("296*S + 32", 296 * 2048 + 32),
    ("32*S**2 + 128*S", 32 * 2048**2 + 128 * 2048),
    ("512*B*ceildiv(S, 30)", 512 * 3 * 69),
    ("S // 3 - 1", 681),
    ("floordiv(S, 3) + mod(S, 3)", 682 + 2),
    ("max(B, S) - min(B, 5)", 2048 - 3),
    ("-(-S)", 2048),
])
def test_grammar_evaluates_exactly(text, at_3_2048):
    assert eval_size(text, 3, 2048) == at_3_2048


@pytest.mark.parametrize("text, reason", [
    ("256*S+0*__import__('os').system('touch pwned')", "is not a size function"),
    ("S**(S**(S**S))", "is not an integer literal"),
    ("S**5", "power 5 exceeds 4"),
    ("(S+1)**2", "only B or S may be raised"),
    ("nan", "unknown name 'nan'"),
    ("oo", "unknown name 'oo'"),
    ("zoo", "unknown name 'zoo'"),
    ("256*S*I", "unknown name 'I'"),
    ("S/2", "'S / 2' is not allowed"),
    ("S.__class__", "is not allowed"),
    ("lambda: 0", "is not allowed"),
    ("2.5*S", "is not an integer literal"),
    ("True*S", "is not an integer literal"),
    ("S // 0", "division by zero"),
    ("mod(S, 0)", "division by zero"),
    ("max(S)", "at least 2 arguments"),
    ("ceildiv(S, 2, 3)", "takes 2 arguments"),
    ("ceildiv(S, b=2)", "is not a size function"),
    ("9" * 30, "exceeds"),
    ("S +", "not a size expression"),
    ("1+" * 300 + "1", "nodes exceeds"),
    ("S" + " " * MAX_CHARS, "characters exceeds"),
])
def test_anything_else_is_rejected_naming_where(text, reason, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where 'touch pwned' would land if anything ran
    with pytest.raises(FormatError, match="^units\\[3\\].bytes: ") as info:
        parse_size(text, "units[3].bytes")
    assert reason in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("text, why", [
    ("S - 4096", "is -2048 bytes"),
    ("S // (S - 2048)", "not an integer"),
    ("S*S*S*S*S*S*S", "a size is between 0 and"),
])
def test_evaluation_refuses_what_is_not_a_size(text, why):
    with pytest.raises(FormatError, match=why):
        eval_size(text, 1, 2048, "u.bytes")


def test_parsing_is_bounded_in_time():
    start = time.perf_counter()
    for text in ["S**(S**(S**S))", "(" * 150 + "S" + ")" * 150, "max(" * 60 + "S" + ", S)" * 60,
                 "*".join(["S**4"] * 90)]:
        try:
            eval_size(text, 64, 2**20)
        except FormatError:
            pass
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("text", [
    "4*B*S*64", "296*S + 32", "32*S**2 + 128*S", "512*B*ceildiv(S, 32)", "S // 3 - 1",
    "floordiv(S + 2, 3)*B", "mod(floordiv(S, 2), 7) + 1", "max(B, S) - min(B, 5)", "10 - B",
    "B*(S - 1)", "0",
])
def test_written_sizes_parse_back_to_the_same_value(text):
    expr = parse_size(text)
    again = parse_size(format_size(expr))
    assert _values(again) == _values(expr)


def test_rational_coefficients_become_floor_division():
    assert format_size(3 * S / 2) == "floordiv(3*S, 2)"
    assert _values(parse_size(format_size(3 * S / 2))) == _values(3 * S / 2)


def test_torch_sympy_functions_round_trip():
    fns = pytest.importorskip("torch.utils._sympy.functions")
    cases = [
        512 * B * fns.CeilToInt(fns.IntTrueDiv(S, 32)),
        fns.FloorDiv(S, 2) * B,
        fns.CeilDiv(S, 3),
        fns.FloorToInt(fns.IntTrueDiv(S, 3)),
        fns.ModularIndexing(S, 2, 7),
        fns.PythonMod(S, 5) + fns.Mod(B, 2),
        fns.Max(S, 4 * B) + fns.Min(S, sympy.Integer(3)),  # torch 2.10's Min and Max take no Python ints
        fns.CleanDiv(4 * S, 2),
        fns.Identity(S),
    ]
    for expr in cases:
        text = format_size(expr)
        assert "Div" not in text and "Int" not in text, text
        expected = [int(expr.xreplace({B: sympy.Integer(b), S: sympy.Integer(s)})) for b, s in SHAPES]
        assert [eval_size(text, b, s) for b, s in SHAPES] == expected, text
    assert format_size(512 * B * fns.CeilToInt(fns.IntTrueDiv(S, 32))) == "512*B*ceildiv(S, 32)"


def test_unknown_symbols_and_functions_are_not_written():
    with pytest.raises(ValueError, match="symbol 's23'"):
        format_size(sympy.Symbol("s23") * 4)
    with pytest.raises(ValueError, match="cannot write"):
        format_size(sympy.sin(S))


@pytest.mark.parametrize("name", ["small-cpu-T2048.json", "llama-8b-roofline-h100.json"])
def test_checked_in_traces_load_and_round_trip(name):
    trace = load_trace(f"traces/{name}")
    for u in trace.units:
        assert eval_size(format_size(parse_size(u.bytes)), trace.batch, trace.seq_len) == u.bytes_at_trace


def test_torch_spellings_of_older_traces_are_read_as_the_grammar():
    fns = pytest.importorskip("torch.utils._sympy.functions")
    cases = [512 * B * fns.CeilToInt(fns.IntTrueDiv(S, 32)), fns.FloorDiv(S, 2) * B + 3, fns.CeilDiv(S, 3),
             fns.ModularIndexing(S, 2, 7), fns.PythonMod(S, 5) + fns.Mod(B, 2), fns.Max(S, 4 * B),
             fns.Min(S, sympy.Integer(3)), fns.FloorToInt(fns.IntTrueDiv(S, 3))]
    for expr in cases:  # str() is what the tracer wrote before format_size
        expected = [int(expr.xreplace({B: sympy.Integer(b), S: sympy.Integer(s)})) for b, s in SHAPES]
        assert [eval_size(str(expr), b, s) for b, s in SHAPES] == expected, str(expr)
    for text, why in [("CeilToInt(S)", "only around a division"), ("IntTrueDiv(S, 2)", "not a size function"),
                      ("ModularIndexing(S, 0, 3)", "division by zero"), ("ModularIndexing(S, 2)", "3 arguments")]:
        with pytest.raises(FormatError, match=why):
            parse_size(text)
