"""``python -m hilore_compiler``: the ``hilore`` command without relying on PATH."""

import sys

from .cli import main

sys.exit(main())
