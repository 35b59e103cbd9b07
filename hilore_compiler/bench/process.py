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

from .measure import MMAP_THRESHOLD_ENV
from .worker import WorkerConfig


def worker_env(inductor_cache: Path, *, peak: bool = False) -> dict[str, str]:
    """A worker's environment: this one, with ``inductor_cache`` as Inductor's cache.

    ``peak``: with ``MMAP_THRESHOLD_ENV``, which the CPU peak (VmHWM) needs
    (measure.py). Otherwise the setting is dropped, even if the caller set
    it: it costs page faults on each allocation (25% on store-all's actor
    microbatch, 15% on GC's: the study bench/overhead.py of commit 1a36683), so a worker that is timed
    runs on the default allocator, as a trainer does, and peaks are measured
    by workers of their own.
    """
    env = {k: v for k, v in os.environ.items() if k not in MMAP_THRESHOLD_ENV}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
    return {**env, **MMAP_THRESHOLD_ENV} if peak else env


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
