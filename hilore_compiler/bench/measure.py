"""Time and peak memory of one step, with the definition DESIGN.md "Measuring" gives.

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus what was allocated before the step.
- CPU: ``VmHWM`` after the step minus ``VmRSS`` before it, with the high-water
  mark reset by writing ``5`` to ``/proc/self/clear_refs`` just before the
  step. The process must run with ``MALLOC_MMAP_THRESHOLD_=65536`` (set by the
  runner when it spawns the worker) so that large tensors are mmapped and go
  back to the OS when freed; otherwise freed memory stays in the process and
  the next step's peak is hidden inside RSS already counted "before".
  Smaller allocations still come from malloc's heap, whose freed pages stay
  resident, so the heap is trimmed before every step (``trim_heap``).

A process on the default allocator measures time only (the bench's timed
workers): its steps run on a resident heap, as a trainer's do. Trimming
there too made every step fault its working set back in: on ``small``
(fp32, B=2, T=2048, one thread) 310-400 MB of minor faults and 0.12-0.16 s
of a 2.3 s step, against 20-30 MB untrimmed, so plans were charged for the
pages they touch, which a trainer's heap keeps, rather than for their time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: The glibc tunable (bytes) that makes the CPU peak measurable, see the module docstring.
MMAP_THRESHOLD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: Writing this to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
_RESET_PEAK_RSS = "5"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSample:
    """One measured step."""

    #: Wall seconds of the step (CUDA: synchronised before and after).
    seconds: float
    #: Peak bytes the step added over what the process held before it.
    peak_bytes: int
    #: The round of alternation it was measured in (runner); negative: a
    #: settling round, not counted; None: warm-up.
    round: int | None = None


def status_bytes(field: str) -> int:
    """A ``VmXXX`` field of ``/proc/self/status`` in bytes (the file says kB = KiB)."""
    with open(_STATUS) as f:
        text = f.read()
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} line; CPU peak memory needs Linux procfs")
    return int(match.group(1)) * 1024


def reset_peak_rss() -> None:
    """Make ``VmHWM`` equal the current ``VmRSS``."""
    with open(_CLEAR_REFS, "w") as f:
        f.write(_RESET_PEAK_RSS)


def cpu_peak_supported() -> bool:
    """True if this process can reset and read its RSS high-water mark."""
    return os.path.exists(_STATUS) and os.access(_CLEAR_REFS, os.W_OK)


def mmap_threshold_set() -> bool:
    """True if this process was started with the malloc setting the CPU peak needs."""
    return all(os.environ.get(k) == v for k, v in MMAP_THRESHOLD_ENV.items())


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def trim_heap() -> None:
    """Give the malloc heap's free pages back to the OS (glibc ``malloc_trim(0)``; elsewhere nothing).

    Allocations under ``MMAP_THRESHOLD_ENV``'s 64 KiB (small tensors,
    autograd's and Python's objects) come from the heap, where freed pages
    stay resident. A worker that compiled its graphs holds tens of MB of them,
    one whose graphs came from Inductor's cache holds few, and the same step
    then reads 3-5 MB lower in the first (the actor bench's zero skip read
    3.5 MB over the same plans without it, its allocator peak equal).
    Trimmed before each step, every process starts from the same state.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def measure_cpu(step: Callable[[], object], *, trim: bool | None = None) -> StepSample:
    """Run ``step`` once on CPU; peak = VmHWM after - VmRSS before.

    ``trim``: start from a trimmed heap (``trim_heap``), as a peak needs. None:
    trim where the process runs with ``MMAP_THRESHOLD_ENV`` (a peak worker),
    not on the default allocator, whose steps are timed as a trainer runs them
    (module docstring) and whose VmHWM measures no peak anyway.
    """
    if mmap_threshold_set() if trim is None else trim:
        trim_heap()
    reset_peak_rss()
    before = status_bytes("VmRSS")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return StepSample(seconds=seconds, peak_bytes=status_bytes("VmHWM") - before)


def measure_cuda(step: Callable[[], object], device: torch.device) -> StepSample:
    """Run ``step`` once on CUDA; peak = max_memory_allocated - allocated before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    step()
    torch.cuda.synchronize(device)  # kernels are asynchronous: wait before reading the clock
    seconds = time.perf_counter() - start
    return StepSample(seconds=seconds, peak_bytes=torch.cuda.max_memory_allocated(device) - before)


def measure_step(step: Callable[[], object], device: torch.device | str) -> StepSample:
    """Time ``step`` and measure its peak memory on ``device`` (``cpu`` or ``cuda``)."""
    device = torch.device(device)
    if device.type == "cuda":
        return measure_cuda(step, device)
    if device.type == "cpu":
        return measure_cpu(step)
    raise ValueError(f"peak memory is defined for cpu and cuda, not {device.type!r}")


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened in parameter order (zeros where None)."""
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
             for p in model.parameters()]
    return torch.cat(parts).float()


def gradient_fidelity(grad: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(cosine, relative L2 error) of a flattened gradient against the exact one, in fp64."""
    if grad.shape != exact.shape:
        raise ValueError(f"gradients of different models: {tuple(grad.shape)} vs {tuple(exact.shape)}")
    g, e = grad.double(), exact.double()
    cosine = float(torch.dot(g, e) / (g.norm() * e.norm()).clamp_min(torch.finfo(torch.float64).tiny))
    rel_l2 = float((g - e).norm() / e.norm().clamp_min(torch.finfo(torch.float64).tiny))
    return cosine, rel_l2


def loss_side(loss: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device | str) -> float:
    """The loss's own peak as a multiple of its input's bytes: ``BackendOptions.loss_ratio``.

    Runs ``loss(outputs).backward()`` once on random ``outputs`` of ``shape``
    (the compiled graph's outputs: the logits) with the same peak measure as a
    step (``measure_step``), counted above the outputs themselves: what the
    loss adds while every activation is still alive (``solver/memory.py``).
    Measured rather than modelled because it depends on the loss's kernels
    (3.0 for fp32 token log-probs + the GRPO loss: a log-softmax temporary,
    the gather's dense gradient and their sum; more for bf16, whose fp32 copy
    is kept for backward).
    """
    outputs = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)

    def run() -> None:
        loss(outputs).backward()

    run()  # first call: lazy allocations and kernel caches are not the loss's
    outputs.grad = None
    if torch.device(device).type == "cpu":
        # The allocator's own count, not VmHWM: the same in every process
        # (VmHWM moves by pages the heap happens to hold, and on the default
        # allocator hides the peak in memory malloc kept), so workers with
        # and without MMAP_THRESHOLD_ENV plan the same loss side and share
        # one cached plan.
        peak = allocator_peak(run)
    else:
        peak = measure_step(run, device).peak_bytes
    return max(0.0, peak / (outputs.numel() * outputs.element_size()))


def allocation_deltas(step: Callable[[], object]) -> list[int]:
    """The CPU allocator's allocations (+bytes) and frees (-bytes) during ``step()``, in time order,
    from torch.profiler's memory events (slower than ``measure_cpu``: every allocation is recorded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    return [nbytes for _, nbytes in events]


def allocation_trail(step: Callable[[], object]) -> tuple[int, list[tuple[int, int]]]:
    """(peak bytes the CPU allocator held above the start of ``step()``, [(delta, running total)]
    per allocation and free in time order), from ``allocation_deltas``."""
    total = peak = 0
    running = []
    for nbytes in allocation_deltas(step):
        total += nbytes
        peak = max(peak, total)
        running.append((nbytes, total))
    return peak, running


def allocator_peak(step: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator held above the start of ``step()`` (``allocation_trail``):
    for a process started without ``MMAP_THRESHOLD_ENV``, where VmHWM is not a measure."""
    return allocation_trail(step)[0]


def plan_loss_ratio(ratio: float) -> float:
    """A measured ``loss_side`` as the plans take it: rounded up to a tenth.

    Up, so that the loss phase, where an int8-heavy plan peaks, is never
    under-predicted (2.94 -> 3.0 adds 2 MB on small at T=2048); to a tenth,
    so that workers measuring it in their own processes get the same value
    and share the trace cached under the same options.
    """
    return math.ceil(round(ratio * 10, 6)) / 10
