"""The accelerators plans are made for: published peaks, memory, and where the figures come from.

Torch-free, so that ``hilore plan`` and ``hilore show`` can say whether a
plan fits a card (``solver.devicefit``) without importing torch; the roofline
cost model (``passes.costmodel``) reads the same table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """Published peak numbers of one accelerator (dense, no sparsity)."""

    name: str
    #: The product as people name it, for messages: ``"L40S"``, ``"H100 SXM"``.
    label: str
    #: Tensor-core FLOP/s for 16-bit inputs (bf16/fp16).
    flops_16bit: float
    #: FLOP/s for fp32 inputs (TF32 tensor cores, as PyTorch uses for matmul
    #: when allow_tf32 is on; the usual setting for training).
    flops_fp32: float
    #: Device memory bytes per second.
    bandwidth: float
    #: Device memory, as the vendor states it ("80 GB" read as 80 GiB, which is
    #: what the card carries; the CUDA context and allocator take a little of it).
    memory_bytes: int
    #: The product and where its figures come from.
    source: str


GiB = 1 << 30


def _spec(name: str, label: str, tflops_16bit: float, tflops_fp32: float, tb_per_s: float, gib: int,
          source: str) -> DeviceSpec:
    return DeviceSpec(name=name, label=label, flops_16bit=tflops_16bit * 1e12, flops_fp32=tflops_fp32 * 1e12,
                      bandwidth=tb_per_s * 1e12, memory_bytes=gib * GiB, source=source)


#: Dense (no sparsity) bf16 and TF32 tensor FLOP/s, memory bandwidth and size, from each vendor's
#: datasheet. ``h100`` is the SXM part, ``a100`` the 80 GB SXM part (the names the first traces used).
DEVICES = {d.name: d for d in (
    _spec("h100", "H100 SXM", 989.4, 494.7, 3.35, 80, "NVIDIA H100 SXM5 80 GB datasheet (2023): bf16 989 TFLOPS, TF32 "
          "495 TFLOPS dense, HBM3 3.35 TB/s"),
    _spec("h100-pcie", "H100 PCIe", 756.0, 378.0, 2.0, 80, "NVIDIA H100 PCIe 80 GB datasheet (2023): bf16 756 "
          "TFLOPS, TF32 378 TFLOPS dense, HBM2e 2.0 TB/s"),
    _spec("h200", "H200", 989.4, 494.7, 4.8, 141, "NVIDIA H200 SXM 141 GB datasheet (2024): the H100's tensor cores, "
          "HBM3e 4.8 TB/s"),
    _spec("b200", "B200", 2250.0, 1100.0, 8.0, 180, "NVIDIA HGX B200 datasheet (2025), per GPU: bf16 2.25 PFLOPS, TF32 "
          "1.1 PFLOPS dense, HBM3e 8 TB/s, 180 GB"),
    _spec("a100", "A100 80GB", 312.0, 156.0, 2.039, 80, "NVIDIA A100 80 GB SXM datasheet (2021): bf16 312 TFLOPS, TF32 "
          "156 TFLOPS dense, HBM2e 2.039 TB/s"),
    _spec("a100-40gb", "A100 40GB", 312.0, 156.0, 1.555, 40, "NVIDIA A100 40 GB SXM datasheet (2021): bf16 312 TFLOPS, "
          "TF32 156 TFLOPS dense, HBM2 1.555 TB/s"),
    _spec("l40s", "L40S", 362.05, 183.0, 0.864, 48, "NVIDIA L40S datasheet (2023): bf16 362 TFLOPS, TF32 183 TFLOPS "
          "dense (733 and 366 with sparsity), GDDR6 864 GB/s, 48 GB"),
    _spec("l4", "L4", 121.0, 60.0, 0.3, 24, "NVIDIA L4 datasheet (2023): bf16 121 TFLOPS, TF32 60 TFLOPS dense "
          "(242 and 120 with sparsity), GDDR6 300 GB/s, 24 GB"),
    _spec("a10g", "A10G", 125.0, 62.5, 0.6, 24, "NVIDIA A10 datasheet (2021): bf16 125 TFLOPS, TF32 62.5 TFLOPS "
          "dense, GDDR6 600 GB/s, 24 GB; AWS's A10G (G5 instances) has no datasheet of its own and runs "
          "at lower clocks, so this is its ceiling"),
    _spec("rtx4090", "RTX 4090", 165.2, 82.6, 1.008, 24, "NVIDIA Ada Lovelace architecture whitepaper (2022), GeForce "
          "RTX 4090: bf16 with fp32 accumulate 165.2 TFLOPS, TF32 82.6 TFLOPS dense, GDDR6X 1008 GB/s, 24 GB"),
    _spec("mi300x", "MI300X", 1307.4, 653.7, 5.3, 192, "AMD Instinct MI300X datasheet (2023): bf16 1307 TFLOPS, TF32 "
          "654 TFLOPS dense, HBM3 5.3 TB/s, 192 GB"),
    # Not a roofline of any one machine: fixed, nominal figures of a 2-core AVX2 x86 host (fp32 FMA
    # at about 3 GHz; bf16 without AVX-512 runs about 40x slower than fp32 there), so that CPU plans
    # depend on shapes alone and every process, loaded or not, makes the same one.
    _spec("cpu", "nominal CPU host", 0.005, 0.2, 0.02, 24, "nominal 2-core AVX2 x86 host: fp32 200 GFLOPS, "
          "bf16 5 GFLOPS, 20 GB/s; for reproducible CPU plans, not a measurement"),
)}


def device_spec(cost_model: str) -> DeviceSpec:
    """``"roofline:h100"`` -> the H100's spec; a clear error for unknown devices."""
    kind, _, name = cost_model.partition(":")
    if kind != "roofline" or name not in DEVICES:
        raise ValueError(
            f"unknown cost model {cost_model!r}: use 'measured' or 'roofline:<device>' with <device> one of "
            + ", ".join(DEVICES)
        )
    return DEVICES[name]
