"""What a bench records of its machine, and the warning for bf16 on a CPU without a bf16 matmul."""

import pytest
import torch

from hilore_compiler.bench import host


@pytest.fixture
def x86(monkeypatch):
    """Pretend to be an x86 CPU whose vector ISA the test names."""
    monkeypatch.setattr(host.platform, "machine", lambda: "x86_64")

    def with_capability(capability: str) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)

    return with_capability


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_bf16_on_a_cpu_without_avx512_is_warned_about(x86, capability):
    x86(capability)
    warning = host.bf16_emulation_warning("cpu", "bfloat16")
    assert warning is not None
    assert capability in warning and "AVX-512" in warning and "--device cuda" in warning


@pytest.mark.parametrize("device, dtype, capability", [
    ("cpu", "bfloat16", "AVX512"),   # oneDNN's bf16 GEMMs
    ("cpu", "float32", "AVX2"),      # fp32 is native everywhere
    ("cuda", "bfloat16", "AVX2"),    # the CPU does not multiply
])
def test_no_warning_where_bf16_has_a_kernel_or_is_not_asked_for(x86, device, dtype, capability):
    x86(capability)
    assert host.bf16_emulation_warning(device, dtype) is None


def test_non_x86_cpus_are_not_judged(monkeypatch):
    monkeypatch.setattr(host.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert host.bf16_emulation_warning("cpu", "bfloat16") is None


def test_environment_names_the_cpu_and_its_vector_isa():
    env = host.environment("cpu")
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
