"""The machine a bench runs on: what a result file records of it, and what makes its timings unlike another's."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

#: x86 vector ISAs (``torch.backends.cpu.get_cpu_capability()``) on which torch 2.x multiplies
#: bf16 matrices without a bf16 kernel: oneDNN's bf16 GEMMs need AVX-512, so ATen's
#: fallback converts element by element. Measured on a 2-vCPU AMD EPYC (AVX2), one thread,
#: 4096x256 by 256x768: 1042 ms in bf16 against 26 ms in fp32.
_NO_BF16_GEMM = ("DEFAULT", "AVX2")


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(device: str) -> dict[str, Any]:
    """Where the run happened: enough to tell two result files apart.

    The CPU's name and the vector ISA Inductor compiles for (``AVX2``,
    ``AVX512``) are part of it: GC's step of the default configuration took
    1.6 s on one machine of this project's kind and 2.6 s on another.
    """
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "machine": platform.machine(),
           "processor": platform.processor(), "cpu_model": cpu_model(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
           "loadavg_end": list(os.getloadavg()), "device": device}
    if device == "cuda":
        env["cuda_device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def bf16_emulation_warning(device: str, dtype: str) -> str | None:
    """Why a bf16 bench on this CPU answers other costs than bf16 training's, or None.

    On an x86 CPU without AVX-512 every bf16 matmul takes tens of times its
    fp32 time, so a recompute costs far more than on the machines bf16 is
    trained on, and a step of the ``small`` policy takes about half a minute.
    The planners profile this CPU, so their pairings stay fair here, but the
    plans and ratios are this CPU's, not those of a bf16 machine.
    """
    if device != "cpu" or dtype != "bfloat16":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _NO_BF16_GEMM:
        return None
    return (f"this CPU ({cpu_model() or 'unknown'}, {capability}) has no bf16 matmul kernel in torch: "
            "every bf16 matmul runs tens of times slower than in fp32, so a recompute costs far more "
            "than where bf16 is trained and the plans and ratios answer this CPU's costs; for bf16 as "
            "it is trained run on a CPU with AVX-512 or with --device cuda, or use --dtype float32 here")
