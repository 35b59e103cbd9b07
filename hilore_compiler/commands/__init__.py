"""One module per ``hilore`` subcommand: ``add_parser(subparsers)`` sets ``run``."""
