"""A worker process and the pipe to it: one JSON command per line in, one answer per line out.

The step bench (``worker.py``) and the actor bench (``actor_worker.py``)
speak the same protocol (``worker.serve_requests``); a worker's stderr goes
to a log file whose tail is quoted when it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..passes.allocator import DEFAULT_THRESHOLD_MAX, MMAP_THRESHOLD_VAR, TRIM_THRESHOLD_VAR
from .measure import MMAP_THRESHOLD_ENV
from .worker import WorkerConfig

#: glibc's variable for the slack ``sbrk`` adds each time the heap grows.
TOP_PAD_VAR = "MALLOC_TOP_PAD_"

#: ``--heap``: the allocator setting of timed workers. ``default``: glibc's
#: as a trainer gets it. ``fixed``: ``FIXED_HEAP_ENV``.
HEAPS = ("default", "fixed")

#: A heap whose layout does not depend on the process's history. On glibc's
#: default the mmap threshold moves as large blocks are freed, and where a
#: step's buffers land then depends on what the process did before: the same
#: kernels ran 1.700, 1.775 and 1.972 s/step in three plans of one process
#: (docs/benchmarks.md, "Why the intervals are wide"), a spread that is fixed
#: for a worker's life, so rounds do not average it out. Fixed at the
#: threshold's own ceiling (32 MiB), never trimmed, grown in 256 MiB steps,
#: four 1.1x plans ran within 1% of each other in one process, as a caching
#: allocator (CUDA's) runs them; across processes some spread remains. Memory is unchanged: peaks come from
#: workers of their own (``peak``).
FIXED_HEAP_ENV = {MMAP_THRESHOLD_VAR: str(DEFAULT_THRESHOLD_MAX), TRIM_THRESHOLD_VAR: str(16 << 30),
                  TOP_PAD_VAR: str(256 << 20)}

_HEAP_VARS = {*MMAP_THRESHOLD_ENV, *FIXED_HEAP_ENV}


def check_heap(heap: str) -> None:
    """Raise ValueError unless ``heap`` is one of ``HEAPS``."""
    if heap not in HEAPS:
        raise ValueError(f"heap must be one of {', '.join(HEAPS)}, got {heap!r}")


def worker_env(inductor_cache: Path, *, peak: bool = False, heap: str = "default") -> dict[str, str]:
    """A worker's environment: this one, with ``inductor_cache`` as Inductor's cache.

    ``peak``: with ``MMAP_THRESHOLD_ENV``, which the CPU peak (VmHWM) needs
    (measure.py). Otherwise the worker is timed, on the heap ``heap`` names
    (``HEAPS``). The caller's own malloc settings are dropped either way:
    ``MMAP_THRESHOLD_ENV`` costs page faults on each allocation (25% on
    store-all's actor microbatch, 15% on GC's: the study bench/overhead.py
    of commit 1a36683), so peaks are measured by workers of their own.
    """
    check_heap(heap)
    env = {k: v for k, v in os.environ.items() if k not in _HEAP_VARS}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    if peak:
        return {**env, **MMAP_THRESHOLD_ENV}
    return {**env, **FIXED_HEAP_ENV} if heap == "fixed" else env


class WorkerError(RuntimeError):
    """A worker answered with an error or died; the message says which and why.

    ``min_budget_bytes``: where a plan did not fit its memory budget, the
    smallest budget the solver could meet (else None).
    """

    def __init__(self, message: str, *, min_budget_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class WorkerProcess:
    """A running worker and the pipe to it; its stderr goes to ``log_path``."""

    #: The module run as the worker (``python -m MODULE '<config JSON>'``).
    MODULE = "hilore_compiler.bench.worker"

    def __init__(self, config: WorkerConfig | dict[str, Any], *, env: dict[str, str], log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self._log = open(log_path, "w")
        text = config.to_json() if isinstance(config, WorkerConfig) else json.dumps(config)
        cmd = [sys.executable, "-m", self.MODULE, text]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True)

    def request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        """Send one command and wait for its answer."""
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise WorkerError(f"worker exited with code {self.proc.wait()}; last lines of "
                              f"{self.log_path}:\n{log_tail(self.log_path)}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise WorkerError(reply["error"], min_budget_bytes=reply.get("min_budget_bytes"))
        return reply

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not within a minute."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker log (dynamo warnings dropped) for error messages."""
    text = [s for s in Path(path).read_text(errors="replace").splitlines() if not s.startswith("W")]
    return "\n".join(text[-lines:])
