"""Memory budgets: parse ``6GiB``, ``750MB``, ``123456``, ``1.10x-gc``, ``0.5x-store``.

A budget bounds the training step's predicted peak above what the process
held before it (``memory.py``): kept activations, the backward transient, the
graph's outputs and their gradient, the loss's own peak when it is known, and
the weights' gradients accumulated so far. Weights, optimizer state and the
allocator's own overhead are outside it, as they are outside every method's
measured peak. ``x-gc`` and ``x-store`` are multiples of GC's and store-all's
peaks under the same model (or of GC's measured peak when the caller gives it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: Bytes per unit suffix. Decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units
#: are both common in memory reports, so both are accepted and kept distinct.
UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}

#: What ``parse_budget`` accepts, quoted in every error message.
ACCEPTED_FORMS = (
    "a byte count ('123456'), a size with a unit ('750MB', '6GiB'; units B, kB, MB, "
    "GB, TB, KiB, MiB, GiB, TiB), a multiple of gradient checkpointing's peak "
    "('1.10x-gc') or a multiple of store-all's peak ('0.5x-store')"
)

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_ABSOLUTE = re.compile(rf"^(?P<num>{_NUMBER})\s*(?P<unit>[a-zA-Z]*)$")
_RELATIVE = re.compile(rf"^(?P<num>{_NUMBER})\s*x-(?P<ref>gc|store)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """A parsed memory budget, absolute or relative to a reference plan."""

    #: The budget as the user wrote it, kept for the plan file.
    text: str
    #: ``"bytes"`` (absolute), ``"gc"`` or ``"store"`` (a multiple of that reference).
    reference: str
    #: Bytes when absolute, else the multiplier of the reference's bytes.
    value: float

    def bytes_at(self, *, gc_bytes: int, store_bytes: int) -> int:
        """The budget in whole bytes, given the references at the planned shape.

        Rounded down: a plan that fits the floor fits the exact budget too.
        """
        if self.reference == "bytes":
            return math.floor(self.value)
        reference = gc_bytes if self.reference == "gc" else store_bytes
        return math.floor(self.value * reference)


def parse_budget(budget: str | int | float) -> Budget:
    """Parse a memory budget; raise ValueError naming the accepted forms if malformed."""
    if isinstance(budget, bool) or not isinstance(budget, (str, int, float)):
        raise ValueError(f"budget {budget!r} is not a string or number; accepted: {ACCEPTED_FORMS}")
    text = str(budget).strip()
    relative = _RELATIVE.match(text)
    absolute = _ABSOLUTE.match(text)
    if relative:
        parsed = Budget(text=text, reference=relative["ref"].lower(), value=float(relative["num"]))
    elif absolute and absolute["unit"].lower() in UNITS | {"": 1}:
        scale = UNITS.get(absolute["unit"].lower(), 1)
        parsed = Budget(text=text, reference="bytes", value=float(absolute["num"]) * scale)
    else:
        why = "is negative" if text.startswith("-") else "is not understood"
        raise ValueError(f"budget {text!r} {why}; accepted: {ACCEPTED_FORMS}")
    if not math.isfinite(parsed.value) or parsed.value <= 0:
        raise ValueError(f"budget {text!r} must be positive and finite; accepted: {ACCEPTED_FORMS}")
    if parsed.reference == "bytes" and parsed.value < 1:
        raise ValueError(f"budget {text!r} is less than one byte; accepted: {ACCEPTED_FORMS}")
    return parsed


def format_bytes(n: float) -> str:
    """Bytes in binary units a person reads at a glance: ``1.50 GiB``, ``512 B``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def format_seconds(s: float) -> str:
    """Seconds in the unit that keeps three significant digits: ``1.23 ms``, ``45.6 us``."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns" if s else "0 s"
