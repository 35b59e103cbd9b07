"""Rank 0 plans, the other ranks run its plans: the store exchange (``distributed/plan_share``).

Two ranks are played in one process over one store, in turn: rank 0
compiles, then rank 1 compiles the same model at another length. The
two-process run under verl is ``tests/test_verl.py``.
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
from torch import nn

from hilore_compiler.backend import BackendOptions, HiLoReBackend, planning
from hilore_compiler.backend.cachekey import structure_key
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.distributed import plan_share
from hilore_compiler.distributed.plan_share import PlanShare
from hilore_compiler.distributed.plan_sync import plan_digest

#: int8 on; one range for both ranks, as the verl engine sets it.
OPTIONS = {"codecs": ["int8"], "buckets": 1, "verbose": False, "min_seq_len": 8, "max_seq_len": 32}


class DictStore:
    """The part of a c10d store the exchange uses, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        #: As if rank 0 had started planning every graph (set its ``planning`` key).
        self.all_started = False

    def set(self, key: str, value: str | bytes) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values or (self.all_started and k.endswith("/planning")) for k in keys)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.fixture
def as_rank(monkeypatch, tmp_path):
    """``as_rank(r, seq_len, **options)``: compile and step the MLP as rank ``r`` of a 2-rank group."""
    store = DictStore()
    monkeypatch.setattr(plan_share, "_gave_up", False)
    monkeypatch.setattr(plan_share, "_warned", False)
    monkeypatch.setattr(plan_share, "POLL_S", 0.01)

    def run(rank: int, seq_len: int, dynamic: bool = False, **options):
        monkeypatch.setattr(plan_share, "process_store", lambda: (store, rank))
        torch._dynamo.reset()
        backend = HiLoReBackend({**OPTIONS, "cache_dir": str(tmp_path / f"rank{rank}"), **options})
        x = torch.randn(2, seq_len, 8)  # (B, S, H)
        torch.compile(_mlp(), backend=backend, dynamic=dynamic)(x).pow(2).mean().backward()
        (graph,) = backend.graphs
        return graph

    run.store = store
    return run


@pytest.fixture
def traced(monkeypatch):
    """The lengths each profiling of a joint graph ran at."""
    seen: list[int] = []
    real = planning.trace_capture

    def trace_capture(capture, options, batch, seq_len, name):
        seen.append(seq_len)
        return real(capture, options, batch, seq_len, name)

    monkeypatch.setattr(planning, "trace_capture", trace_capture)
    return seen


def test_rank_1_runs_rank_0s_plan_and_profiles_nothing(as_rank, traced):
    first = as_rank(0, 16)
    assert first.planner.source == "made" and traced == [16]
    second = as_rank(1, 24)  # another length, as each rank's packed micro-batches have
    assert second.planner.source == "rank 0" and traced == [16]
    assert plan_digest(second.plan) == plan_digest(first.plan)
    assert any(o.option == "compress:int8" for u in first.plan.units for o in u.options)


def test_without_sharing_rank_1_profiles_its_own(as_rank, traced):
    as_rank(0, 16)
    alone = as_rank(1, 24, share_plans=False)
    assert alone.planner.source == "made" and traced == [16, 24]


def test_a_rank_whose_range_is_not_covered_solves_rank_0s_trace(as_rank, traced):
    as_rank(0, 16, dynamic=True)  # a dynamic graph's trace: sizes are expressions of B and S
    longer = as_rank(1, 48, dynamic=True)  # beyond max_seq_len: planned over 8..48, from rank 0's trace
    assert longer.planner.source == "rank 0" and traced == [16]
    assert longer.plan.length_range == (8, 48)


def test_rank_0s_plan_that_does_not_fit_is_said_and_planned_here(as_rank, traced):
    as_rank(0, 16)  # a static graph's trace: its sizes are numbers, at length 16
    with pytest.warns(HiLoReWarning, match="rank 0's plan does not fit this graph here"):
        alone = as_rank(1, 48)  # solved from it for 8..48, the plan's sizes are 16's
    assert alone.plan is not None and alone.planner.source == "made" and traced == [16, 48]


def test_a_rank_waits_only_while_rank_0_is_planning_and_says_once_when_it_plans_alone(as_rank, traced,
                                                                                      monkeypatch):
    monkeypatch.setattr(plan_share, "START_GRACE_S", 0.05)
    start = time.monotonic()
    with pytest.warns(HiLoReWarning, match="rank 0 is not planning this graph now") as caught:
        alone = as_rank(1, 24, share_timeout_s=600.0)  # rank 0 never started this graph
    assert time.monotonic() - start < 300  # no wait for the timeout
    assert alone.plan is not None and alone.planner.source == "made" and traced == [24]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        as_rank(1, 20, share_timeout_s=600.0, cost_model="roofline:h100")
    assert sum("rank 0" in str(w.message) for w in caught) == 1


def test_a_record_rank_1_cannot_read_is_said_once_and_the_graph_planned_here(as_rank, traced):
    """Whatever rank 0's record holds (here: not JSON), rank 1's step goes on: it plans alone."""
    key_of = {}
    real_init = PlanShare.__init__

    def init(self, store, rank, key, timeout_s):
        real_init(self, store, rank, key, timeout_s)
        key_of["trace"] = self._trace_key

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PlanShare, "__init__", init)
        as_rank(0, 16)
        as_rank.store.values[key_of["trace"]] = b"{not json"
        with pytest.warns(HiLoReWarning, match="could not be read .* plans it on its own"):
            alone = as_rank(1, 24)
    assert alone.plan is not None and alone.planner.source == "made" and traced == [16, 24]


def test_a_graph_that_saves_nothing_is_shared_as_empty_not_as_a_trace(monkeypatch):
    """An FSDP root graph saves nothing for backward: rank 0 records ``empty``, and the
    other rank plans nothing for it, instead of failing to read a trace without units."""
    from hilore_compiler.tracefile import Trace

    store = DictStore()
    rank0, rank1 = PlanShare(store, 0, "g", 1.0), PlanShare(store, 1, "g", 1.0)
    empty = Trace(fingerprint="0" * 16, model="graph", batch=2, seq_len=8, device="cpu", cost_source="measured",
                  units=(), gc_bytes="0", store_bytes="0", num_layers=0)
    rank0.publish(empty)
    shared = rank1.wait()
    assert shared is not None and shared.empty and shared.trace is None


def test_a_store_that_fails_while_rank_1_waits_is_said_and_the_graph_planned_here():
    class Gone(DictStore):
        def check(self, keys):
            raise ConnectionResetError("rank 0 closed the connection")

    with pytest.warns(HiLoReWarning, match="ConnectionResetError"):
        assert PlanShare(Gone(), 1, "g", 1.0).wait() is None


def test_rank_0_started_but_did_not_finish_in_time(as_rank, traced):
    as_rank.store.all_started = True  # rank 0 started every graph and finishes none
    with pytest.warns(HiLoReWarning, match="did not finish planning a graph within 0.05 s"):
        alone = as_rank(1, 24, share_timeout_s=0.05)
    assert alone.planner.source == "made" and plan_share._gave_up


def test_rank_0_runs_its_cached_plans_and_publishes_them(as_rank, traced):
    made = as_rank(0, 16)
    as_rank.store.values.clear()  # a new run: the cache holds the plan, the store nothing
    cached = as_rank(0, 16)
    assert cached.planner.source == "cache" and traced == [16]
    assert plan_digest(as_rank(1, 24).plan) == plan_digest(made.plan)


def test_the_structure_key_is_the_same_at_every_length_and_tells_static_from_dynamic():
    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    for dynamic, lengths in ((False, (16, 24)), (None, (16, 24, 40))):  # None: static first, then symbolic
        torch._dynamo.reset()
        model = torch.compile(_mlp(), backend=record, dynamic=dynamic)
        for seq_len in lengths:
            model(torch.randn(2, seq_len, 8))
    options = BackendOptions.from_mapping(OPTIONS)
    keys = [structure_key(gm, inputs, options) for gm, inputs in graphs]
    assert len(keys) == 4 and keys[0] == keys[1] == keys[2] != keys[3]  # static x3, then the dynamic graph
    gm, inputs = graphs[0]
    assert structure_key(gm, inputs, BackendOptions.from_mapping({**OPTIONS, "codecs": []})) != keys[0]


def test_the_exchange_over_a_real_store_waits_for_rank_0():
    from datetime import timedelta

    import torch.distributed as dist

    from hilore_compiler.planload import plan_from_json
    from hilore_compiler.solver import solve
    from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace

    trace = synthetic_trace(SyntheticConfig(num_layers=2, codecs=("int8",)))
    plan = solve(trace, budget="1.10x-gc", buckets=1, codecs=["int8"], batch=trace.batch, seq_len=trace.seq_len)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
    rank0, rank1 = PlanShare(master, 0, "k", 30.0), PlanShare(client, 1, "k", 30.0)
    assert rank1.peek() is None
    found = plan_share.plan_set([plan], trace.batch, (trace.seq_len, trace.seq_len), 1)
    threading.Timer(0.3, rank0.publish, (trace, found)).start()  # rank 0 still profiling when rank 1 asks
    shared = rank1.wait()
    assert shared is not None and shared.trace.to_json() == trace.to_json()
    got = shared.find(trace.batch, (trace.seq_len, trace.seq_len), 1)
    assert got is not None and plan_digest(got.plans[0]) == plan_digest(plan_from_json(plan.to_json()))
    assert shared.find(trace.batch, (1, trace.seq_len), 1) is None  # a range it was not solved for


def test_the_sharing_options_are_checked():
    assert BackendOptions.from_mapping({"share_plans": False, "share_timeout_s": 30}).share_timeout_s == 30
    for bad in ({"share_plans": "no"}, {"share_timeout_s": 0}, {"share_timeout_s": None}):
        with pytest.raises(ValueError, match="share_"):
            BackendOptions.from_mapping(bad)
