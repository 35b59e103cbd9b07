"""One module per ``hilore`` subcommand: ``add_parser(subparsers)`` sets ``run``."""


def comma_list(text: str) -> tuple[str, ...]:
    """The names in a comma-separated option (``"gc, store-all"``), blanks dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())
