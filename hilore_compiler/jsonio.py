"""Atomic, validated JSON files: the one way traces and plans touch disk."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


class FormatError(ValueError):
    """A trace or plan file that cannot be used; the message says where and why."""


def write_json_atomic(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``path`` so that readers never see a half-written file.

    The data goes to a temporary file in the same directory, is flushed to disk,
    then renamed over the target (rename is atomic on POSIX). A crash leaves the
    old file intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp makes the file private (0600); give it the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | os.PathLike, schema: str) -> dict[str, Any]:
    """Read a JSON object and check its ``schema`` field equals ``schema``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from e
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from e
    if not isinstance(payload, dict):
        raise FormatError(f"{path}: expected a JSON object, found {type(payload).__name__}")
    found = payload.get("schema")
    if found != schema:
        hint = (
            "it is a plan, not a trace" if str(found).startswith("hilore.plan")
            else "it is a trace, not a plan" if str(found).startswith("hilore.trace")
            else "re-create it with this version of hilore"
        )
        raise FormatError(f"{path}: schema is {found!r}, expected {schema!r} ({hint})")
    return payload


def require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """Return ``obj[key]``, or raise a FormatError naming ``where`` if absent or mistyped."""
    if key not in obj:
        raise FormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise FormatError(f"{where}.{key}: expected {names}, found {type(value).__name__}")
    return value
