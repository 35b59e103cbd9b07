"""One benchmark worker process: one method, driven by the runner over a pipe.

Run as ``python -m hilore_compiler.bench.worker '<WorkerConfig JSON>'``. The
worker reads one JSON command per line on stdin and answers one JSON line:

- ``{"cmd": "setup"}``: build model and data, run the method's profiling if
  it has one (``PreparedMethod.profile``, counted in ``compile_s``), compile
  (the first call), run the warm-up steps (measured, returned), save the
  flattened gradient of the fixed batch if asked; answers ``compile_s``,
  ``warmup``, ``info``.
- ``{"cmd": "measure", "steps": k}``: k measured steps; answers ``samples``.
- ``{"cmd": "exit"}``.

Answers go to a private copy of the original stdout; fd 1 is pointed at
stderr so that prints from torch or the backend cannot corrupt the protocol.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from ..backend import runtime
from ..grpo import GRPOConfig, exposure_before_forward, grpo_loss
from ..models import build_model, token_logprobs
from ..solver import infeasible_cause
from .measure import (StepSample, cpu_peak_supported, flat_grad, loss_side, measure_step, mmap_threshold_set,
                      plan_loss_ratio)
from .methods import HILORE_BACKENDS, STEP_METHODS, MethodOptions, PreparedMethod, prepare_method, tuned_step
from .peers import SEARCHED, knob_name
from .plans import choose_bucket, plan_summary, step_cosines


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    """Everything one worker needs; identical across methods except ``method``."""

    method: str
    model: str
    batch: int
    seq_len: int
    #: Seeds the weights and the batch: every method sees the same ones.
    seed: int
    device: str
    #: Measured steps after the compiling call, before any round.
    warmup: int
    options: MethodOptions
    #: Where to save the flattened gradient of the fixed batch (None: don't).
    grad_path: str | None = None
    #: ``torch.set_num_threads`` (None: torch's default, one per core). On a
    #: CPU shared with other jobs fewer threads than cores avoids OpenMP
    #: threads waiting on each other at every barrier.
    threads: int | None = None
    #: Parameter dtype of the policy (``float32`` or ``bfloat16``); token
    #: log-probs and the loss stay fp32 (``token_logprobs`` upcasts).
    dtype: str = "float32"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        obj = json.loads(text)
        return cls(**{**obj, "options": MethodOptions.from_json(obj["options"])})


@dataclass(frozen=True, slots=True, kw_only=True)
class StepData:
    """The fixed batch: token ids, advantages and response mask."""

    input_ids: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T-1): every position after the first is a response token


def make_data(vocab: int, batch: int, seq_len: int, seed: int, device: torch.device) -> StepData:
    """Random token ids and advantages from their own generator (the model's RNG is untouched)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, seq_len), generator=g)
    adv = torch.randn(batch, generator=g)  # GRPO advantages are normalised: ~unit scale
    mask = torch.ones(batch, seq_len - 1)
    return StepData(input_ids=ids.to(device), advantages=adv.to(device), mask=mask.to(device))


def actor_step(policy: Callable[[torch.Tensor], torch.Tensor], data: StepData, loss_config: GRPOConfig,
               before_backward: Callable[[torch.Tensor, StepData, GRPOConfig], None] | None = None) -> None:
    """Forward, token log-probs, GRPO loss (on-policy: old = logprobs), ``before_backward`` if given, backward."""
    logits = policy(data.input_ids)  # (B, T, V)
    logprobs = token_logprobs(logits, data.input_ids)  # (B, T-1)
    loss = grpo_loss(logprobs, logprobs.detach(), data.advantages, data.mask, loss_config)
    if before_backward is not None:
        before_backward(logprobs, data, loss_config)
    loss.backward()


class Worker:
    """The state of one worker: model, data, the compiled method, the step."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.device = torch.device(config.device)
        self.model = build_model(config.model, seed=config.seed, device=self.device,
                                 dtype=getattr(torch, config.dtype))
        vocab = self.model.config.vocab_size
        self.data = make_data(vocab, config.batch, config.seq_len, config.seed, self.device)
        self.loss_config = GRPOConfig()
        # Only the step methods take old log-probs as an input; the others' loss
        # uses the step's own (on-policy), so no forward is spent on them here.
        self.old_logprobs = self._old_logprobs() if config.method in STEP_METHODS else None
        options = config.options
        if config.method in HILORE_BACKENDS and config.method not in STEP_METHODS and options.measure_loss:
            # The eager loss after the compiled policy is part of the step's
            # peak: measure it here, before the first call plans.
            options = dataclasses.replace(options, loss_ratio=plan_loss_ratio(self._loss_ratio()))
        self.prepared: PreparedMethod = prepare_method(config.method, self.model, options, self.loss_config)
        self.bucket: str | None = None

    def _loss_ratio(self) -> float:
        """``measure.loss_side`` of this step's loss on logits of the policy's output shape."""
        def loss(logits: torch.Tensor) -> torch.Tensor:
            logprobs = token_logprobs(logits, self.data.input_ids)
            return grpo_loss(logprobs, logprobs.detach(), self.data.advantages, self.data.mask, self.loss_config)

        shape = (*self.data.input_ids.shape, self.model.config.vocab_size)
        dtype = next(self.model.parameters()).dtype
        return loss_side(loss, shape, dtype, self.device)

    def _old_logprobs(self) -> torch.Tensor:
        """The step methods' ``old_logprobs`` input: this policy's own, so the step is on-policy
        as ``actor_step``'s (no optimizer step runs, so they stay the policy's)."""
        with torch.no_grad():
            return token_logprobs(self.model(self.data.input_ids), self.data.input_ids)  # (B, T-1)

    def _step(self) -> None:
        context = runtime.exposure(self.bucket) if self.bucket else contextlib.nullcontext()
        with context:
            if self.prepared.step is None:
                self._actor_step(self.data)
            else:  # the whole step is one compiled graph: forward, log-probs, loss
                d = self.data
                self.prepared.step(d.input_ids, self.old_logprobs, d.advantages, d.mask).backward()

    def _actor_step(self, data: StepData) -> None:
        actor_step(self.prepared.policy, data, self.loss_config, self.prepared.before_backward)

    def _other_batch(self, k: int) -> StepData:
        """The k-th batch of the bench's shape from another seed than the bench's (``paper``'s calibration)."""
        c = self.config
        return make_data(self.model.config.vocab_size, c.batch, c.seq_len, c.seed + 1 + k, self.device)

    def measure(self, steps: int) -> list[StepSample]:
        samples = []
        for _ in range(steps):
            # Gradients are None at the start of every step, as after
            # optimizer.zero_grad(): their allocation is part of every method's peak.
            self.model.zero_grad(set_to_none=True)
            samples.append(measure_step(self._step, self.device))
        return samples

    def tensor_peak(self) -> dict[str, Any]:
        """One step's peak in tensor bytes (the CPU allocator's, ``measure.allocator_peak``):
        what the memory model predicts, without the process's own heap and
        libraries' buffers that VmHWM adds. Profiled, the step leaves the heap
        changed: ask for it after the measured steps."""
        from .measure import allocator_peak

        if self.device.type != "cpu":
            return {"tensor_peak_bytes": self.measure(1)[0].peak_bytes}
        self.model.zero_grad(set_to_none=True)
        return {"tensor_peak_bytes": allocator_peak(self._step)}

    def setup(self) -> dict[str, Any]:
        start = time.perf_counter()
        chunks = self._choose_chunks() if self.config.method == "hilore-step" and self.config.options.step_chunks \
            else None
        if self.prepared.profile is not None:
            self.prepared.profile(self._actor_step, self.data, self._other_batch)
        self.model.zero_grad(set_to_none=True)
        with self.prepared.compile_context():
            self._step()  # compiles: dynamo, AOTAutograd, partitioner, Inductor
        compile_s = time.perf_counter() - start
        info = self._info()
        if chunks is not None:
            info["chunk_choice"] = chunks
        warmup = self.measure(self.config.warmup)
        if self.config.grad_path:
            self.model.zero_grad(set_to_none=True)
            self._step()
            torch.save(flat_grad(self.model).cpu(), self.config.grad_path)
        return {"compile_s": compile_s, "warmup": [dataclasses.asdict(s) for s in warmup], "info": info}

    def _choose_chunks(self) -> dict[str, Any]:
        """Compile ``hilore-step`` at the chunk size ``grpo.choose_chunk_tokens`` picks; its record."""
        d = self.data
        batch = (d.input_ids, self.old_logprobs, d.advantages, d.mask)
        self.prepared, record = tuned_step(self.model, self.config.options, self.loss_config, batch,
                                           progress=lambda msg: print(f"hilore chunks: {msg}", file=sys.stderr))
        return record

    def _info(self) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        # Graph counts catch a method that silently broke the model into
        # pieces (or recompiled), which would make its timing incomparable.
        info: dict[str, Any] = {"threads": torch.get_num_threads(),
                                "mmap_threshold_set": mmap_threshold_set(),
                                "cpu_peak_supported": cpu_peak_supported(),
                                "dynamo_graphs": int(counters["stats"]["unique_graphs"]),
                                "graph_breaks": int(sum(counters["graph_break"].values()))}
        if self.config.method in HILORE_BACKENDS:
            exposures = exposure_before_forward(self.data.advantages, self.data.mask, self.loss_config)
            self.bucket = choose_bucket(self.prepared.backend, exposures)
            plan = plan_summary(self.prepared.backend)
            info.update(bucket=self.bucket, exposures=exposures.tolist(), plan=plan)
            predicted = plan.get("predicted_memory_bytes", {}).get(self.bucket)
            if predicted is not None:
                info["predicted_peak_bytes"] = predicted
            info.update(step_cosines(plan, self.bucket))
        if self.config.method in SEARCHED:
            knob = knob_name(self.config.method)
            info[knob] = getattr(self.config.options, knob)
        info.update(self.prepared.record())
        return info


def _handle(worker: Any, request: dict[str, Any]) -> dict[str, Any]:
    if request["cmd"] == "setup":
        return worker.setup()
    if request["cmd"] == "measure":
        return {"samples": [dataclasses.asdict(s) for s in worker.measure(int(request["steps"]))]}
    if request["cmd"] == "tensor_peak" and hasattr(worker, "tensor_peak"):
        return worker.tensor_peak()
    raise ValueError(f"unknown worker command {request['cmd']!r}")


def serve(config: WorkerConfig, commands: TextIO, answers: TextIO) -> None:
    """Answer commands until ``exit`` or end of input; errors are answers, not crashes."""
    serve_requests(lambda: Worker(config), commands, answers)


def serve_requests(make: Callable[[], Any], commands: TextIO, answers: TextIO) -> None:
    """``serve`` for any worker with ``setup()`` and ``measure(steps)``, made on the first command."""
    worker = None
    for line in commands:
        request = json.loads(line)
        if request["cmd"] == "exit":
            return
        try:
            worker = worker or make()
            reply = {"ok": True, **_handle(worker, request)}
        except Exception as e:  # the runner records the failure and goes on with other methods
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            infeasible = infeasible_cause(e)
            if infeasible is not None:  # the plan does not fit: say what would
                reply["min_budget_bytes"] = infeasible.min_budget_bytes
        answers.write(json.dumps(reply) + "\n")
        answers.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = WorkerConfig.from_json(argv[0])
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints now go to stderr (the worker's log), not into the protocol
    serve(config, sys.stdin, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
