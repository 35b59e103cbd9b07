"""Analytic (roofline) costs, so a plan for a GPU can be made without one.

Times are estimated per op as max(FLOPs / peak FLOP/s, bytes / peak bandwidth)
from the vendor's published dense peaks, scaled by the fraction a well-tuned
kernel reaches in practice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """Published peak numbers of one accelerator (dense, no sparsity)."""

    name: str
    #: Tensor-core FLOP/s for 16-bit inputs (bf16/fp16).
    flops_16bit: float
    #: FLOP/s for fp32 inputs (TF32 tensor cores, as PyTorch uses for matmul
    #: when allow_tf32 is on; the usual setting for training).
    flops_fp32: float
    #: HBM bytes per second.
    bandwidth: float


#: Fraction of peak a tuned kernel reaches: about 70% for GEMMs and 80% of
#: HBM bandwidth for streaming kernels on Hopper/Ampere (vendor and MLPerf
#: figures); a roofline without it would be optimistic by the same factor
#: for every option, which would not change plans but would mislead readers.
MATMUL_EFFICIENCY = 0.7
BANDWIDTH_EFFICIENCY = 0.8

DEVICES = {
    "h100": DeviceSpec(name="h100", flops_16bit=989e12, flops_fp32=494.7e12, bandwidth=3.35e12),
    "h200": DeviceSpec(name="h200", flops_16bit=989e12, flops_fp32=494.7e12, bandwidth=4.8e12),
    "a100": DeviceSpec(name="a100", flops_16bit=312e12, flops_fp32=156e12, bandwidth=2.039e12),
}


def device_spec(cost_model: str) -> DeviceSpec:
    """``"roofline:h100"`` -> the H100's spec; a clear error for unknown devices."""
    kind, _, name = cost_model.partition(":")
    if kind != "roofline" or name not in DEVICES:
        raise ValueError(
            f"unknown cost model {cost_model!r}: use 'measured' or one of "
            + ", ".join(f"'roofline:{d}'" for d in DEVICES)
        )
    return DEVICES[name]


def op_seconds(spec: DeviceSpec, flops: float, nbytes: float, dtype: torch.dtype) -> float:
    """Roofline time of one op with ``flops`` arithmetic and ``nbytes`` memory traffic."""
    peak = spec.flops_fp32 if dtype == torch.float32 else spec.flops_16bit
    return max(flops / (peak * MATMUL_EFFICIENCY), nbytes / (spec.bandwidth * BANDWIDTH_EFFICIENCY))
