"""The ``hilore`` command line: one subcommand per module in ``commands/``."""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommands in pipeline order; each module defines ``add_parser`` and ``run``.
COMMANDS = ("demo", "trace", "calibrate", "plan", "show", "bench", "eval")


def _available_commands() -> dict[str, object]:
    found = {}
    for name in COMMANDS:
        try:
            found[name] = importlib.import_module(f"hilore_compiler.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"hilore_compiler.commands.{name}":
                raise
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hilore",
        description="Plan what to store, compress or recompute for GRPO actor updates.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _available_commands().items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hilore`` console script."""
    args = build_parser().parse_args(argv)
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
