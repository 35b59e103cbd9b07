"""How the backend reports: progress lines under ``verbose``, and the one warning it gives
where it falls back to Inductor's own choice (never an error, unless ``strict``)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from ..progress import tell

if TYPE_CHECKING:  # options imports the cache, which reports through here
    from .options import BackendOptions


class HiLoReWarning(UserWarning):
    """The backend fell back to Inductor's own choice for something it could not plan."""


def say(options: BackendOptions, message: str) -> None:
    """Progress on stderr when ``options.verbose``."""
    if options.verbose:
        tell(f"hilore: {message}")


def fall_back(options: BackendOptions, error: Exception, what: str) -> None:
    """Raise ``error`` under ``strict``; otherwise say once that Inductor decides ``what``."""
    if options.strict:
        raise error
    warnings.warn(f"hilore: {error}; {what} falls back to Inductor's own choice "
                  "(options={'strict': True} raises instead)", HiLoReWarning, stacklevel=3)
