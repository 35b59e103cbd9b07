"""Several processes on one machine, one process group: the harness of tests and bench.

``spawn(fn, nproc, *args)`` starts ``nproc`` fresh interpreters (``spawn``,
not ``fork``: torch's thread pools do not survive a fork), joins them into one
process group on a free local port, runs ``fn(rank, world, *args)`` in each
and returns the ranks' results in rank order. A rank that raises ends the run:
its traceback is raised here and the other ranks, which may be waiting in a
collective for it, are killed.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Environment of every child. One Inductor compile worker: the children
#: compile at the same time and a worker pool each would oversubscribe the CPUs.
CHILD_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_backend(nproc: int) -> str:
    """``nccl`` when every one of ``nproc`` ranks can have a GPU of its own, else ``gloo``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= nproc and dist.is_nccl_available() else "gloo"


def _child(rank: int, world: int, port: int, backend: str, threads: int, env: Mapping[str, str],
           fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update({**CHILD_ENV, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    if threads > 0:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=10))
        results.put((rank, True, fn(rank, world, *args)))
    except Exception:  # reported to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, backend: str | None = None,
          threads: int = 1, env: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` processes of one group; results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    ``threads``: torch threads per process (0 keeps torch's default).

    Raises:
        RankFailed: a rank raised (its traceback is the message), exited
            without a result, or ``timeout_s`` passed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    backend = backend or default_backend(nproc)
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, nproc, port, backend, threads, dict(env or {}),
                                              fn, args, results), daemon=True) for r in range(nproc)]
    _start(procs, env or {})
    try:
        return _collect(procs, results, nproc, time.monotonic() + timeout_s)
    finally:
        for p in procs:  # only our own children, by handle
            if p.is_alive():
                p.kill()
            p.join()


def _start(procs: list, env: Mapping[str, str]) -> None:
    """Start the children with ``env`` in their environment from exec on.

    Set in this process around ``start`` because some variables (glibc's
    ``MALLOC_MMAP_THRESHOLD_``, which the CPU peak measurement needs) are read
    when the interpreter starts, before ``_child`` could set them.
    """
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _collect(procs: list, results: Any, nproc: int, deadline: float) -> list[Any]:
    got: dict[int, Any] = {}
    while len(got) < nproc:
        if not results.empty():
            rank, ok, value = results.get()
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            got[rank] = value
            continue
        dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
        if dead and results.empty():
            time.sleep(0.5)  # a result put just before exiting may still be in flight
            if results.empty():
                codes = {r: procs[r].exitcode for r in dead}
                raise RankFailed(f"rank(s) {dead} exited without a result (exit codes {codes})")
        if time.monotonic() > deadline:
            raise RankFailed(f"no result from rank(s) {sorted(set(range(nproc)) - set(got))} in time")
        time.sleep(0.05)
    return [got[r] for r in range(nproc)]
