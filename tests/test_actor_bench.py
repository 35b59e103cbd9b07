"""hilore bench --actor-update: the GRPO batch it runs, its worker's measurement, its table and CLI."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hilore_compiler.cli import build_parser
from hilore_compiler.models import build_model, token_logprobs


def test_actor_update_batch_is_a_realistic_grpo_batch():
    """Groups with zero reward variance (zero exposure), varying response
    lengths, second-iteration ratios that clip, and a pre-forward bucketing
    that never understates the exposure the backward sees."""
    from hilore_compiler.bench.actor import ActorBenchConfig, batch_exposures, loss_config, make_batch
    from hilore_compiler.grpo import exposure_before_backward, exposure_buckets
    from hilore_compiler.grpo.coefficients import exposure_bound_before_forward, unclipped

    config = ActorBenchConfig(model="tiny", seq_len=48, prompt_len=8, groups=6, seed=1)
    policy = build_model("tiny", seed=0)
    batch = make_batch(policy, config)
    b = batch.input_ids.shape[0]
    assert b == 48 and len(set(batch.response_mask.sum(-1).tolist())) > 3
    rewards = batch.rewards.view(config.groups, config.group_size)
    flat = (rewards.min(1).values == rewards.max(1).values).repeat_interleave(config.group_size)
    assert flat.any() and not flat.all()  # some groups all right or all wrong
    assert (batch.advantages[flat] == 0).all() and (batch.advantages[~flat] != 0).all()
    with torch.no_grad():
        logp = token_logprobs(policy(batch.input_ids), batch.input_ids)
    cfg = loss_config(config)
    ratio = torch.exp(logp - batch.old_logprobs)
    adv = batch.advantages.unsqueeze(1).expand_as(ratio)
    clipped = ~unclipped(ratio, adv, cfg) & (batch.response_mask > 0) & (adv != 0)
    assert 0.05 < clipped.float().sum() / (batch.response_mask > 0).sum() < 0.6
    kw = dict(num_sequences=b, num_tokens=float(batch.response_mask.sum()))
    exact = exposure_before_backward(logp, batch.old_logprobs, batch.advantages, batch.response_mask, cfg, **kw)
    bound = exposure_bound_before_forward(batch.advantages, batch.response_mask, cfg, on_policy=False, **kw)
    assert (bound >= exact - 1e-12).all() and ((bound == 0) == flat).all()
    buckets = exposure_buckets(bound, 3)
    for name, x in zip(buckets.assign(bound), exact.tolist()):
        assert x <= buckets.upper(name) * (1 + 1e-9) + 1e-15  # never a lossier bucket than it needs
    mix = batch_exposures(batch, config)
    assert len(mix) == b and sum(x == 0 for x in mix) == int(flat.sum())


def test_actor_worker_frees_gradients_before_each_measured_update():
    """The gradients' allocation is part of every update's peak: freed inside
    the measured window, they would be in the RSS before it and left out
    (measured on the small actor update: 15.8 MB of 46 MB)."""
    from hilore_compiler.bench.actor_worker import ActorWorker

    worker = ActorWorker.__new__(ActorWorker)  # measure() alone: no compile
    worker.model = build_model("tiny")
    fresh = []

    def update() -> None:
        fresh.append(all(p.grad is None for p in worker.model.parameters()))
        for p in worker.model.parameters():
            p.grad = torch.ones_like(p)

    worker.step = update
    assert len(worker.measure(3)) == 3 and fresh == [True, True, True]


def test_actor_worker_reports_its_tensor_peak_as_the_gc_reference(tmp_path):
    """GC's tensor peak (the allocator's), not its VmHWM, is what ``x-gc``
    budgets multiply: the plans' memory model predicts tensor bytes."""
    from hilore_compiler.bench.actor import ActorBenchConfig, tensor_peak
    from hilore_compiler.bench.actor_worker import ActorWorker
    from hilore_compiler.bench.process import WorkerError
    from hilore_compiler.bench.worker import _handle

    worker = ActorWorker.__new__(ActorWorker)  # tensor_peak() alone: no compile
    worker.model = build_model("tiny")

    def update() -> None:
        scratch = torch.ones(1 << 20)  # 4 MB alive for a moment
        for p in worker.model.parameters():
            p.grad = torch.ones_like(p) * scratch[0]

    worker.step = update
    peak = _handle(worker, {"cmd": "tensor_peak"})["tensor_peak_bytes"]
    grads = sum(p.numel() * 4 for p in worker.model.parameters())
    assert peak >= (4 << 20) + grads  # the scratch beside every gradient

    class Process:  # the driver's side of the pipe
        def __init__(self, reply):
            self.reply = reply

        def request(self, cmd):
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

    said = []
    config = ActorBenchConfig(model="tiny")
    assert tensor_peak(config, "gc", tmp_path, {}, said.append, Process({"tensor_peak_bytes": peak})) == peak
    assert tensor_peak(config, "gc", tmp_path, {}, said.append, Process(WorkerError("boom"))) is None
    assert said == ["gc: no tensor peak: boom"]


def test_actor_update_table_and_cli():
    from hilore_compiler.bench import actor
    from hilore_compiler.bench.actor_report import format_table
    from hilore_compiler.commands.bench import actor_config_from_args

    args = build_parser().parse_args(["bench", "--actor-update", "--model", "tiny", "--seq-len", "256",
                                      "--loss-type", "grpo", "--hilore-budget", "0.9x-gc"])
    config = actor_config_from_args(args)
    assert (config.model, config.seq_len, config.loss_type, config.budget) == ("tiny", 256, "grpo", "0.9x-gc")
    assert config.methods == actor.ACTOR_METHODS  # every method unless --methods says otherwise
    chosen = actor_config_from_args(build_parser().parse_args(["bench", "--actor-update",
                                                               "--methods", "gc, gc-skip,hilore-skip"]))
    assert chosen.methods == ("gc", "gc-skip", "hilore-skip")
    with pytest.raises(ValueError, match=r"unknown or no methods \['hilore'\]; choose from store-all"):
        actor_config_from_args(build_parser().parse_args(["bench", "--actor-update", "--methods", "gc,hilore"]))
    with pytest.raises(ValueError, match="--actor-update runs on the CPU only.*drop --device cuda"):
        actor_config_from_args(build_parser().parse_args(["bench", "--actor-update", "--device", "cuda"]))
    row = {"method": "hilore-skip", "label": "HiLoRe, buckets + zero skip", "status": "ok", "error": None,
           "tokens_per_s": {"median": 1234.0}, "peak_bytes": {"median": 5e6}, "speed_vs_gc": 1.2,
           "paired_vs_gc": {"ratio": 1.2, "low": 1.1, "high": 1.31, "rounds": 4},
           "paired_vs_blind": {"ratio": 1.1, "low": None, "high": None, "rounds": 1},
           "paired_vs_no_skip": {"ratio": 1.14, "low": 1.12, "high": 1.16, "rounds": 4},
           "peak_vs_gc": 1.05, "cosine": 0.9999994, "rel_l2": 1.1e-3, "predicted_rel_l2": 1.0e-3,
           "tensor_peak_bytes": 4.4e6, "predicted_peak_bytes": 4.5e6,
           "info": {"samples_skipped": 16, "microbatches": 9}}
    failed = {**row, "method": "gc", "label": "GC", "status": "failed", "error": "boom\nmore"}
    table = format_table({"rows": [row, failed]})
    assert ("| HiLoRe, buckets + zero skip | 1234 | 1.200 [1.100, 1.310] | 1.100 | 1.140 [1.120, 1.160] | 5.0 | "
            "1.050 | 4.4 / 4.5 | 0.999999 | 1.1e-03 / 1.0e-03 | 16 | 9 |") in table
    assert "failed: boom" in table


def test_cli_actor_update_codecs_default_to_bf16_int8_and_take_int4():
    from hilore_compiler.commands.bench import actor_config_from_args

    parse = build_parser().parse_args
    assert actor_config_from_args(parse(["bench", "--actor-update"])).codecs == ("bf16", "int8")
    config = actor_config_from_args(parse(["bench", "--actor-update", "--codecs", "bf16, int8,int4"]))
    assert config.codecs == ("bf16", "int8", "int4")


def test_speed_ratios_are_paired_by_round_against_gc_and_the_blind_plan():
    """A method 1.25x GC's speed in every round, through a machine that slows
    down 3x: the paired ratio is exactly 1.25 with a zero-width interval. A
    skipping method is paired with GC and the blind plan skipping too."""
    from hilore_compiler.bench.actor import ActorBenchConfig
    from hilore_compiler.bench.actor_report import summarise
    from hilore_compiler.bench.measure import StepSample
    from hilore_compiler.bench.rounds import MethodRun

    slow = [1.0, 2.0, 3.0]  # seconds of GC's update per round

    def run(method: str, speedup: float) -> MethodRun:
        r = MethodRun(method=method, grad_path="")
        r.info = {"tokens": 1000}
        r.samples = [StepSample(seconds=t / speedup, peak_bytes=1, round=i) for i, t in enumerate(slow)]
        return r

    runs = {"gc": run("gc", 1.0), "hilore-blind": run("hilore-blind", 1.1), "hilore-buckets": run("hilore-buckets", 1.25)}
    plans = {"info": {"blind": {"predicted_error": 0.0, "buckets": {"b0": {"memory_bytes": 7}}},
                      "buckets": {"predicted_error": 0.0, "buckets": {"zero": {"memory_bytes": 0},
                                                                      "b0": {"memory_bytes": 9}}}}, "mix": []}
    rows = {r["method"]: r for r in summarise(ActorBenchConfig(model="tiny"), runs, plans)["rows"]}
    assert [rows[m]["predicted_peak_bytes"] for m in ("gc", "hilore-blind", "hilore-buckets")] == [None, 7, 9]
    buckets = rows["hilore-buckets"]
    assert buckets["paired_vs_gc"]["ratio"] == pytest.approx(1.25) and buckets["paired_vs_gc"]["rounds"] == 3
    assert buckets["paired_vs_gc"]["high"] - buckets["paired_vs_gc"]["low"] == pytest.approx(0, abs=1e-9)
    assert buckets["paired_vs_blind"]["ratio"] == pytest.approx(1.25 / 1.1)
    assert rows["gc"]["paired_vs_gc"] is None and rows["hilore-blind"]["paired_vs_blind"] is None

    # The zero skip without GC or the blind plan skipping: nothing to pair it with.
    runs["hilore-skip"] = run("hilore-skip", 1.5)
    rows = {r["method"]: r for r in summarise(ActorBenchConfig(model="tiny"), runs, plans)["rows"]}
    assert rows["hilore-skip"]["paired_vs_gc"] is None and rows["hilore-skip"]["paired_vs_blind"] is None
    assert rows["hilore-skip"]["speed_vs_gc"] == pytest.approx(1.5)  # unpaired, against plain GC
    assert rows["hilore-skip"]["paired_vs_no_skip"]["ratio"] == pytest.approx(1.5 / 1.25)  # the skip's worth
    assert rows["hilore-buckets"]["paired_vs_no_skip"] is None
    runs |= {"gc-skip": run("gc-skip", 1.2), "hilore-blind-skip": run("hilore-blind-skip", 1.4)}
    rows = {r["method"]: r for r in summarise(ActorBenchConfig(model="tiny"), runs, plans)["rows"]}
    skip = rows["hilore-skip"]
    assert skip["paired_with"] == {"gc": "gc-skip", "blind": "hilore-blind-skip"}
    assert skip["paired_vs_gc"]["ratio"] == pytest.approx(1.5 / 1.2)
    assert skip["paired_vs_blind"]["ratio"] == pytest.approx(1.5 / 1.4)
    assert rows["hilore-blind-skip"]["paired_vs_gc"]["ratio"] == pytest.approx(1.4 / 1.2)
    assert rows["gc-skip"]["paired_vs_no_skip"]["ratio"] == pytest.approx(1.2)
    assert rows["hilore-blind-skip"]["predicted_peak_bytes"] == 7  # the blind plan's
    assert rows["hilore-buckets"]["paired_vs_gc"]["ratio"] == pytest.approx(1.25)  # still plain GC


def test_loss_ratio_counts_the_eager_loss_backward_over_the_logits():
    """The update's eager log-probs + GRPO loss hold about 3x the logits in
    their backward (measured 2.99x on small): without it the model missed
    store-all's whole loss phase."""
    from hilore_compiler.bench.actor import ActorBenchConfig, make_batch
    from hilore_compiler.bench.actor_plans import loss_ratio

    config = ActorBenchConfig(model="tiny", seq_len=48, prompt_len=8, groups=2)
    policy = build_model("tiny", seed=0)
    ratio = loss_ratio(policy, make_batch(policy, config), config)
    assert 2.0 <= ratio <= 4.0 and round(ratio * 10) == ratio * 10


def test_solve_plans_keeps_its_calibrated_trace_and_reads_it_back(tmp_path, monkeypatch):
    """``calibrated=``: the first solve writes the calibrated trace, the next reads it
    instead of calibrating again (minutes with int4) and solves the same plans."""
    from hilore_compiler.bench import actor, actor_plans
    from hilore_compiler.planload import load_plan
    from hilore_compiler.tracefile import load_trace

    config = actor.ActorBenchConfig(model="tiny", seq_len=64, prompt_len=16, groups=2, group_size=4,
                                    budget="1.0x-store")
    kept = tmp_path / "calibrated.json"
    said = []
    # What calibration measures is test_calibration's; here it only has to mark the trace.
    monkeypatch.setattr(actor_plans, "calibrate_on", lambda policy, trace, batch, config: dataclasses.replace(
        trace, notes=(*trace.notes, "calibrated here")))
    first = actor_plans.solve_plans(config, tmp_path, said.append, calibrated=kept)
    assert any("calibrating" in s for s in said) and "calibrated here" in load_trace(kept).notes

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(actor_plans, "calibrate_on", no_calibration)
    again_dir = tmp_path / "again"
    again_dir.mkdir()
    said.clear()
    second = actor_plans.solve_plans(config, again_dir, said.append, calibrated=kept)
    assert said[0] == f"reading the calibrated trace {kept}"
    for name in ("buckets", "blind", "uniform"):
        plans = [load_plan(solved["paths"][name]) for solved in (first, second)]
        assert [b.decisions for b in plans[0].buckets] == [b.decisions for b in plans[1].buckets]
    # uniform-int8: one bucket, int8 wherever usable, its peak predicted with the update's terms.
    (uniform,) = [b for b in load_plan(first["paths"]["uniform"]).buckets if not b.skip]
    options = {u.key: {o.option for o in u.options} for u in load_plan(first["paths"]["uniform"]).units}
    decisions = dict(uniform.decisions)
    assert set(decisions.values()) <= {"compress:int8", "store"} and len(decisions) == len(options)
    assert all((d == "compress:int8") == ("compress:int8" in options[k]) for k, d in decisions.items())
    assert first["info"]["uniform"]["buckets"]["b0"]["memory_bytes"] > 0


def test_uniform_int8_needs_int8_among_the_codecs():
    from hilore_compiler.bench.actor import ActorBenchConfig

    with pytest.raises(ValueError, match="uniform-int8 needs int8 among the codecs, got bf16"):
        ActorBenchConfig(codecs=("bf16",))
    assert "uniform-int8" not in ActorBenchConfig(codecs=("bf16",), methods=("gc", "hilore-blind")).methods


def test_updates_are_timed_on_the_default_allocator_and_peaks_measured_apart(tmp_path, monkeypatch):
    """MALLOC_MMAP_THRESHOLD_ (which VmHWM needs) slows every method, store-all
    most: the timed workers run without it, each method's peak comes from a
    process of its own with it, and the report reads those peaks."""
    from hilore_compiler.bench import actor, actor_plans
    from hilore_compiler.bench.measure import MMAP_THRESHOLD_ENV, StepSample
    from hilore_compiler.bench.rounds import MethodRun

    envs: dict[str, list] = {"timed": [], "peak": []}

    def start(config, method, plans, run_dir, env, progress):
        envs["timed"].append(env)
        r = MethodRun(method=method, grad_path=str(run_dir / f"grad-{method}.pt"))
        r.info = {"tokens": 1000}
        return r

    def measure_rounds(runs, config, progress, *, peaks=True):
        assert not peaks  # the rounds' VmHWM measures nothing on the default allocator
        assert config.settle_rounds == 1  # the first round after the set-ups is not counted
        for r in runs:
            r.samples = [StepSample(seconds=1.0, peak_bytes=999, round=0)]

    class PeakProcess:
        def __init__(self, payload, env, log_path):
            envs["peak"].append(env)
            self.method = payload["method"]

        def request(self, cmd, **kwargs):
            if self.method == "hilore-blind":
                raise actor.WorkerError("boom")
            return {"samples": [{"peak_bytes": 100 if self.method == "gc" else 110}] * kwargs.get("steps", 1)}

        def close(self):
            pass

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # set by a caller: must not reach the timed workers
    monkeypatch.setattr(actor, "start", start)
    monkeypatch.setattr(actor, "measure_rounds", measure_rounds)
    monkeypatch.setattr(actor, "tensor_peak", lambda *a, **k: 5)
    monkeypatch.setattr(actor_plans, "solve_plans", lambda *a, **k: {"paths": {}, "info": {
        "blind": {"predicted_error": 0.0, "buckets": {"b0": {"memory_bytes": 7}}},
        "buckets": {"predicted_error": 0.0, "buckets": {"b0": {"memory_bytes": 9}}}}, "mix": []})
    monkeypatch.setattr(actor, "ActorWorkerProcess", PeakProcess)
    monkeypatch.setattr(actor.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    said: list[str] = []
    report = actor.run_actor_bench(actor.ActorBenchConfig(model="tiny", methods=("gc", "hilore-blind", "hilore-skip")),
                                   said.append)
    assert envs["timed"] and all(not set(MMAP_THRESHOLD_ENV) & set(env) for env in envs["timed"])
    assert envs["peak"] and all(all(env.get(k) == v for k, v in MMAP_THRESHOLD_ENV.items()) for env in envs["peak"])
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["gc"]["peak_bytes"]["median"] == 100 and rows["hilore-skip"]["peak_vs_gc"] == pytest.approx(1.1)
    assert rows["hilore-blind"]["peak_bytes"] is None  # its peak process failed; the rounds' 999 is no peak
    assert rows["gc"]["samples"] == [{"seconds": 1.0, "peak_bytes": 999, "round": 0}]  # kept for later pairings
    assert "hilore-blind: no peak: boom" in said

    # Baselines alone (GC with and without the skip): no trace, no plan to wait for.
    monkeypatch.setattr(actor_plans, "solve_plans", lambda *a, **k: pytest.fail("solved plans that no method runs"))
    report = actor.run_actor_bench(actor.ActorBenchConfig(model="tiny", methods=("gc", "gc-skip")), said.append)
    assert [r["method"] for r in report["rows"]] == ["gc", "gc-skip"]


@pytest.mark.slow
def test_gc_skip_runs_gc_without_the_zero_exposure_samples_and_the_same_gradient(tmp_path):
    """``gc-skip`` is GC in the update loop with the zero skip: it skips every
    zero-advantage sample that ``gc`` runs, and (no KL term) the gradient is the same."""
    from hilore_compiler.bench.actor import ActorBenchConfig
    from hilore_compiler.bench.actor_worker import ActorWorker
    from hilore_compiler.bench.worker import flat_grad

    config = ActorBenchConfig(model="tiny", seq_len=32, prompt_len=8, groups=4, group_size=2, microbatch=2)
    workers = {m: ActorWorker.in_process(config, m, {}, tmp_path) for m in ("gc", "gc-skip")}
    zero = int((workers["gc"].batch.advantages == 0).sum())
    assert 0 < zero < 8  # the seeded batch has zero-variance groups, and live ones
    grads = {}
    for method, worker in workers.items():
        worker.model.zero_grad(set_to_none=True)
        worker.step()
        grads[method] = flat_grad(worker.model)
    assert workers["gc"].info()["samples_skipped"] == 0
    assert workers["gc-skip"].info()["samples_skipped"] == zero
    assert workers["gc-skip"].info()["microbatches"] < workers["gc"].info()["microbatches"]
    torch.testing.assert_close(grads["gc-skip"], grads["gc"], rtol=1e-5, atol=1e-7)
