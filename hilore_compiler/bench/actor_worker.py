"""One worker of ``hilore bench --actor-update``: one method, the whole actor update per step.

Run as ``python -m hilore_compiler.bench.actor_worker '<JSON>'`` with the
driver's config, the method, the plan paths and where to save the gradient;
it speaks the step bench's pipe protocol (``worker.py``: ``setup``,
``measure``, ``exit``). Every forward runs at the plans' microbatch shape
(``evaluation.arms.FixedBatch`` pads short microbatches), for every method
alike, so no method recompiles and the padding costs all of them the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..evaluation.arms import FixedBatch
from ..grpo import ExposureBuckets, UpdateConfig, actor_update, plan_buckets
from ..models import build_model
from ..planload import load_plan
from .actor import PLAN_OF, SKIPPING, ActorBenchConfig, base_method, loss_config, make_batch, worker_payload
from .measure import StepSample, allocator_peak, measure_step
from .methods import wrap_layers
from .worker import flat_grad, serve_requests


class ActorWorker:
    """Model, batch, compiled method and the update it runs."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.config = ActorBenchConfig(**{**payload["config"], "methods": tuple(payload["config"]["methods"]),
                                          "codecs": tuple(payload["config"]["codecs"])})
        self.method, self.grad_path = payload["method"], payload["grad_path"]
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.model = build_model(self.config.model, seed=self.config.seed)
        self.batch = make_batch(self.model, self.config)
        self.loss = loss_config(self.config)
        self.compiled, self.buckets, self.plan = self._prepare(payload["plans"])
        n = 1 if self.buckets is None else self.buckets.n_buckets
        self.update = UpdateConfig(microbatch_size=self.config.microbatch, n_buckets=n,
                                   skip_zero=self.method in SKIPPING, on_policy=False,
                                   across_ranks=False)
        self.last = None

    @classmethod
    def in_process(cls, config: ActorBenchConfig, method: str, plans: dict[str, str], run_dir: Path) -> ActorWorker:
        """``method``'s worker as the bench builds it, in this process (the studies under bench/)."""
        return cls(worker_payload(config, method, plans, run_dir / f"grad-{method}.pt"))

    def _prepare(self, plans: dict[str, str]) -> tuple[torch.nn.Module, ExposureBuckets | None, Any]:
        """The compiled policy at the microbatch shape, the buckets it runs and its plan."""
        micro, method = self.config.microbatch, base_method(self.method)
        if method == "store-all":
            return FixedBatch(torch.compile(self.model, dynamic=False), micro), None, None
        if method == "gc":
            return FixedBatch(torch.compile(wrap_layers(self.model), dynamic=False), micro), None, None
        from ..backend import HiLoReBackend

        plan = load_plan(plans[PLAN_OF[self.method]])
        backend = HiLoReBackend({"plan": plan, "codecs": self.config.codecs, "verbose": False,
                                 "cache_dir": os.path.dirname(self.grad_path)})
        compiled = torch.compile(self.model, backend=backend, dynamic=False)
        n = self.batch.input_ids.shape[0]
        return FixedBatch(compiled, micro), plan_buckets(plan, n), plan

    def step(self) -> None:
        """One whole update; the caller frees the gradients first (``measure``, ``setup``)."""
        self.last = actor_update(self.compiled, None, self.batch, self.loss, update=self.update,
                                 buckets=self.buckets)

    def measure(self, steps: int) -> list[StepSample]:
        samples = []
        for _ in range(steps):
            # Before the measured window, as optimizer.zero_grad(set_to_none=True)
            # runs before an update (and as worker.py measures): the gradients'
            # allocation is part of every method's peak. Freed inside the
            # window, they were counted in the RSS before it and left out.
            self.model.zero_grad(set_to_none=True)
            samples.append(measure_step(self.step, "cpu"))
        return samples

    def setup(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        self.step()  # compiles every variant the update meets
        compile_s = time.perf_counter() - start
        warmup = self.measure(self.config.warmup)
        self.model.zero_grad(set_to_none=True)
        self.step()
        torch.save(flat_grad(self.model).cpu(), self.grad_path)
        return {"compile_s": compile_s, "warmup": [dataclasses.asdict(s) for s in warmup],
                "info": self.info()}

    def tensor_peak(self) -> dict[str, Any]:
        """One update's peak in tensor bytes (the allocator's), what the memory model predicts.

        VmHWM (``measure``) also counts the process's own heap, about 1 MB
        here. Profiled, the update leaves the heap so that later VmHWM
        peaks read 4 MB higher: ask for this only after the measured rounds,
        or in a process that measures nothing else.
        """
        self.warm()
        return {"tensor_peak_bytes": allocator_peak(self.step)}

    def warm(self) -> None:
        """Two updates, gradients freed before each and after: the first compiles in a fresh
        process, and together they meet every variant the update runs."""
        for _ in range(2):
            self.model.zero_grad(set_to_none=True)
            self.step()
        self.model.zero_grad(set_to_none=True)

    def info(self) -> dict[str, Any]:
        """What the last update did: samples per bucket, skips, microbatches, understated exposures."""
        r = self.last
        understated = sum(exact > r.buckets.upper(name) * (1 + 1e-9) + 1e-15
                          for name, exact in zip(r.sample_buckets, r.exposure_before_backward)
                          if name != "zero")
        return {"samples_per_bucket": dict(r.samples_per_bucket), "samples_skipped": r.samples_skipped,
                "microbatches": r.microbatches, "exposure_understated": int(understated),
                "threads": torch.get_num_threads(), "tokens": int(self.batch.input_ids.numel())}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    payload = json.loads(argv[0])
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to the worker's log, not into the protocol
    with contextlib.suppress(BrokenPipeError):
        serve_requests(lambda: ActorWorker(payload), sys.stdin, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
