"""The log-prob chunk size as a planner decision: ``choose_chunk_tokens``.

Chunked log-probs (``step.compiled_step(..., chunk_tokens=N,
checkpoint_chunks=False)``) trade memory for time through the chunk size.
Small chunks keep little of the (tokens, V) logits alive at once, but every
chunk adds a (V, C) partial gradient of the lm_head to backward, written and
summed once per chunk; large chunks do the reverse. Which size wins depends
on the vocabulary, the memory budget and the device, so the planner decides:

1. price each candidate's memory: trace the whole step at that chunk size
   and solve its plan under the one budget every candidate shares (the
   memory model's peak, or the smallest budget that would fit);
2. time the candidates whose plan fits: compile each with its plan and
   run a few steps;
3. keep the fastest. Its compiled step is returned, ready to train with.

A candidate whose plan does not fit is never compiled. Traces and plans go
to the hilore backend's cache, so a second call with the same options skips
the tracing.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..solver import InfeasibleBudgetError, infeasible_cause
from ..solver.budget import format_bytes, parse_budget
from .config import GRPOConfig
from .step import StepFn, compiled_step

__all__ = ["ChunkChoice", "ChunkTrial", "NoChunkFitsError", "choose_chunk_tokens", "default_chunk_candidates"]

#: ``default_chunk_candidates`` keeps chunk sizes that split the tokens into
#: 2 to 8 chunks: one chunk is the unchunked (B, T-1, V) logits, which chunking
#: exists to avoid, and past 8 the per-chunk partial gradients of the lm_head
#: dominate backward (on CPU at a 128k vocabulary, 16 chunks of 32 tokens ran
#: 1.7x slower than 4 of 128).
MIN_CHUNKS, MAX_CHUNKS = 2, 8


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkTrial:
    """What one candidate chunk size was priced and measured at."""

    chunk_tokens: int
    #: Chunks the step's B * (T - 1) predicting tokens make.
    chunks: int
    #: True when a plan fits the budget at this chunk size.
    fits: bool
    #: The plan's predicted peak (bytes, the largest over its buckets); None when none fits.
    predicted_peak_bytes: int | None = None
    #: When no plan fits: the smallest budget (bytes) that one would.
    min_budget_bytes: int | None = None
    #: The plan's predicted recovery seconds per step (its slowest bucket).
    predicted_recovery_s: float | None = None
    #: Median measured seconds per step (None: not timed, because no plan fits).
    seconds: float | None = None
    #: Measured peak bytes of the timed steps' median, where the device can
    #: measure it (CUDA; CPU only under ``bench.measure.MMAP_THRESHOLD_ENV``).
    peak_bytes: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkChoice:
    """The chosen chunk size, its compiled step, and every candidate's figures."""

    chunk_tokens: int
    #: The winner's ``compiled_step`` with its plan, compiled and warm.
    step: StepFn
    #: The hilore backend that compiled ``step`` (its ``graphs`` hold the plan).
    backend: Any
    #: The budget every candidate was solved under, in bytes.
    budget_bytes: int
    trials: tuple[ChunkTrial, ...]

    def table(self) -> str:
        """The candidates as a text table, the chosen one marked."""
        rows = ["chunk tokens  chunks  predicted peak  measured s/step  measured peak"]
        for t in self.trials:
            peak = (format_bytes(t.predicted_peak_bytes) if t.fits
                    else f"no fit (needs {format_bytes(t.min_budget_bytes or 0)})")
            seconds = f"{t.seconds:.3f}" if t.seconds is not None else "-"
            measured = format_bytes(t.peak_bytes) if t.peak_bytes is not None else "-"
            mark = " <- chosen" if t.chunk_tokens == self.chunk_tokens else ""
            rows.append(f"{t.chunk_tokens:>12}  {t.chunks:>6}  {peak:>14}  {seconds:>15}  {measured:>13}{mark}")
        return "\n".join(rows)

    def to_json(self) -> dict[str, Any]:
        """The choice and the trials, for a bench record."""
        return {"chunk_tokens": self.chunk_tokens, "budget_bytes": self.budget_bytes,
                "trials": [dataclasses.asdict(t) for t in self.trials]}


def default_chunk_candidates(tokens: int) -> tuple[int, ...]:
    """Powers of two that split ``tokens`` predicting positions into MIN_CHUNKS..MAX_CHUNKS chunks."""
    if tokens < MIN_CHUNKS:
        raise ValueError(f"{tokens} predicting token(s) cannot be chunked")
    sizes = [2 ** k for k in range(tokens.bit_length() + 1)]
    chosen = tuple(c for c in sizes if MIN_CHUNKS <= -(-tokens // c) <= MAX_CHUNKS)
    return chosen or (max(1, tokens // MIN_CHUNKS),)


def _shared_budget(options: Mapping[str, Any]) -> None:
    """Refuse a budget that would differ between candidates.

    ``x-gc`` without ``gc_peak_bytes`` is relative to GC's modelled peak *of
    each candidate's graph*, and ``x-store`` to its store-all peak, which
    both change with the chunk size: the candidates would not compete at one
    ceiling.
    """
    budget = parse_budget(options.get("memory_budget", "1.10x-gc"))
    if budget.reference == "store" or (budget.reference == "gc" and options.get("gc_peak_bytes") is None):
        raise ValueError(
            f"choose_chunk_tokens compares chunk sizes at one memory ceiling, but budget "
            f"{budget.text!r} is relative to a peak that changes with the chunk size: give the "
            "budget in bytes ('750MB'), or 'x-gc' with options['gc_peak_bytes'] set to GC + chunked "
            "log-probs' measured peak")


class NoChunkFitsError(InfeasibleBudgetError):
    """No candidate chunk size fits the budget; ``trials`` says what each one needs."""

    def __init__(self, message: str, *, trials: tuple[ChunkTrial, ...], **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.trials = trials


def _none_fits(closest: InfeasibleBudgetError, options: Mapping[str, Any], trials: tuple[ChunkTrial, ...]) -> NoChunkFitsError:
    """The error for a budget no candidate fits: it names the smallest that does, and where."""
    chunk = next(t.chunk_tokens for t in trials if t.min_budget_bytes == closest.min_budget_bytes)
    tried = ", ".join(str(t.chunk_tokens) for t in trials)
    return NoChunkFitsError(
        f"memory budget {options.get('memory_budget', '1.10x-gc')} ({format_bytes(closest.budget_bytes)}) "
        f"fits no chunk size tried ({tried} tokens): the smallest feasible budget is "
        f"{format_bytes(closest.min_budget_bytes)} ({closest.min_budget_bytes} bytes), at {chunk} tokens per chunk",
        trials=trials, bucket=closest.bucket, budget_bytes=closest.budget_bytes,
        min_budget_bytes=closest.min_budget_bytes)


def _time_alternating(model: nn.Module, runs: Mapping[int, Callable[[], None]], steps: int,
                      device: torch.device) -> dict[int, tuple[float, int | None]]:
    """Per candidate, the median seconds and peak of ``steps`` steps, after one warm-up each.

    The candidates take turns, one step each per round, so that a machine
    that slows down or speeds up meanwhile weighs on all of them alike.
    Gradients are freed before every step, as after ``zero_grad``.
    """
    from ..bench.measure import measure_step, mmap_threshold_set

    samples: dict[int, list] = {chunk: [] for chunk in runs}
    for round_ in range(steps + 1):
        for chunk, run in runs.items():
            model.zero_grad(set_to_none=True)
            sample = measure_step(run, device)
            if round_:  # round 0 warms up
                samples[chunk].append(sample)
    model.zero_grad(set_to_none=True)
    peak_measurable = device.type == "cuda" or mmap_threshold_set()
    return {chunk: (statistics.median(s.seconds for s in got),
                    int(statistics.median(s.peak_bytes for s in got)) if peak_measurable else None)
            for chunk, got in samples.items()}


def _compile_candidate(model: nn.Module, config: GRPOConfig, batch: Sequence[Tensor], chunk: int,
                       options: Mapping[str, Any]) -> tuple[ChunkTrial, Any, InfeasibleBudgetError | None]:
    """Trace, price, solve and compile the step at one chunk size.

    Returns its trial and either ``(step, run, backend)`` ready to time, or
    None and the solver's InfeasibleBudgetError when no plan fits.
    """
    from ..backend import HiLoReBackend

    input_ids = batch[0]
    chunks = -(-input_ids.shape[0] * (input_ids.shape[1] - 1) // chunk)
    backend = HiLoReBackend(options)
    step = compiled_step(model, config, backend=backend, chunk_tokens=chunk, checkpoint_chunks=False, dynamic=False)

    def run() -> None:
        step(*batch).backward()

    model.zero_grad(set_to_none=True)
    try:
        run()  # traces, prices and solves this chunk size, then compiles its plan
    except Exception as error:
        infeasible = infeasible_cause(error)
        if infeasible is None:
            raise
        return (ChunkTrial(chunk_tokens=chunk, chunks=chunks, fits=False, min_budget_bytes=infeasible.min_budget_bytes),
                None, infeasible)
    planned = [b for b in backend.graphs[0].plan.buckets if not b.skip]
    trial = ChunkTrial(chunk_tokens=chunk, chunks=chunks, fits=True,
                       predicted_peak_bytes=max(b.memory_bytes for b in planned),
                       predicted_recovery_s=max(b.time_s for b in planned))
    return trial, (step, run, backend), None


def choose_chunk_tokens(
    model: nn.Module,
    config: GRPOConfig,
    batch: Sequence[Tensor],
    *,
    options: Mapping[str, Any],
    candidates: Sequence[int] | None = None,
    steps: int = 5,
    progress: Callable[[str], None] | None = None,
) -> ChunkChoice:
    """Choose the log-prob chunk size of the whole actor step: fits the budget, runs fastest.

    Args:
        model: the policy (see ``step.compiled_step`` for what it must expose).
        config: the GRPO loss options.
        batch: one step's ``(input_ids (B, T), old_logprobs (B, T-1),
            advantages (B,), mask (B, T-1))``, at the shape training runs.
        options: the hilore backend's options. The budget must be the same
            for every chunk size: in bytes, or ``x-gc`` with ``gc_peak_bytes``.
        candidates: chunk sizes (tokens) to try; default
            ``default_chunk_candidates(B * (T - 1))``.
        steps: timed steps per candidate, the candidates taking turns (after a warm-up step each).
        progress: called with a line per candidate (default: stderr).

    Returns:
        ``ChunkChoice`` with the fastest fitting candidate's compiled step.

    Raises:
        ValueError: a budget relative to a per-candidate peak, or bad candidates.
        NoChunkFitsError (an InfeasibleBudgetError): no candidate fits; it
            names the smallest budget that would, and its ``trials`` each
            candidate's.
    """
    _shared_budget(options)
    input_ids = batch[0]
    tokens = input_ids.shape[0] * (input_ids.shape[1] - 1)
    candidates = tuple(candidates) if candidates is not None else default_chunk_candidates(tokens)
    if not candidates or any(not isinstance(c, int) or c < 1 for c in candidates):
        raise ValueError(f"chunk candidates must be positive token counts, got {candidates!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    say = progress or (lambda msg: print(f"hilore chunks: {msg}", file=sys.stderr, flush=True))
    strict = {**options, "strict": True}  # a plan that does not fit must raise, not fall back
    trials: dict[int, ChunkTrial] = {}
    compiled: dict[int, tuple[StepFn, Callable[[], None], Any]] = {}
    closest = None
    for chunk in sorted(set(candidates)):
        trial, ready, infeasible = _compile_candidate(model, config, batch, chunk, strict)
        trials[chunk] = trial
        if ready is not None:
            compiled[chunk] = ready
            say(f"{chunk} tokens ({trial.chunks} chunks): predicted peak {format_bytes(trial.predicted_peak_bytes)} "
                f"of {format_bytes(ready[2].graphs[0].plan.budget_bytes)}")
        else:
            if closest is None or infeasible.min_budget_bytes < closest.min_budget_bytes:
                closest = infeasible
            say(f"{chunk} tokens ({trial.chunks} chunks): no plan fits; needs {format_bytes(trial.min_budget_bytes)}")
    if not compiled:
        raise _none_fits(closest, options, tuple(trials.values()))
    runs = {chunk: run for chunk, (_, run, _) in compiled.items()}
    for chunk, (seconds, peak) in _time_alternating(model, runs, steps, input_ids.device).items():
        trials[chunk] = dataclasses.replace(trials[chunk], seconds=seconds, peak_bytes=peak)
        say(f"{chunk} tokens: {seconds:.3f} s/step (median of {steps})")
    trial = min((trials[c] for c in compiled), key=lambda t: t.seconds)
    say(f"chose {trial.chunk_tokens} tokens per chunk")
    step, _, backend = compiled[trial.chunk_tokens]
    # Strict only while choosing: from here on the step trains, and a later
    # compile (a new shape) must fall back to Inductor, not stop training.
    backend.options = dataclasses.replace(backend.options, strict=bool(options.get("strict", False)))
    return ChunkChoice(chunk_tokens=trial.chunk_tokens, step=step, backend=backend,
                       budget_bytes=backend.graphs[0].plan.budget_bytes, trials=tuple(trials.values()))
