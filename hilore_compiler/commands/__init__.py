"""One module per ``hilore`` subcommand: ``add_parser(subparsers)`` sets ``run``.

Helpers beside them: ``policy`` (``--model``, a built-in name or ``hf:CONFIG``,
for trace and calibrate) and ``memplot`` (``show --plot``'s drawing).

``cli`` imports only the chosen subcommand's module, and ``plan`` and ``show``
import no torch (tests/test_cli_startup.py checks both), so that they start in
a fraction of a second.
"""

#: Every subcommand's one-line help, in pipeline order: ``hilore --help`` lists
#: them without importing any command module (``cli.build_parser``).
SUMMARIES = {
    "demo": "trace, plan, compile and run one GRPO update on a built-in model",
    "trace": "profile a built-in model or an hf: config into a trace JSON (recovery units and their costs)",
    "calibrate": "measure gradient sensitivity per (unit kind or unit, codec) into a trace",
    "plan": "trace JSON -> plan JSON (store / compress / recompute per bucket)",
    "show": "a plan or trace as readable tables and a summary",
    "bench": "benchmark the actor update: GC, PyTorch baselines and HiLoRe side by side",
    "eval": "gradient fidelity per bucket and a paired GRPO training run (exact vs hilore)",
}


def comma_list(text: str) -> tuple[str, ...]:
    """The names in a comma-separated option (``"gc, store-all"``), blanks dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def length_list(text: str, *, flag: str, at_least: int = 1) -> tuple[int, ...]:
    """Comma-separated sequence lengths (``"256,512"``), at least ``at_least`` of them, each >= 1."""
    import argparse

    try:
        lengths = tuple(int(c) for c in comma_list(text))
    except ValueError:
        lengths = ()
    if len(lengths) < at_least or min(lengths, default=0) < 1:
        raise argparse.ArgumentTypeError(f"{flag} takes {'two or more' if at_least > 1 else ''} comma-separated "
                                         f"lengths like 256,512,1024,2048, not {text!r}".replace("  ", " "))
    return lengths
