"""One worker of the lengths bench: one method, a batch at each of several sequence lengths.

Run as ``python -m hilore_compiler.bench.lengths_worker '<LengthsWorkerConfig JSON>'``;
it speaks the step bench's protocol (``worker.serve_requests``):

- ``setup``: compile by running one step at each length in turn, as a
  trainer meets them (seconds per length: the compile's and the step's),
  then save each length's gradient if asked;
- ``measure``: ``steps`` steps at each length; each sample names its length;
- ``tensor_peak``: the allocator's peak of one step at each length
  (``measure.allocator_peak``: the same count for every method, in the
  process the rounds time).

Methods are compiled the way users compile: ``torch.compile`` with its
default ``dynamic=None`` (static at the first length, dynamic from the
second), except ``hilore-static``, which compiles a static plan per length
(``dynamic=False``), the upper bound any plan over the range can reach.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..grpo import GRPOConfig, grpo_loss
from ..models import build_model, token_logprobs
from .measure import StepSample, allocator_peak, loss_side, measure_step, plan_loss_ratio
from .methods import wrap_layers
from .worker import StepData, actor_step, flat_grad, make_data, serve_requests

#: What the lengths bench compares: GC, store-all, and the ways HiLoRe plans lengths:
#: over the lengths seen (zero config: ``hilore``), over the bench's range given
#: up front (``-range``), with length buckets (``-lengths``), static per length (``-static``).
LENGTH_METHODS = ("gc", "store-all", "hilore", "hilore-range", "hilore-lengths", "hilore-static")
#: Run unless ``--methods`` says otherwise: zero config is for the compile-time study.
DEFAULT_LENGTH_METHODS = tuple(m for m in LENGTH_METHODS if m != "hilore")
#: Most length buckets ``hilore-lengths`` may split its range into.
LENGTH_BUCKETS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthsWorkerConfig:
    """What one ``--lengths`` worker runs: a method over every length, on one model and batch."""

    method: str
    model: str
    batch: int
    lengths: tuple[int, ...]
    seed: int
    #: The hilore backend's options shared by the three HiLoRe methods
    #: (budget, codecs, cache folder); ranges and buckets are set per method.
    hilore: dict[str, Any]
    grad_dir: str | None = None
    threads: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthSample(StepSample):
    """One timed step at one of the bench's lengths."""

    #: Tokens per sequence of the step.
    length: int = 0


class LengthsWorker:
    """A model, a batch per length, and the method compiled over them."""

    def __init__(self, config: LengthsWorkerConfig) -> None:
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.model = build_model(config.model, seed=config.seed)
        vocab = self.model.config.vocab_size
        self.data = {n: make_data(vocab, config.batch, n, config.seed + n, torch.device("cpu"))
                     for n in config.lengths}
        self.loss_config = GRPOConfig()
        self.backend = None
        self.policy = self._compile(config.method)

    def _compile(self, method: str) -> Any:
        if method == "store-all":
            return torch.compile(self.model)
        if method == "gc":
            return torch.compile(wrap_layers(self.model))
        from ..backend import HiLoReBackend

        options = {**self.config.hilore, "loss_ratio": plan_loss_ratio(self._loss_ratio())}
        if method == "hilore":  # zero config: plans over the lengths seen, re-solved as they grow
            self.backend = HiLoReBackend(options)
            return torch.compile(self.model, backend=self.backend)
        if method == "hilore-static":
            # One static graph per length: dynamo's recompile limit must not end it early.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       len(self.config.lengths) + 1)
            self.backend = HiLoReBackend(options)
            return torch.compile(self.model, backend=self.backend, dynamic=False)
        lo, hi = min(self.config.lengths), max(self.config.lengths)
        buckets = LENGTH_BUCKETS if method == "hilore-lengths" else 1
        self.backend = HiLoReBackend({**options, "min_seq_len": lo, "max_seq_len": hi, "length_buckets": buckets})
        return torch.compile(self.model, backend=self.backend)

    def _loss_ratio(self) -> float:
        """The loss's own peak over the logits' bytes at the longest length (``measure.loss_side``)."""
        data = self.data[max(self.config.lengths)]

        def loss(logits: torch.Tensor) -> torch.Tensor:
            logprobs = token_logprobs(logits, data.input_ids)
            return grpo_loss(logprobs, logprobs.detach(), data.advantages, data.mask, self.loss_config)

        shape = (*data.input_ids.shape, self.model.config.vocab_size)
        return loss_side(loss, shape, torch.float32, "cpu")

    def _step(self, data: StepData) -> None:
        self.model.zero_grad(set_to_none=True)
        actor_step(self.policy, data, self.loss_config)

    def setup(self) -> dict[str, Any]:
        seconds = {}
        for n in self.config.lengths:
            start = time.perf_counter()
            self._step(self.data[n])
            seconds[n] = time.perf_counter() - start
            if self.config.grad_dir:
                torch.save(flat_grad(self.model), os.path.join(self.config.grad_dir, f"{self.config.method}-{n}.pt"))
        return {"compile_s": sum(seconds.values()), "warmup": [], "info": self._info(seconds)}

    def _info(self, seconds: dict[int, float]) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        info: dict[str, Any] = {"first_step_s": {str(n): s for n, s in seconds.items()},
                                "dynamo_graphs": int(counters["stats"]["unique_graphs"])}
        if self.backend is not None:
            graphs = self.backend.graphs
            info["hilore"] = {
                "graphs": len(graphs), "planned": sum(g.plan is not None for g in graphs),
                "resolves": sum(g.resolves for g in graphs), "variants": sum(len(g.variants) for g in graphs),
                "length_buckets": [list(p.length_range) for p in graphs[-1].plans] if graphs else [],
                "compile_s": sum(g.compile_seconds for g in graphs),
            }
        return info

    def measure(self, steps: int) -> list[LengthSample]:
        samples = []
        for n in self.config.lengths:
            for _ in range(steps):
                sample = measure_step(lambda: self._step(self.data[n]), torch.device("cpu"))
                samples.append(LengthSample(seconds=sample.seconds, peak_bytes=sample.peak_bytes, length=n))
        return samples

    def tensor_peak(self) -> dict[str, Any]:
        return {"tensor_peak_bytes": {str(n): allocator_peak(lambda: self._step(self.data[n]))
                                      for n in self.config.lengths}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    obj = json.loads(argv[0])
    config = LengthsWorkerConfig(**{**obj, "lengths": tuple(obj["lengths"])})
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints go to the log, not into the protocol
    serve_requests(lambda: LengthsWorker(config), sys.stdin, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
