"""Analytic (roofline) costs, so a plan for a GPU can be made without one.

Times are estimated per op as max(FLOPs / peak FLOP/s, bytes / peak bandwidth)
from the vendor's published dense peaks, scaled by the fraction a well-tuned
kernel reaches in practice. The devices and their figures are ``devices.DEVICES``.
"""

from __future__ import annotations

import torch

# The table of devices lives in a torch-free module; its names stay importable from here.
from ..devices import DEVICES, DeviceSpec, GiB, device_spec  # noqa: F401


#: Fraction of peak a tuned kernel reaches: about 70% for GEMMs and 80% of
#: HBM bandwidth for streaming kernels on Hopper/Ampere (vendor and MLPerf
#: figures); a roofline without it would be optimistic by the same factor
#: for every option, which would not change plans but would mislead readers.
MATMUL_EFFICIENCY = 0.7
BANDWIDTH_EFFICIENCY = 0.8


def op_seconds(spec: DeviceSpec, flops: float, nbytes: float, dtype: torch.dtype) -> float:
    """Roofline time of one op with ``flops`` arithmetic and ``nbytes`` memory traffic."""
    peak = spec.flops_fp32 if dtype == torch.float32 else spec.flops_16bit
    return max(flops / (peak * MATMUL_EFFICIENCY), nbytes / (spec.bandwidth * BANDWIDTH_EFFICIENCY))
