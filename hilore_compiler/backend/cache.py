"""The on-disk cache of zero-config plans and traces, which heals itself.

A cache that cannot be written is skipped (the plan is still made and used);
a cached file that cannot be read, or a plan or trace that does not fit the
graph it is keyed under (``StaleCacheError``), is moved aside and made anew;
each is said once. Temporary files that killed writers left behind are
removed when the cache is opened. The cache never stops a compile.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..jsonio import FormatError
from ..planfile import Plan
from ..planload import load_plan
from ..tracefile import Trace, load_trace
from .report import HiLoReWarning, say

if TYPE_CHECKING:
    from .options import BackendOptions


#: Age in seconds past which a writer's temporary file (``jsonio.write_json_atomic``:
#: ``.<name>.<random>.tmp``) is a leftover of a killed process: a live writer
#: holds one for the milliseconds a plan or trace takes to write, so ten
#: minutes never removes a file still being written.
STALE_TMP_S = 600.0


class StaleCacheError(RuntimeError):
    """A cached plan or trace, readable, that does not fit the graph it is keyed under."""


def default_cache_dir() -> str:
    """``$HILORE_CACHE_DIR``, or ``~/.cache/hilore`` when unset or empty."""
    return os.environ.get("HILORE_CACHE_DIR") or str(Path.home() / ".cache" / "hilore")


def _warn(message: str) -> None:
    warnings.warn(f"hilore: {message}", HiLoReWarning, stacklevel=4)


@dataclass(slots=True)
class PlanCache:
    """The plan file of one cache key and the trace file it is solved from; ``folder`` None when unwritable.

    The trace has a key of its own (``cachekey.trace_key``): plans that differ
    only in solver options share it.
    """

    folder: Path | None
    key: str
    options: BackendOptions
    trace_key: str = ""

    @classmethod
    def open(cls, cache_dir: str | os.PathLike, key: str, options: BackendOptions, *,
             trace_key: str = "") -> PlanCache:
        folder = Path(cache_dir or default_cache_dir()).expanduser()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(f"{folder} is not writable")
        except OSError as error:
            _warn(f"cannot use the plan cache {folder} ({error}); planning without a cache "
                  "(set options={'cache_dir': ...} or HILORE_CACHE_DIR to a writable folder)")
            return cls(None, key, options, trace_key)
        remove_stale_tmp(folder)
        return cls(folder, key, options, trace_key)

    @property
    def plan_path(self) -> Path | None:
        return self.folder / f"{self.key}.plan.json" if self.folder else None

    @property
    def trace_path(self) -> Path | None:
        return self.folder / f"{self.trace_key or self.key}.trace.json" if self.folder else None

    def load_plan(self) -> Plan | None:
        """The cached plan, or None; an unreadable one is moved aside."""
        return self._load(self.plan_path, load_plan, "plan", "re-planning")

    def load_trace(self) -> Trace | None:
        """The cached trace of this graph, or None; an unreadable one is moved aside."""
        return self._load(self.trace_path, load_trace, "trace", "tracing again")

    def _load(self, path: Path | None, load: Callable[[Path], Any], what: str, instead: str) -> Any:
        if path is None or not path.exists():
            return None
        try:
            record = load(path)
        except (FormatError, OSError, ValueError) as error:
            where = _move_aside(path, "corrupt")
            _warn(f"the cached {what} {path} is unreadable ({error}); " + (
                f"moved it to {where} and {instead}" if where else instead))
            return None
        say(self.options, f"using cached {what} {path}")
        return record

    def save_plan(self, plan: Plan) -> Path | None:
        return self._save(plan, self.plan_path)

    def _length_path(self, index: int) -> Path | None:
        """Length bucket ``index``'s plan file; the first is ``plan_path``."""
        if index == 0 or self.folder is None:
            return self.plan_path
        return self.folder / f"{self.key}.plan.{index}.json"

    def load_plans(self) -> tuple[Plan, ...]:
        """The cached plans of every length bucket (shortest first), or () if any is missing or unreadable."""
        plans = []
        for path in self._plan_paths():
            plan = self._load(path, load_plan, "plan", "re-planning")
            if plan is None:
                return ()
            plans.append(plan)
        return tuple(plans)

    def save_plans(self, plans: Sequence[Plan]) -> Path | None:
        """Save each length bucket's plan; a stale longer list's extra files are removed."""
        where = None
        for index, plan in enumerate(plans):
            saved = self._save(plan, self._length_path(index))
            where = where or saved
        for index in itertools.count(len(plans)):
            path = self._length_path(index)
            if index == 0 or path is None or not path.exists():
                break
            path.unlink(missing_ok=True)
        return where

    def discard(self, error: BaseException) -> None:
        """Move this key's plans and trace aside: readable, but they do not fit the graph (``error``)."""
        paths = [*self._plan_paths(), *[p for p in (self.trace_path,) if p is not None and p.exists()]]
        moved = [str(where) for where in (_move_aside(p, "mismatch") for p in paths) if where]
        _warn(f"the cached plan does not fit this graph ({error}); " + (
            f"moved {', '.join(moved)} aside and planning it afresh" if moved else "planning it afresh"))

    def _plan_paths(self) -> list[Path]:
        """The plan files of every length bucket that exist, shortest first."""
        paths = []
        for index in itertools.count():
            path = self._length_path(index)
            if path is None or not path.exists():
                return paths
            paths.append(path)

    def save_trace(self, trace: Trace) -> Path | None:
        return self._save(trace, self.trace_path)

    def _save(self, record: Plan | Trace, path: Path | None) -> Path | None:
        if path is None:
            return None
        try:
            return record.save(path)
        except OSError as error:
            _warn(f"could not write {path} ({error}); continuing without caching it")
            self.folder = None
            return None


def _move_aside(path: Path, reason: str) -> Path | None:
    """Rename ``path`` to ``<path>.<reason>-<time>`` (kept for the user to look at); None if it cannot be."""
    aside = path.with_name(f"{path.name}.{reason}-{int(time.time())}")
    try:
        path.replace(aside)
    except OSError:
        return None
    return aside


def remove_stale_tmp(folder: Path) -> list[Path]:
    """Remove writers' temporary files older than ``STALE_TMP_S`` from ``folder``; returns those removed."""
    removed = []
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        try:
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                tmp.unlink()
                removed.append(tmp)
        except OSError:  # another process removed it first, or it is not ours to remove
            continue
    return removed
