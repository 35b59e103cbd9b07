"""``min_seq_len`` / ``max_seq_len`` hold for static and dynamic graphs; a longer call is planned and said once.

Roofline costs (``cost_model``): nothing is timed, so the plans are the same on any machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hilore_compiler.backend import HiLoReBackend
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.models import build_model

pytestmark = pytest.mark.slow

OPTIONS = {"codecs": [], "buckets": 1, "verbose": False, "cost_model": "roofline:h100", "strict": True}


def _step(compiled, length: int) -> list[str]:
    """One forward and backward at ``length``; what the backend warned."""
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(length))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(ids).float().pow(2).mean().backward()
    return [str(w.message) for w in caught if issubclass(w.category, HiLoReWarning)]


def test_a_static_graph_is_planned_over_the_options_lengths(tmp_path):
    backend = HiLoReBackend({**OPTIONS, "cache_dir": str(tmp_path), "min_seq_len": 8, "max_seq_len": 64})
    assert _step(torch.compile(build_model("tiny"), backend=backend, dynamic=False), 16) == []
    (graph,) = backend.graphs
    assert not graph.planner.dynamic and graph.planner.seq_range == (8, 64)
    assert graph.plan.length_range == (8, 64)  # the ceiling checked at 64, not at 16


def test_a_static_call_beyond_max_seq_len_is_planned_and_said_once(tmp_path):
    backend = HiLoReBackend({**OPTIONS, "cache_dir": str(tmp_path), "max_seq_len": 8})
    said = _step(torch.compile(build_model("tiny"), backend=backend, dynamic=False), 16)
    assert len(said) == 1 and "sequence length 16 is beyond max_seq_len 8" in said[0]
    (graph,) = backend.graphs
    assert graph.plan is not None and graph.planner.seq_range == (16, 16)


def test_a_dynamic_graph_keeps_max_seq_len_and_says_once_when_a_call_goes_beyond(tmp_path):
    backend = HiLoReBackend({**OPTIONS, "cache_dir": str(tmp_path), "max_seq_len": 32})
    compiled = torch.compile(build_model("tiny"), backend=backend, dynamic=True)
    assert _step(compiled, 16) == [] and _step(compiled, 24) == []
    (graph,) = backend.graphs
    assert graph.planner.dynamic and graph.planner.seq_range == (16, 32) and graph.resolves == 0
    said = _step(compiled, 40) + _step(compiled, 48)
    assert len(said) == 1 and "sequence length 40 is beyond max_seq_len 32" in said[0]
    assert graph.resolves == 1 and graph.planner.seq_range == (16, 64)  # widened past it, as without a bound
