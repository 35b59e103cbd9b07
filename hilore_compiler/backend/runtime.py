"""Which exposure bucket's compiled variant runs now.

The backend compiles one variant per bucket of the same dynamo graph and picks
one per call from this context variable, so switching buckets never recompiles
and autograd stays intact.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_CURRENT_BUCKET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "hilore_exposure_bucket", default=None
)


@contextlib.contextmanager
def exposure(bucket: str) -> Iterator[str]:
    """Run the forward passes inside this block with ``bucket``'s plan.

    ``bucket`` is a bucket name from the plan (``"b0"``, ``"b1"``, ... or
    ``"zero"``). Outside any ``exposure`` block the highest-fidelity bucket
    (the one with the largest exposure) runs.
    """
    if not isinstance(bucket, str):
        raise TypeError(f"exposure() takes a bucket name such as 'b0', got {bucket!r}")
    token = _CURRENT_BUCKET.set(bucket)
    try:
        yield bucket
    finally:
        _CURRENT_BUCKET.reset(token)


def current_bucket() -> str | None:
    """The bucket selected by the innermost ``exposure`` block, or None."""
    return _CURRENT_BUCKET.get()
