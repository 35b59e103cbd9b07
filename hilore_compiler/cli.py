"""The ``hilore`` command line: one subcommand per module in ``commands/``.

Only the chosen subcommand's module is imported: ``hilore --help``, ``hilore
plan`` and ``hilore show`` never load torch (about 2 s of CPU on its own), and
the other subcommands are listed from ``commands.SUMMARIES`` alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from types import ModuleType

from .commands import SUMMARIES

#: Subcommands in pipeline order; each module defines ``add_parser`` and ``run``.
COMMANDS = tuple(SUMMARIES)


def _load(name: str) -> ModuleType | None:
    """The module of subcommand ``name``, or None when it is not installed."""
    try:
        return importlib.import_module(f"hilore_compiler.commands.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"hilore_compiler.commands.{name}":
            raise
        return None


def build_parser(loaded: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``hilore`` parser. ``loaded``: the subcommands whose modules are imported to
    define their options (default: all); the others are listed with their summary only."""
    loaded = set(COMMANDS if loaded is None else loaded)
    parser = argparse.ArgumentParser(
        prog="hilore",
        description="Plan what to store, compress or recompute for GRPO actor updates.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary in SUMMARIES.items():
        module = _load(name) if name in loaded else None
        if module is not None:
            module.add_parser(sub)
        elif name not in loaded:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hilore`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = argv[:1] if argv and argv[0] in SUMMARIES else []
    args = build_parser(chosen).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        # Errors raised for bad input (FormatError, OutputPathError, ...) carry
        # a message that names the fix; print it as one line, no traceback.
        message = " ".join(str(e).split("\n")) or type(e).__name__
        print(f"hilore {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
