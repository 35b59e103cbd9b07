"""Progress lines for planning steps that take seconds: one every few seconds, not one per unit.

Profiling hundreds of units or waiting on CBC can take a while; a user should
see that it moves (units profiled of total, solver status) without a line per
unit flooding stderr.
"""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Callable

#: Seconds between two progress lines: often enough to see a step move, rarely
#: enough that a 400-unit profile says about a dozen lines.
PROGRESS_INTERVAL_S = 3.0


#: Widest line a progress message takes on stderr: the width ``hilore show`` keeps to,
#: so a long message (a cache path, a list of keys) wraps instead of running off a terminal.
LINE_WIDTH = 100


def wrap_line(text: str, width: int = LINE_WIDTH) -> str:
    """``text`` folded at word boundaries to ``width`` columns, later lines indented by
    four; a word longer than a line (a path) stays whole."""
    return textwrap.fill(text, width=width, subsequent_indent="    ", break_long_words=False,
                         break_on_hyphens=False)


def tell(text: str) -> None:
    """One progress message on stderr, folded to ``LINE_WIDTH`` columns."""
    print(wrap_line(text), file=sys.stderr, flush=True)


class Ticker:
    """Passes a message on to ``say`` at most once per ``interval_s`` seconds
    (and always the last one of a step, so it ends with its total)."""

    def __init__(self, say: Callable[[str], None], interval_s: float = PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.interval_s, self.clock = say, interval_s, clock
        self.last = clock()

    def __call__(self, message: str, *, last: bool = False) -> None:
        now = self.clock()
        if last or now - self.last >= self.interval_s:
            self.say(message)
            self.last = now
