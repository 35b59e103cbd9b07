"""hilore bench: the methods' plumbing, the budget search, the CLI, one tiny real run
(the measurements themselves: test_measure.py; paired rounds: test_rounds.py; the report:
test_bench_report.py)."""

from __future__ import annotations

import dataclasses
import json
import types
from collections.abc import Iterator

import pytest
import torch

from hilore_compiler.bench.checkpointing import Checkpointed
from hilore_compiler.bench.methods import (
    METHODS,
    MethodOptions,
    prepare_method,
    uniform_plan,
    wrap_layers,
)
from hilore_compiler.bench.plans import choose_bucket, plan_summary, step_cosines
from hilore_compiler.bench.report import Spread
from hilore_compiler.bench.launcher import PEAK_STEPS
from hilore_compiler.bench.runner import BenchConfig, resolve_device, run_bench
from hilore_compiler.bench.search import Probe, choose, grid, search_budget
from hilore_compiler.bench.worker import Worker, WorkerConfig, actor_step, flat_grad, make_data
from hilore_compiler.cli import build_parser
from hilore_compiler.commands.bench import config_from_args
from hilore_compiler.grpo import GRPOConfig
from hilore_compiler.models import build_model, token_logprobs
from hilore_compiler.solver import solve
from hilore_compiler.solver.risk import error2_to_cosine, parse_risk_budget
from hilore_compiler.solver.synthetic import SyntheticConfig, random_trace, synthetic_trace


# --- device and spreads ----------------------------------------------------

def test_cuda_without_a_gpu_fails_before_any_worker(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device.*--device cpu"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        run_bench(BenchConfig(device="cuda", methods=("gc",)), progress=lambda _: None)


def test_spread_of_repeated_values():
    s = Spread.of([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median, s.min, s.max, s.q1, s.q3) == (3.0, 1.0, 100.0, 2.0, 4.0)
    assert Spread.of([5.0]).q3 == 5.0


# --- methods ---------------------------------------------------------------

def test_checkpointed_layers_keep_the_gradient():
    data = make_data(256, 2, 16, seed=0, device=torch.device("cpu"))
    grads = []
    for wrap in (False, True):
        model = build_model("tiny", seed=0)
        if wrap:
            wrap_layers(model)
            assert all(isinstance(layer, Checkpointed) for layer in model.layers)
        actor_step(model, data, GRPOConfig())
        grads.append(flat_grad(model))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_uniform_plan_compresses_every_unit_where_int8_is_usable():
    trace = random_trace(3, num_units=12)
    plan = uniform_plan(trace, "int8")
    assert len([b for b in plan.buckets if not b.skip]) == 1  # one compiled variant
    bucket = next(b for b in plan.buckets if not b.skip)
    for unit in trace.units:
        cost = unit.codecs.get("int8")
        expected = "compress:int8" if cost is not None and cost.usable else "store"
        assert dict(bucket.decisions)[unit.key] == expected
    assert "recompute" not in dict(bucket.decisions).values()
    # Its predicted peak counts the eager loss as HiLoRe's plans do: the loss phase
    # (kept + outputs + loss) grows with the ratio the worker measured.
    import dataclasses

    with_outputs = dataclasses.replace(trace, output_bytes="100000")
    bare, lossy = (next(b for b in uniform_plan(with_outputs, "int8", ratio).buckets if not b.skip)
                   for ratio in (0.0, 3.0))
    assert lossy.memory_bytes == bare.kept_bytes + 100000 + 300000 > bare.memory_bytes


def test_hilore_blind_is_hilore_with_one_bucket(tmp_path):
    options = MethodOptions(hilore_budget="1.10x-gc", hilore_buckets=3, hilore_cache_dir=str(tmp_path))
    backends = {name: prepare_method(name, build_model("tiny", seed=0), options).backend
                for name in ("hilore", "hilore-blind")}  # torch.compile is lazy: nothing compiles
    hilore, blind = backends["hilore"].options, backends["hilore-blind"].options
    assert (hilore.buckets, blind.buckets) == (3, 1)
    assert (blind.memory_budget, blind.codecs) == (hilore.memory_budget, hilore.codecs)
    assert METHODS.index("hilore-blind") == METHODS.index("hilore") + 1


def test_choose_bucket_refuses_a_backend_that_fell_back():
    fell_back = types.SimpleNamespace(graphs=[types.SimpleNamespace(plan=None)])
    with pytest.raises(RuntimeError, match="fell back to Inductor's partition"):
        choose_bucket(fell_back, torch.ones(2))
    assert choose_bucket(types.SimpleNamespace(graphs=[]), torch.ones(2)) is None


def test_a_bucket_step_is_held_to_its_share_of_the_update_error_budget():
    """The risk budget bounds the whole update, sum_b q_b s_b^2: one bucket's
    step alone may reach risk_budget / q_b, the blind plan's (q = 1) the
    update's own cos >= 0.999; the plan's prediction for the step is risk_b / q_b."""
    trace = synthetic_trace(SyntheticConfig(num_layers=1, hidden=64, intermediate=172, heads=4, kv_heads=2,
                                            vocab=128, batch=2, seq_len=16))
    for buckets in (3, 1):
        plan = solve(trace, "0.85x-store", buckets=buckets)
        summary = json.loads(json.dumps(plan_summary(types.SimpleNamespace(
            graphs=[types.SimpleNamespace(plan=plan, records=[])]))))  # as it crosses the worker's pipe
        solved = [b for b in plan.buckets if not b.skip]
        assert len(solved) == buckets
        for b in solved:
            cosines = step_cosines(summary, b.bucket.name)
            assert cosines["cosine_bound"] == pytest.approx(error2_to_cosine(plan.risk_budget / b.error_share))
            assert cosines["predicted_cosine"] == pytest.approx(error2_to_cosine(b.risk / b.error_share))
            assert cosines["predicted_cosine"] >= cosines["cosine_bound"]
        bounds = [step_cosines(summary, b.bucket.name)["cosine_bound"] for b in solved]
        assert bounds == sorted(bounds)  # the more error share, the tighter
    assert bounds == [pytest.approx(error2_to_cosine(parse_risk_budget("cos>=0.999")))]
    assert bounds[0] == pytest.approx(0.999)
    assert step_cosines(summary, "zero") == {} and step_cosines({}, "b0") == {}


def test_bf16_worker_config_round_trips_and_steps_with_fp32_logprobs():
    config = WorkerConfig(method="store-all", model="tiny", batch=2, seq_len=16, seed=0, device="cpu",
                          warmup=0, options=MethodOptions(), dtype="bfloat16")
    assert WorkerConfig.from_json(config.to_json()) == config
    worker = Worker(config)  # builds model and data; the compiled policy is not called
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    logits = worker.model(worker.data.input_ids)
    assert logits.dtype == torch.bfloat16 and token_logprobs(logits, worker.data.input_ids).dtype == torch.float32
    actor_step(worker.model, worker.data, worker.loss_config)  # one eager bf16 step
    assert flat_grad(worker.model).isfinite().all()
    with pytest.raises(ValueError, match="dtype must be one of"):
        BenchConfig(dtype="float16")


def test_tinyllama_8l_builds_on_meta_with_tinyllama_shapes():
    model = build_model("tinyllama-8l", device="meta", dtype=torch.bfloat16)
    c, v, layers, inter, kv = 2048, 32000, 8, 5632, 4 * (2048 // 32)  # 4 kv heads of head_dim 64
    per_layer = 2 * c * c + 2 * c * kv + 3 * c * inter + 2 * c  # q, o; k, v; SwiGLU; two RMSNorms
    assert sum(p.numel() for p in model.parameters()) == 2 * v * c + c + layers * per_layer  # 483,428,352
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert (model.config.n_kv_heads, model.config.max_seq_len, model.config.rope_theta) == (4, 4096, 10000.0)


# --- budget search ---------------------------------------------------------

class _FakeWorker:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


class _FakeRun:
    def __init__(self, budget: float):
        self.budget, self.worker, self.error = budget, _FakeWorker(), None


def test_budget_grid_keeps_the_fastest_probe_that_fits_non_monotone_peaks():
    runs = []

    def probe(budget):
        runs.append(_FakeRun(budget))
        return runs[-1]

    # Peaks as measured on CPU: not monotone in the budget. Seconds fall with
    # the budget (less recompute); 0.875 is fastest but does not fit.
    peaks = {0.125: 252.8, 0.375: 224.9, 0.625: 275.9, 0.875: 229.0}
    seconds = {0.125: 1.3, 0.375: 1.2, 0.625: 1.0, 0.875: 0.9}
    kept, record = search_budget(probe, lambda r: peaks[r.budget], lambda r: seconds[r.budget],
                                 target_bytes=225.0, probes=4, progress=lambda m: None)
    assert grid(4) == [p.budget for p in record.probes] == [0.125, 0.375, 0.625, 0.875]
    # 0.375 (224.9) and 0.875 (229.0 <= 225 x 1.02) fit; 0.875 is faster.
    assert kept.budget == record.chosen == 0.875
    assert kept.worker and not kept.worker.closed
    assert all(r.worker is None for r in runs if r is not kept)  # the others were closed
    assert record.to_json()["probes"][1] == {"budget": 0.375, "peak_bytes": 224.9, "seconds": 1.2,
                                             "error": None}
    assert grid(1) == [0.5]


def test_choose_falls_back_to_the_smallest_peak():
    probes = [Probe(budget=0.5, peak_bytes=90.0), Probe(budget=0.25, peak_bytes=70.0),
              Probe(budget=0.1, peak_bytes=None, error="boom")]
    assert choose(probes, target_bytes=50.0, tolerance=0.02).budget == 0.25
    assert choose(probes[2:], target_bytes=50.0, tolerance=0.02) is None
    fast_and_fits = Probe(budget=0.9, peak_bytes=50.0, seconds=0.5)
    assert choose(probes + [fast_and_fits, Probe(budget=0.1, peak_bytes=40.0, seconds=0.9)],
                  target_bytes=50.0, tolerance=0.02) is fast_and_fits


# --- command line ----------------------------------------------------------

def test_cli_defaults_are_the_full_configuration():
    config = config_from_args(build_parser().parse_args(["bench"]))
    assert (config.model, config.batch, config.seq_len) == ("small", 2, 2048)
    assert config.hilore_budget == "1.10x-gc" and "hilore-blind" in config.methods and config.dtype == "float32"


def test_cli_quick_and_explicit_options():
    args = build_parser().parse_args(["bench", "--quick", "--methods", "gc, store-all", "--repeats", "7",
                                      "--dtype", "bfloat16"])
    config = config_from_args(args)
    assert (config.model, config.seq_len, config.repeats, config.dtype) == ("tiny", 128, 7, "bfloat16")
    assert config.methods == ("gc", "store-all")
    with pytest.raises(ValueError, match="unknown or no methods"):
        config_from_args(build_parser().parse_args(["bench", "--methods", "nope"]))


def test_cli_codecs_apply_to_hilore_and_none_means_exact():
    parse = build_parser().parse_args
    assert config_from_args(parse(["bench"])).hilore_codecs == ("bf16", "int8")
    assert config_from_args(parse(["bench", "--codecs", "int8"])).hilore_codecs == ("int8",)
    assert config_from_args(parse(["bench", "--codecs", "none"])).hilore_codecs == ()
    with pytest.raises(ValueError, match="unknown codec"):
        config_from_args(parse(["bench", "--codecs", "int3"]))


def test_cli_step_chunks_are_auto_or_token_counts_and_reach_the_worker():
    parse = build_parser().parse_args
    assert config_from_args(parse(["bench"])).step_chunks == ()
    assert config_from_args(parse(["bench", "--step-chunks", "auto"])).step_chunks == (0,)
    assert config_from_args(parse(["bench", "--step-chunks", "64, 128"])).step_chunks == (64, 128)
    for bad in ("0,64", "many"):
        with pytest.raises(SystemExit):
            parse(["bench", "--step-chunks", bad])
    options = MethodOptions(step_chunks=(64, 128))
    assert MethodOptions.from_json(json.loads(json.dumps(dataclasses.asdict(options)))) == options


# --- one real run ----------------------------------------------------------

@pytest.mark.slow
def test_two_cheap_methods_run_in_worker_processes(request, monkeypatch):
    # Inductor's cache lives in pytest's cache directory: the first run pays
    # for compiling the kernels (about a minute per method on a busy 2-core
    # CPU), later runs take seconds. conftest turns caches off for in-process
    # compiles that inspect the partitioner; these workers inspect nothing.
    monkeypatch.delenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # set by a caller: must not reach the timed workers
    cache = request.config.cache.mkdir("hilore-bench-compile")
    config = BenchConfig(model="tiny", batch=2, seq_len=32, methods=("store-all", "gc"), repeats=2,
                         steps_per_round=1, warmup=1, device="cpu", threads=1, cache_dir=str(cache))
    run = run_bench(config, progress=lambda m: None)
    runs = {r.method: r for r in run.runs}
    assert all(r.status == "ok" for r in runs.values()), [r.error for r in runs.values()]
    for r in runs.values():
        # At this size a step may fit in pages the process already holds: peak >= 0, not > 0.
        assert len(r.samples) == 2 and all(s.seconds > 0 and s.peak_bytes >= 0 for s in r.samples)
        assert [s.round for s in r.samples] == [0, 1]  # tagged for the paired ratios
        assert [s.round for s in r.settle] == [-1]  # the settling round: timed, not counted
        # Peaks from a worker with the VmHWM allocator setting, rounds timed by one without it.
        assert len(r.peaks) == PEAK_STEPS and r.info["mmap_threshold_set"] and r.info["threads"] == 1
        assert r.info["timed_worker"]["mmap_threshold_set"] is False
    assert runs["store-all"].fidelity["cosine"] == pytest.approx(1.0)
    # Recompute is deterministic: GC's gradient is store-all's up to fp32 reordering.
    assert runs["gc"].fidelity["cosine"] > 0.99999
    assert run.run_dir is None  # nothing failed: logs and gradients were cleaned up


class FakeWorker:
    """A ``WorkerProcess`` that answers at once, its plan digest the next of ``digests``."""

    digests: Iterator[str] = iter(())
    spawned: list[FakeWorker] = []

    def __init__(self, config, env, log_path):
        self.config, self.log, self.closed = config, log_path.name, False
        self.peak_allocator = env.get("MALLOC_MMAP_THRESHOLD_") is not None
        self.digest = next(self.digests)
        self.spawned.append(self)

    def request(self, cmd, **fields):
        if cmd == "measure":
            return {"samples": [{"seconds": 1.0, "peak_bytes": 7}] * fields["steps"]}
        return {"compile_s": 1.0, "warmup": [], "info": {"mmap_threshold_set": self.peak_allocator,
                                                         "plan": {"decisions_digest": self.digest}}}

    def close(self):
        self.closed = True


@pytest.fixture
def fake_workers(monkeypatch):
    from hilore_compiler.bench import launcher

    def use(*digests: str) -> list[FakeWorker]:
        monkeypatch.setattr(FakeWorker, "digests", iter(digests))
        monkeypatch.setattr(FakeWorker, "spawned", [])
        monkeypatch.setattr(launcher, "WorkerProcess", FakeWorker)
        return FakeWorker.spawned
    return use


def test_a_timed_worker_with_another_plan_fails_its_method(tmp_path, fake_workers):
    """The peak is measured by one worker and the rounds timed by another: if
    they ran different plans (an unshared plan cache), the row would pair one
    plan's peak with another's speed, so the method fails instead."""
    from hilore_compiler.bench.launcher import Launcher

    fake_workers("aaaa", "cccc", "bbbb", "cccc")  # two peak workers, then their timed workers
    said: list[str] = []
    launcher = Launcher(BenchConfig(model="tiny"), "cpu", tmp_path, said.append)
    changed, same = launcher.start("store-all"), launcher.start("sac")
    assert changed.peaks == [7] * PEAK_STEPS and changed.worker is None  # the peak worker exited
    launcher.time(changed)
    launcher.time(same)
    assert changed.status == "failed" and "another plan (decisions bbbb) than its peak worker (aaaa)" in changed.error
    assert same.status == "ok" and same.worker is not None


def test_a_method_that_plans_does_so_in_its_timed_worker_and_its_peak_worker_compiles_from_the_caches(
        tmp_path, fake_workers):
    """The process that traces, profiles and solves reads a higher VmHWM peak
    for the same plan (a fragmented heap), so a HiLoRe method's peak worker
    comes second, and the first, the one the rounds time, writes the gradient."""
    from hilore_compiler.bench.launcher import Launcher

    spawned = fake_workers("aaaa", "aaaa", "bbbb", "cccc")
    launcher = Launcher(BenchConfig(model="tiny"), "cpu", tmp_path, [].append)
    run = launcher.start("hilore")
    timed, peak = spawned
    assert (timed.log, timed.peak_allocator, peak.log, peak.peak_allocator) == \
        ("hilore-timed.log", False, "hilore.log", True)
    assert timed.config.grad_path == run.grad_path and peak.config.grad_path is None
    assert run.status == "ok" and run.peaks == [7] * PEAK_STEPS and peak.closed
    assert run.worker is timed and not timed.closed and run.info["timed_worker"]["mmap_threshold_set"] is False
    launcher.time(run)
    assert len(spawned) == 2  # the timed worker is set up already

    other = launcher.start("hilore-blind")  # its two workers made different plans
    assert other.status == "failed" and "another plan (decisions bbbb) than its peak worker (cccc)" in other.error
    assert other.worker is None and all(w.closed for w in spawned[2:])

