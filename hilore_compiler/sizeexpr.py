"""Size expressions: a small whitelisted grammar, never ``eval``.

Traces store every size (bytes kept, codec payload, recompute transient, GC
and store-all totals) as an expression of the batch ``B`` and the sequence
length ``S`` so that a plan can be made for another shape. Reading a trace
must never run code, so these strings are parsed here with :mod:`ast` against
a whitelist instead of with ``sympy.sympify`` (which evaluates Python):

    expr  := int | B | S | expr (+ | - | * | //) expr | -expr | (expr)
           | B**k | S**k                  (k a literal from 0 to MAX_POWER)
           | ceildiv(expr, expr) | floordiv(expr, expr) | mod(expr, expr)
           | min(expr, expr, ...) | max(expr, expr, ...)

The functions map to sympy's ``ceiling``, ``floor``, ``Mod``, ``Min`` and
``Max``, so an expression evaluates exactly at integer ``B`` and ``S``. Torch's
own spellings that ``str()`` wrote into older traces (``FloorDiv``,
``CeilDiv``, ``CleanDiv``, ``Mod``, ``PythonMod``, ``Max``, ``Min``,
``ModularIndexing(a, b, c)``, ``CeilToInt(IntTrueDiv(a, b))``,
``FloorToInt(IntTrueDiv(a, b))``) are read as these functions. The
power form exists because attention scores are ``(B, H, S, S)``: traces
written before this grammar say ``S**2``. :func:`format_size` writes any
expression the tracer makes in this grammar, including torch's own sympy
functions (``FloorDiv``, ``CeilDiv``, ``CeilToInt(IntTrueDiv(a, b))``,
``Mod``, ``PythonMod``, ``ModularIndexing``, ``Max``, ``Min``), recognised by
class name so this module stays torch-free.
"""

from __future__ import annotations

import ast
import functools

import sympy

from .jsonio import FormatError

#: The shape symbols every size expression may use.
B, S = sympy.symbols("B S", positive=True, integer=True)
SHAPE_SYMBOLS = {"B": B, "S": S}

#: Longest expression text accepted. The tracer writes expanded polynomials
#: of a few terms (the 8B roofline trace's longest is 23 characters); this
#: leaves room for a hundredfold more and bounds parse time and memory.
MAX_CHARS = 2000
#: Most syntax-tree nodes accepted (a term like ``4096*S`` is 3 nodes).
MAX_NODES = 400
#: Largest power of a shape symbol: S**2 is attention scores; S**4 is room.
MAX_POWER = 4
#: Largest integer literal and largest evaluated size: sizes are int64 bytes.
MAX_VALUE = 2**63 - 1

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: sympy.floor(a / b),
}
#: Name in the grammar -> (sympy constructor, number of arguments or None for 2+).
_FUNCTIONS = {
    "ceildiv": (lambda a, b: sympy.ceiling(a / b), 2),
    "floordiv": (lambda a, b: sympy.floor(a / b), 2),
    "mod": (sympy.Mod, 2),
    "min": (sympy.Min, None),
    "max": (sympy.Max, None),
}
_GRAMMAR = ("integers, B, S, + - * //, B**k or S**k with k <= %d, and "
            "ceildiv/floordiv/mod/min/max(...)" % MAX_POWER)


class _Reject(Exception):
    """A construct outside the grammar; the message says which."""


def _literal(node: ast.AST) -> int:
    if not (isinstance(node, ast.Constant) and type(node.value) is int):
        raise _Reject(f"{ast.unparse(node)!r} is not an integer literal")
    if node.value > MAX_VALUE:
        raise _Reject(f"integer {node.value} exceeds {MAX_VALUE}")
    return node.value


def _divisor(node: ast.AST, value: sympy.Expr) -> sympy.Expr:
    if value == 0:
        raise _Reject(f"division by zero ({ast.unparse(node)!r})")
    return value


def _build(node: ast.AST) -> sympy.Expr:
    """Turn one whitelisted syntax-tree node into sympy; reject anything else."""
    if isinstance(node, ast.Constant):
        return sympy.Integer(_literal(node))
    if isinstance(node, ast.Name):
        if node.id not in SHAPE_SYMBOLS:
            raise _Reject(f"unknown name {node.id!r} (only B and S)")
        return SHAPE_SYMBOLS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _build(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        if not (isinstance(node.left, ast.Name) and node.left.id in SHAPE_SYMBOLS):
            raise _Reject("only B or S may be raised to a power")
        power = _literal(node.right)
        if power > MAX_POWER:
            raise _Reject(f"power {power} exceeds {MAX_POWER}")
        return SHAPE_SYMBOLS[node.left.id] ** power
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _build(node.left), _build(node.right)
        if isinstance(node.op, ast.FloorDiv):
            right = _divisor(node.right, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Call):
        return _call(node)
    raise _Reject(f"{ast.unparse(node)!r} is not allowed")


#: Torch's spellings, as ``str()`` wrote them into traces made before this
#: grammar (CUDA traces): read as the grammar's functions, nothing more.
_TORCH_NAMES = {"FloorDiv": "floordiv", "CleanDiv": "floordiv", "CeilDiv": "ceildiv",
                "Mod": "mod", "PythonMod": "mod", "Max": "max", "Min": "min"}
_TORCH_ROUNDINGS = {"CeilToInt": "ceildiv", "FloorToInt": "floordiv"}


def _torch_call(node: ast.Call, name: str) -> sympy.Expr:
    """``ModularIndexing(a, b, c)`` and ``CeilToInt/FloorToInt(IntTrueDiv(a, b))``."""
    if name == "ModularIndexing":
        if len(node.args) != 3:
            raise _Reject(f"ModularIndexing() takes 3 arguments, got {len(node.args)}")
        base, divisor, modulus = (_build(a) for a in node.args)
        _divisor(node.args[1], divisor)
        _divisor(node.args[2], modulus)
        return sympy.Mod(sympy.floor(base / divisor), modulus)
    inner = node.args[0] if len(node.args) == 1 else None
    if not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name)
            and inner.func.id == "IntTrueDiv" and not inner.keywords):
        raise _Reject(f"{name}() is read only around a division, as {name}(IntTrueDiv(a, b))")
    return _call(ast.Call(func=ast.Name(id=_TORCH_ROUNDINGS[name]), args=inner.args, keywords=[]))


def _call(node: ast.Call) -> sympy.Expr:
    name = node.func.id if isinstance(node.func, ast.Name) else None
    if (name in _TORCH_ROUNDINGS or name == "ModularIndexing") and not node.keywords:
        return _torch_call(node, name)
    name = _TORCH_NAMES.get(name, name)
    if name not in _FUNCTIONS or node.keywords:
        raise _Reject(f"{ast.unparse(node.func)!r} is not a size function")
    make, arity = _FUNCTIONS[name]
    args = [_build(a) for a in node.args]
    if (arity is not None and len(args) != arity) or (arity is None and len(args) < 2):
        raise _Reject(f"{name}() takes {arity or 'at least 2'} arguments, got {len(args)}")
    if name in ("ceildiv", "floordiv", "mod"):
        _divisor(node.args[1], args[1])
    return make(*args)


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> sympy.Expr | str:
    """The parsed expression, or the reason it is rejected (cached: traces repeat sizes)."""
    if len(text) > MAX_CHARS:
        return f"expression of {len(text)} characters exceeds {MAX_CHARS}"
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return f"not a size expression ({type(e).__name__}: {getattr(e, 'msg', e)})"
    nodes = sum(1 for _ in ast.walk(tree.body))
    if nodes > MAX_NODES:
        return f"expression of {nodes} nodes exceeds {MAX_NODES}"
    try:
        return _build(tree.body)
    except _Reject as e:
        return str(e)
    except (ArithmeticError, TypeError, ValueError, RecursionError) as e:
        return f"cannot build ({type(e).__name__}: {e})"


def parse_size(text: str, where: str = "size") -> sympy.Expr:
    """Parse a size expression such as ``"4*B*S*64"`` (grammar in the module docstring).

    Raises ``FormatError`` naming ``where`` and the offending part; nothing in
    ``text`` is ever evaluated as Python.
    """
    if not isinstance(text, str):
        raise FormatError(f"{where}: expected a size expression string, found {type(text).__name__}")
    parsed = _parse(text)
    if isinstance(parsed, str):
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise FormatError(f"{where}: size {shown!r} rejected: {parsed}; allowed: {_GRAMMAR}")
    return parsed


def eval_size(expr: str | sympy.Expr, batch: int, seq_len: int, where: str = "size") -> int:
    """Evaluate a size expression at a concrete shape: a non-negative int64.

    Raises ``FormatError`` if the value is not an integer (e.g. a division by
    zero at this shape), negative, or too large to be a size.
    """
    value = parse_size(expr, where) if isinstance(expr, str) else expr
    try:
        result = value.xreplace({B: sympy.Integer(batch), S: sympy.Integer(seq_len)})
    except (ArithmeticError, TypeError, ValueError, RecursionError) as e:
        raise FormatError(f"{where}: cannot evaluate at B={batch}, S={seq_len} ({e})") from e
    if not isinstance(result, sympy.Integer):
        raise FormatError(f"{where}: size {value} is {result} at B={batch}, S={seq_len}, not an integer")
    if not 0 <= int(result) <= MAX_VALUE:
        raise FormatError(f"{where}: size {value} is {int(result)} bytes at B={batch}, S={seq_len}; "
                          f"a size is between 0 and {MAX_VALUE}")
    return int(result)


# ---------------------------------------------------------------- formatting
#: Precedence of what a formatted piece is: a sum, a product, or an atom.
_SUM, _PRODUCT, _ATOM = 0, 1, 2


def format_size(expr: sympy.Expr | int) -> str:
    """Write a size expression in the grammar :func:`parse_size` reads.

    Accepts what the tracer builds: integers, ``B``, ``S``, sums, products,
    powers, sympy's ``floor``/``ceiling``/``Mod``/``Min``/``Max`` and torch's
    ``FloorDiv``, ``CeilDiv``, ``CleanDiv``, ``IntTrueDiv``, ``CeilToInt``,
    ``FloorToInt``, ``Mod``, ``PythonMod``, ``ModularIndexing``, ``Max``,
    ``Min`` and ``Identity``. A rational coefficient becomes a floor division
    (sizes are whole bytes). Raises ValueError for anything else, e.g. an
    unnamed dynamic dimension, so a trace is never written that cannot be read.
    """
    return _format(sympy.sympify(expr) if isinstance(expr, int) else expr)[0]


def _wrap(piece: tuple[str, int], least: int) -> str:
    text, precedence = piece
    return text if precedence >= least else f"({text})"


def _format(e: sympy.Expr) -> tuple[str, int]:
    if e.is_Integer:
        return str(int(e)), _ATOM if e >= 0 else _SUM
    if e.is_Symbol:
        if e.name not in SHAPE_SYMBOLS:
            raise ValueError(f"size uses symbol {e.name!r}; only B and S can be written to a trace")
        return e.name, _ATOM
    if e.is_Float:
        if e != int(e):
            raise ValueError(f"size {e} is not a whole number of bytes")
        return _format(sympy.Integer(int(e)))
    if e.is_Add:
        return _format_sum(e)
    if e.is_Mul or e.is_Rational or (e.is_Pow and e.exp.is_negative):
        return _format_product(e)
    if e.is_Pow:
        return _format_power(e)
    return _format_function(e)


def _format_sum(e: sympy.Expr) -> tuple[str, int]:
    parts = []
    for i, term in enumerate(e.as_ordered_terms()):
        if i and term.could_extract_minus_sign():
            parts.append(f"- {_wrap(_format(-term), _PRODUCT)}")
        else:
            parts.append(("+ " if i else "") + _format(term)[0])
    return " ".join(parts), _SUM


def _format_product(e: sympy.Expr) -> tuple[str, int]:
    numerator, denominator = e.as_numer_denom()
    if denominator != 1:
        return _division("floordiv", numerator, denominator)
    coeff, factors = e.as_coeff_mul()
    if coeff == -1:
        return f"-{_wrap(_format(e * -1), _PRODUCT)}", _SUM
    pieces = ([] if coeff == 1 else [str(coeff)]) + [_wrap(_format(f), _PRODUCT) for f in factors]
    return "*".join(pieces), _SUM if coeff < 0 else _PRODUCT


def _format_power(e: sympy.Expr) -> tuple[str, int]:
    base, power = e.base, e.exp
    if not (power.is_Integer and 0 < power):
        raise ValueError(f"size {e} has a power that is not a positive integer")
    if base.is_Symbol and power <= MAX_POWER:
        return f"{_format(base)[0]}**{int(power)}", _PRODUCT
    if power > 16:
        raise ValueError(f"size {e}: power {power} is too large to write out")
    return "*".join([_wrap(_format(base), _PRODUCT)] * int(power)), _PRODUCT


def _division(name: str, numerator: sympy.Expr, denominator: sympy.Expr) -> tuple[str, int]:
    if denominator == 1:
        return _format(numerator)
    return f"{name}({_format(numerator)[0]}, {_format(denominator)[0]})", _ATOM


def _quotient(arg: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """``(a, b)`` with ``arg == a / b``: torch's true divisions or a sympy fraction."""
    if type(arg).__name__ in ("IntTrueDiv", "FloatTrueDiv", "TrueDiv"):
        return arg.args[0], arg.args[1]
    return sympy.together(arg).as_numer_denom()


#: Torch's and sympy's function classes, by name, as grammar functions.
_DIVISIONS = {"FloorDiv": "floordiv", "CleanDiv": "floordiv", "IntTrueDiv": "floordiv",
              "CeilDiv": "ceildiv"}
_ROUNDINGS = {"floor": "floordiv", "FloorToInt": "floordiv", "ceiling": "ceildiv",
              "CeilToInt": "ceildiv"}


def _format_function(e: sympy.Expr) -> tuple[str, int]:
    name = type(e).__name__
    if name in _DIVISIONS:
        return _division(_DIVISIONS[name], *e.args)
    if name in _ROUNDINGS:
        return _division(_ROUNDINGS[name], *_quotient(e.args[0]))
    if name in ("Mod", "PythonMod"):
        return f"mod({_format(e.args[0])[0]}, {_format(e.args[1])[0]})", _ATOM
    if name == "ModularIndexing":  # (base // divisor) % modulus
        base, divisor, modulus = e.args
        return f"mod({_division('floordiv', base, divisor)[0]}, {_format(modulus)[0]})", _ATOM
    if name in ("Max", "Min"):
        return f"{name.lower()}({', '.join(_format(a)[0] for a in e.args)})", _ATOM
    if name == "Identity":
        return _format(e.args[0])
    raise ValueError(f"size {e} uses {name}, which the size grammar cannot write")
