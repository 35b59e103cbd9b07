"""Test-wide settings.

Inductor's graph caches (FX graph, AOTAutograd) are off so every compile
runs the hilore partitioner (a cache hit would skip it and leave nothing to
inspect); its C++ kernel cache stays on, so a kernel many tests generate is
compiled once. The backend's zero-config plans go to a per-session folder,
not ~/.cache. Dynamo's per-frame recompile limit is raised (see below).
"""

import os
import tempfile

import pytest

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("HILORE_CACHE_DIR", tempfile.mkdtemp(prefix="hilore-test-cache-"))


def pytest_configure(config):
    import torch._dynamo

    # Dynamo caches compiled frames per code object and, past the limit,
    # silently runs a frame eagerly: the suite compiles the same model
    # classes (a Llama forward, a TRL backbone) with many backends in one
    # process, far more often than a training job does.
    torch._dynamo.config.recompile_limit = 64


def pytest_sessionstart(session):
    import torch

    # Under pytest-xdist each worker would otherwise start one intra-op
    # thread per core, and two workers on two cores would spin against each
    # other; the cores are shared out instead.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    """Each test module starts with dynamo's per-code state cleared.

    Dynamo remembers every shape it has compiled a code object at, for the
    process: after a module compiled the built-in Llama's forward at (1, 16),
    the next module's first compile at (2, 32) came out dynamic (automatic
    dynamic shapes), and hilore rightly fell back to plain Inductor for it.
    Under pytest-xdist which modules share a process changes with the file
    list, so without this a module's result depended on its neighbours.
    """
    import torch._dynamo

    torch._dynamo.reset()
    yield
