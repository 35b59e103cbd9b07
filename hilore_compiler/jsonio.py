"""Atomic, validated JSON files: the one way traces and plans touch disk."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class FormatError(ValueError):
    """A trace or plan file that cannot be used; the message says where and why.

    The message is always one line: newlines that came from the file (a key,
    a string value) are written as ``\\n`` so a log line stays a log line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(str(message).replace("\r", "\\r").replace("\n", "\\n"))


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


def parse_json(text: str, path: str | os.PathLike) -> Any:
    """``json.loads``, with every failure a one-line FormatError naming ``path``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(
            f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from e
    except (ValueError, RecursionError) as e:
        # Integers past Python's 4300-digit limit, or nesting deeper than the stack.
        raise FormatError(f"{path}: not usable JSON ({type(e).__name__}: {e})") from e


def read_object(path: str | os.PathLike) -> dict[str, Any]:
    """Read a file holding one JSON object; every failure is a one-line FormatError."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    payload = parse_json(text, path)
    if not isinstance(payload, dict):
        raise FormatError(f"{path}: expected a JSON object, found {type(payload).__name__}")
    return payload


def read_json(path: str | os.PathLike, schema: str) -> dict[str, Any]:
    """Read a JSON object and check its ``schema`` field equals ``schema``."""
    payload = read_object(path)
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
    return _typed(obj[key], kind, f"{where}.{key}")


def optional(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any) -> Any:
    """Return ``obj[key]`` if present (type-checked like :func:`require`), else ``default``."""
    return _typed(obj[key], kind, f"{where}.{key}") if key in obj else default


def as_object(value: Any, where: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a FormatError naming ``where``."""
    if not isinstance(value, dict):
        raise FormatError(f"{where}: expected an object, found {type(value).__name__}")
    return value


def _typed(value: Any, kind: type | tuple[type, ...], at: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON true/false are Python ints too: accept them only where a bool is asked for.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise FormatError(f"{at}: expected {names}, found {type(value).__name__}")
    return value


class OutputPathError(ValueError):
    """An output path (``-o``) that cannot be written; the message says why and what to do."""


def check_output_path(path: str | os.PathLike, *, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """Refuse an output path before any work is done, so none is lost.

    Refused: an existing folder, a path under a file, a folder that cannot be
    written (probed by creating a temporary file, which also catches
    read-only file systems and root's bypass of permission bits), and any of
    ``inputs`` (writing there would overwrite what is being read).
    """
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{path} is a folder; give a file name, e.g. {path / 'out.json'}")
    for source in inputs:
        if source is not None and Path(source).exists() and path.exists() and path.samefile(source):
            raise OutputPathError(f"{path} is also the input; writing it would overwrite what is read, "
                                  "choose another output file")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OutputPathError(f"cannot write {path}: {folder} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OutputPathError(f"cannot write {path}: folder {folder} is not writable ({e.strerror})") from e
    return path


def save_or_fallback(save: Callable[[Path], Path], path: str | os.PathLike, what: str) -> Path:
    """``save(path)``; if that fails with an OSError, save to a temporary file and say so.

    The work is kept either way: the OutputPathError raised after a fallback
    names where the file went.
    """
    try:
        return save(Path(path))
    except OSError as e:
        fd, fallback = tempfile.mkstemp(prefix=f"hilore-{what}-", suffix=".json")
        os.close(fd)
        save(Path(fallback))
        raise OutputPathError(f"cannot write {path} ({e.strerror or e}); the {what} was saved to "
                              f"{fallback} instead") from e
