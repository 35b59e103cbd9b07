"""``hilore bench --actor-update``: the whole bucketed actor update on a realistic GRPO batch.

Where ``hilore bench`` times one forward/backward of a fixed batch in one
bucket, this runs ``grpo.actor_update`` end to end on a batch shaped like a
real GRPO step, so that bucketing and the zero-exposure skip are measured:

- groups of ``group_size`` samples with binary rewards; each prompt is solved
  with a probability drawn uniformly from [0, 1] (a 50% solve rate on
  average), so some groups are all right or all wrong, with zero reward
  variance, zero advantage and zero exposure;
- responses of varying length after a fixed prompt (masks differ);
- a second optimizer iteration on the batch: ``old_logprobs`` are the current
  policy's log-probs shifted by N(0, ``ratio_spread``) per token, so ratios
  spread around 1 and tokens are clipped (and dual-clipped) as they would be;
  buckets then come from the off-policy bound (``UpdateConfig.on_policy=False``);
- the ``dapo`` or ``grpo`` normalisation (``loss_type``).

Methods (each in its own worker process, measured in alternating rounds as
``runner.py`` does): ``store-all`` (the exact reference), ``gc``,
``uniform-int8`` (int8 wherever the codec is usable, blind to exposure and
cost: the step bench's fastest baseline within 1.10x GC's peak),
``hilore-blind`` (one plan for every sample: the same memory and error budget,
solved as if one bucket held the whole update), ``hilore-buckets`` (the joint
per-bucket plan for this batch's exposure mix) and ``hilore-skip`` (the same
plan, zero-exposure samples skip forward and backward). The plans are solved
once, in the driver, from one trace of the policy at the microbatch shape
(``actor_plans``).

The zero skip is the update loop's, not the plan's: any method can take it
(``grpo.actor_update`` does by default, and dropping zero-advantage groups is
what DAPO's dynamic sampling does). So ``gc-skip`` and ``hilore-blind-skip``
run GC and the blind plan with it, and a skipping method's speed is paired
with theirs: what the plan adds is then told apart from what the skip adds.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..grpo import GRPOConfig, RolloutBatch, group_advantages
from ..grpo.coefficients import exposure_bound_before_forward
from ..vocabulary import to_plan_exposure
from .process import WorkerError, WorkerProcess, check_heap, worker_env
from .rounds import MethodRun, Progress, close_workers, compare_grads, describe, measure_rounds

#: Methods in set-up order; ``store-all`` first: it is the gradient reference.
ACTOR_METHODS = ("store-all", "gc", "gc-skip", "uniform-int8", "hilore-blind", "hilore-blind-skip",
                 "hilore-buckets", "hilore-skip")
#: Methods that skip zero-exposure samples (``UpdateConfig.skip_zero``), each
#: with the method it runs otherwise.
SKIPPING = {"gc-skip": "gc", "hilore-blind-skip": "hilore-blind", "hilore-skip": "hilore-buckets"}
#: The plan (``actor_plans.solve_plans``'s ``paths``) each planned method runs.
PLAN_OF = {"uniform-int8": "uniform", "hilore-blind": "blind", "hilore-blind-skip": "blind",
           "hilore-buckets": "buckets", "hilore-skip": "buckets"}
#: Methods that need no plan, set up before the plans are solved.
BASELINES = ("store-all", "gc", "gc-skip")
#: Codecs whose error binds the default error budget: calibrated unit by unit.
LOSSY_CODECS = ("int4",)
#: Microbatches of the batch the trace is calibrated on, spread over it.
CALIBRATION_MICROBATCHES = 4
LABELS = {"store-all": "store-all (exact)", "gc": "GC (per-layer checkpoint)", "gc-skip": "GC + zero skip",
          "uniform-int8": "uniform int8", "hilore-blind": "HiLoRe, one plan (exposure-blind)",
          "hilore-blind-skip": "HiLoRe, one plan + zero skip", "hilore-buckets": "HiLoRe, buckets",
          "hilore-skip": "HiLoRe, buckets + zero skip"}


def base_method(method: str) -> str:
    """What ``method`` compiles and runs, its zero skip aside: ``gc`` for ``gc-skip``."""
    return SKIPPING.get(method, method)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorBenchConfig:
    """What ``hilore bench --actor-update`` runs; the defaults fit 2 CPU cores in minutes."""

    model: str = "small"
    #: Prompt + response tokens per sample.
    seq_len: int = 256
    prompt_len: int = 64
    #: Groups (prompts) x samples per group = the batch.
    groups: int = 8
    group_size: int = 8
    #: Rows per forward/backward; the plans are solved at (microbatch, seq_len).
    microbatch: int = 2
    #: ``dapo`` (token sum over the generation batch) or ``grpo`` (per-sequence mean).
    loss_type: str = "dapo"
    #: Std of log(old / current) per token: how far the second iteration moved.
    ratio_spread: float = 0.3
    #: verl's dual clip c: bounds negative-advantage coefficients off-policy.
    dual_clip_c: float = 3.0
    budget: str = "1.10x-gc"
    #: The update's error budget (``solver.risk``): default cos >= 0.999.
    risk_budget: str = "cos>=0.999"
    #: Codecs the plans may use; ``int4`` is opt-in (see docs/fidelity.md, "int4").
    codecs: tuple[str, ...] = ("bf16", "int8")
    buckets: int = 3
    methods: tuple[str, ...] = ACTOR_METHODS
    repeats: int = 3
    #: Updates per method per round, and right after compiling.
    steps_per_round: int = 1
    warmup: int = 1
    #: Uncounted rounds after every set-up (``runner.BenchConfig.settle_rounds``).
    settle_rounds: int = 1
    seed: int = 0
    threads: int | None = None
    #: Timed workers' heap (``runner.BenchConfig.heap``).
    heap: str = "default"
    device: str = "cpu"

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in ACTOR_METHODS]
        if unknown or not self.methods:
            raise ValueError(f"unknown or no methods {unknown}; choose from {', '.join(ACTOR_METHODS)}")
        check_heap(self.heap)
        if not 0 < self.prompt_len < self.seq_len - 1 or self.microbatch < 1 or self.groups < 1:
            raise ValueError("need 0 < prompt_len < seq_len - 1, microbatch >= 1 and groups >= 1")
        if self.loss_type not in ("dapo", "grpo"):
            raise ValueError(f"loss_type must be dapo or grpo, got {self.loss_type!r}")
        if "uniform-int8" in self.methods and "int8" not in self.codecs:
            raise ValueError(f"uniform-int8 needs int8 among the codecs, got {','.join(self.codecs) or 'none'}: "
                             "add it to --codecs or leave uniform-int8 out of --methods")


def loss_config(config: ActorBenchConfig) -> GRPOConfig:
    """The GRPO loss of the bench: DAPO's clip-higher, verl's dual clip."""
    return GRPOConfig(loss_type=config.loss_type, eps_low=0.2, eps_high=0.28, dual_clip_c=config.dual_clip_c)


def make_batch(policy: torch.nn.Module, config: ActorBenchConfig) -> RolloutBatch:
    """The GRPO batch of the module docstring, from its own seeded generator."""
    g = torch.Generator().manual_seed(config.seed + 1)
    n, t, vocab = config.groups * config.group_size, config.seq_len, policy.config.vocab_size
    ids = torch.randint(vocab, (n, t), generator=g)  # (B, T)
    solve = torch.rand(config.groups, generator=g).repeat_interleave(config.group_size)  # (B,)
    rewards = (torch.rand(n, generator=g) < solve).float()  # (B,) binary
    lengths = torch.randint((t - config.prompt_len) // 2, t - config.prompt_len, (n,), generator=g)
    pos = torch.arange(1, t)  # (T-1,) position of the predicted token
    mask = ((pos >= config.prompt_len) & (pos < config.prompt_len + lengths.unsqueeze(1))).float()
    with torch.no_grad():
        from ..models import token_logprobs

        current = torch.cat([token_logprobs(policy(ids[i:i + 1]), ids[i:i + 1]) for i in range(n)])
    old = current - config.ratio_spread * torch.randn(current.shape, generator=g)  # (B, T-1)
    groups = torch.arange(config.groups).repeat_interleave(config.group_size)
    return RolloutBatch(input_ids=ids, response_mask=mask, old_logprobs=old, rewards=rewards,
                        group_ids=groups, advantages=group_advantages(rewards, groups))


def batch_exposures(batch: RolloutBatch, config: ActorBenchConfig, *, on_policy: bool = False) -> list[float]:
    """Plan exposures of the batch as the update buckets them (the off-policy bound),
    infinite ones clipped to the largest finite one: the mix the plans are solved for.

    ``on_policy``: the exposures at ratio 1 instead, what each sample's
    gradient is expected to carry; they weigh the buckets' error shares.
    """
    n = batch.input_ids.shape[0]
    bound = exposure_bound_before_forward(batch.advantages, batch.response_mask, loss_config(config),
                                          on_policy=on_policy, num_sequences=n,
                                          num_tokens=float(batch.response_mask.sum()))
    finite = [float(x) for x in bound if math.isfinite(float(x))]
    top = max(finite, default=1.0)
    return [to_plan_exposure(min(float(x), top), n) for x in bound]


def worker_payload(config: ActorBenchConfig, method: str, plans: dict[str, str], grad_path: Path) -> dict[str, Any]:
    """What an ``ActorWorker`` is built from: the config, the method, the plan paths
    and where it saves its gradient; the same in a worker process and in-process."""
    return {"config": dataclasses.asdict(config), "method": method, "plans": plans, "grad_path": str(grad_path)}


class ActorWorkerProcess(WorkerProcess):
    """A worker of ``actor_worker.py`` (same pipe protocol as the step bench's)."""

    MODULE = "hilore_compiler.bench.actor_worker"


def start(config: ActorBenchConfig, method: str, plans: dict[str, str], run_dir: Path, env: dict[str, str],
          progress: Progress) -> MethodRun:
    """Spawn, compile and warm up ``method``'s worker; failures are recorded, not raised."""
    payload = worker_payload(config, method, plans, run_dir / f"grad-{method}.pt")
    run = MethodRun(method=method, grad_path=payload["grad_path"])
    progress(f"{method}: compiling and warming up")
    try:
        run.worker = ActorWorkerProcess(payload, env=env, log_path=run_dir / f"{method}.log")
        reply = run.worker.request("setup")
    except WorkerError as e:
        run.fail(e, progress)
        return run
    from .measure import StepSample

    run.compile_s, run.info = reply["compile_s"], reply["info"]
    run.warmup = [StepSample(**s) for s in reply["warmup"]]
    # Timed on the default allocator: the warm-up's VmHWM is no peak (run_actor_bench).
    progress(f"{method}: set up in {run.compile_s:.1f} s; warm-up {describe(run.warmup, peak=False)}")
    return run


def tensor_peak(config: ActorBenchConfig, method: str, run_dir: Path, env: dict[str, str],
                progress: Progress, worker: ActorWorkerProcess | None = None) -> int | None:
    """``method``'s update peak in tensor bytes (``ActorWorker.tensor_peak``); None if it failed.

    GC's is the reference of ``x-gc`` budgets: the plans' memory model
    predicts tensor bytes (within 0.1% of the allocator's peak for the
    bf16/int8 plans), and a VmHWM reference would hand the plans GC's own
    heap (about 1 MB, 2% of GC's peak here) as room they then overran.
    Without ``worker`` it runs in a process of its own, since profiling
    perturbs the VmHWM peaks measured after it.
    """
    own = worker is None
    try:
        if own:
            worker = ActorWorkerProcess(worker_payload(config, method, {}, run_dir / f"grad-{method}-probe.pt"),
                                        env=env, log_path=run_dir / f"{method}-tensor-peak.log")
        return int(worker.request("tensor_peak")["tensor_peak_bytes"])
    except WorkerError as e:
        progress(f"{method}: no tensor peak: {str(e).splitlines()[0]}")
        return None
    finally:
        if own and worker is not None:
            worker.close()


#: Updates whose VmHWM peak ``rss_peaks`` measures, after its set-up's warm-up.
PEAK_STEPS = 3


def rss_peaks(config: ActorBenchConfig, method: str, plans: dict[str, str], run_dir: Path, env: dict[str, str],
              progress: Progress) -> list[int]:
    """``method``'s per-update VmHWM peaks, from a worker of its own started with ``env``
    (``MMAP_THRESHOLD_ENV`` set); empty if it failed. Its compile reads the run's Inductor cache."""
    progress(f"{method}: measuring its peak (VmHWM) in a process of its own")
    payload = worker_payload(config, method, plans, run_dir / f"grad-{method}-peak.pt")
    worker = None
    try:
        worker = ActorWorkerProcess(payload, env=env, log_path=run_dir / f"{method}-peak.log")
        worker.request("setup")
        samples = worker.request("measure", steps=PEAK_STEPS)["samples"]
        return [int(s["peak_bytes"]) for s in samples]
    except WorkerError as e:
        progress(f"{method}: no peak: {str(e).splitlines()[0]}")
        return []
    finally:
        if worker is not None:
            worker.close()


def timing_env(run_dir: Path, heap: str = "default") -> dict[str, str]:
    """The environment of timed actor workers: the run's Inductor cache, the
    heap ``heap`` names (``process.worker_env``); peaks come from ``rss_peaks``."""
    return worker_env(run_dir / "inductor", heap=heap)


def run_actor_bench(config: ActorBenchConfig, progress: Progress) -> dict[str, Any]:
    """Solve the plans, set up every method, measure in rounds; returns the report payload."""
    from .actor_plans import solve_plans  # it builds on this module's config and batch
    from .actor_report import summarise

    run_dir = Path(tempfile.mkdtemp(prefix="hilore-actor-bench-"))
    env, peak_env = timing_env(run_dir, config.heap), worker_env(run_dir / "inductor", peak=True)
    runs: dict[str, MethodRun] = {}
    try:
        # The baselines first: GC's measured peak is the ceiling x-gc budgets are multiples of.
        for method in (m for m in BASELINES if m in config.methods):
            runs[method] = start(config, method, {}, run_dir, env, progress)
        gc_peak = None
        if runs.get("gc") is not None and runs["gc"].status == "ok":
            progress("gc: measuring its update's tensor peak (the x-gc reference) in a process of its own")
            gc_peak = tensor_peak(config, "gc", run_dir, env, progress)
        # Tracing and calibrating take minutes: only for methods that run a plan.
        plans = (solve_plans(config, run_dir, progress, gc_peak_bytes=gc_peak)
                 if any(m in PLAN_OF for m in config.methods) else {"paths": {}, "info": {}, "mix": []})
        for method in (m for m in ACTOR_METHODS if m in config.methods and m not in BASELINES):
            runs[method] = start(config, method, plans["paths"], run_dir, env, progress)
        measure_rounds(list(runs.values()), config, progress, peaks=False)
        for run in (r for r in runs.values() if r.worker is not None):
            run.info["tensor_peak_bytes"] = tensor_peak(config, run.method, run_dir, env, progress, run.worker)
        close_workers(runs.values())
        for run in (r for r in runs.values() if r.status == "ok"):
            run.peaks = rss_peaks(config, run.method, plans["paths"], run_dir, peak_env, progress)
    finally:
        close_workers(runs.values())
    compare_grads(runs)
    failed = any(r.status != "ok" for r in runs.values())
    report = summarise(config, runs, plans)
    report["run_dir"] = str(run_dir) if failed else None
    if not failed:
        shutil.rmtree(run_dir, ignore_errors=True)
    return report
