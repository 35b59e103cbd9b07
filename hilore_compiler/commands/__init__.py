"""One module per ``hilore`` subcommand: ``add_parser(subparsers)`` sets ``run``."""


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
