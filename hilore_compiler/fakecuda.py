"""Fake CUDA: the joint graph a GPU compiles, on a CPU-only build of torch.

``FakeTensorMode`` makes tensors that say ``device="cuda"`` and hold no data,
so dynamo, AOTAutograd and Inductor's partitioner build the CUDA graph of a
model as they would on a GPU. Three things a CPU-only torch lacks stand in
for the GPU here, and only here (none of this is imported by the backend):

1. A device guard and CUDA hooks (``load_guard``): backward over CUDA
   leaves asks c10 for a CUDA device guard and ATen whether CUDA is built.
   A 20-line C++ library registers c10's ``FakeGuardImpl`` for CUDA and hooks
   whose ``isBuilt()`` is true. ATen caches its hooks on first use, so the
   library must be loaded before ``import torch``: call ``load_guard()`` at
   the top of a fresh process.
2. Inductor's ``constant_fold_uniform_value`` runs real factory calls with
   the graph's device; they run on the CPU instead (``install_stand_ins``).
3. sdpa's kernel choice has no CUDA kernel to ask: ``passes.gpu_lowering``
   answers as a GPU would (flash without a mask, memory-efficient with one).
4. Min-cut replays a recomputed random op (fused attention, dropout) with
   the forward's RNG state, and records a clone of the CUDA generator's
   state as that input's value: a CPU generator's stands in
   (``install_stand_ins``); only its type is read.

What it cannot show: anything that runs kernels (timings, Triton codegen,
numerics), the real sdpa choice's runtime checks, and cuDNN attention. The
compile stops at the end of the partitioner call; ``bench/gpu_session.sh``
runs the same models on a real GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GUARD_SOURCE = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace hilore_fake_cuda {
// Registered under the name ATen looks up ("CUDAHooks"): CUDA is "built", and
// no device has a primary context, so autograd never asks to set one up.
struct CUDAHooks final : at::CUDAHooksInterface {
  explicit CUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return false; }
};
}  // namespace hilore_fake_cuda

namespace at {
using hilore_fake_cuda::CUDAHooks;
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);
"""


def _torch_dir() -> Path:
    """Where torch is installed, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("torch is not installed")
    return Path(spec.origin).parent


def guard_library(build_dir: str | os.PathLike | None = None) -> Path:
    """The device-guard library for the installed torch, compiled on first use.

    Built with ``$CXX`` (default ``g++``, the compiler Inductor's CPU backend
    already needs) against torch's headers, into ``build_dir`` (default: a
    folder under the temp dir keyed by torch's location and the source).
    """
    torch_dir = _torch_dir()
    digest = hashlib.sha256(f"{torch_dir}|{GUARD_SOURCE}".encode()).hexdigest()[:12]
    folder = Path(build_dir or Path(tempfile.gettempdir()) / "hilore-fake-cuda")
    library = folder / f"libhilore_fake_cuda_{digest}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = Path(work) / "fake_cuda_guard.cpp"
        source.write_text(GUARD_SOURCE)
        partial = Path(work) / library.name
        command = [os.environ.get("CXX", "g++"), "-shared", "-fPIC", "-O1", "-std=c++20", "-w",
                   f"-I{torch_dir / 'include'}", str(source), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
                   "-o", str(partial)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building the fake CUDA guard failed ({' '.join(command)}):\n{result.stderr}")
        os.replace(partial, library)  # atomic: a concurrent builder finds a whole library or none
    return library


def load_guard(build_dir: str | os.PathLike | None = None) -> None:
    """Load the device guard and CUDA hooks; must run before ``import torch``."""
    if "torch" in sys.modules:
        raise RuntimeError("load_guard() must run before `import torch`: ATen caches its CUDA hooks "
                           "on first use. Call it at the top of a fresh process.")
    library = guard_library(build_dir)
    lib_dir = _torch_dir() / "lib"
    for name in ("libc10.so", "libtorch_cpu.so"):  # what the guard links against, made global first
        ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)


class _FactoriesOnCPU:
    """A dispatch mode (built lazily: it subclasses a torch class) that runs
    factory calls for CUDA on the CPU."""

    mode = None

    @classmethod
    def get(cls):
        if cls.mode is None:
            import torch
            from torch.utils._python_dispatch import TorchDispatchMode

            class FactoriesOnCPU(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    kwargs = dict(kwargs or {})
                    device = kwargs.get("device")
                    if device is not None and torch.device(device).type == "cuda":
                        kwargs["device"] = torch.device("cpu")
                    return func(*args, **kwargs)

            cls.mode = FactoriesOnCPU
        return cls.mode()


def install_stand_ins() -> contextlib.ExitStack:
    """Stand in for the GPU where Inductor, sdpa and min-cut would ask it (items 2-4 above).

    Returns the stack that holds them; ``close()`` takes them back.
    """
    from torch._inductor.fx_passes import joint_graph

    from .passes.gpu_lowering import lowered_as_gpu

    stack = contextlib.ExitStack()
    stack.enter_context(lowered_as_gpu())
    folder = joint_graph.UniformValueConstantFolder
    deduce = folder._deduce_value

    def deduce_on_cpu(self, node):
        # Folded values are scalars broadcast later by a `full` of the node's
        # own device: where they are computed does not change the graph.
        with _FactoriesOnCPU.get():
            return deduce(self, node)

    folder._deduce_value = deduce_on_cpu
    stack.callback(setattr, folder, "_deduce_value", deduce)
    stack.enter_context(_cpu_generator_for_cuda())
    return stack


def _cpu_generator_for_cuda() -> contextlib.AbstractContextManager:
    """Min-cut's ``get_default_generator`` with the CPU's generator standing in for CUDA's (item 4)."""
    from unittest import mock

    import torch
    import torch._functorch.partitioners as partitioners

    default_generator = partitioners.get_default_generator

    def generator(device):
        if torch.device(device).type == "cuda":
            return torch.default_generator
        return default_generator(device)

    return mock.patch.object(partitioners, "get_default_generator", generator)


class _PartitionDone(Exception):
    """Raised after the partitioner returned: the rest of the compile needs a GPU."""


def partition_only() -> contextlib.AbstractContextManager:
    """Within this block Inductor compiles up to the end of its partitioner
    call, and the compiled graph runs as dynamo traced it (eagerly, on fake
    tensors: shapes only). Past the partitioner Inductor would generate
    Triton kernels and ask the CUDA generator for its RNG state: neither
    exists in a CPU-only torch."""
    from unittest import mock

    import torch._inductor.compile_fx as compile_fx_module
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from .passes.capture import _UncachedPartitioner

    class StopAfter(_UncachedPartitioner):
        def __init__(self, partitioner):
            self.partitioner = partitioner

        def __call__(self, gm, joint_inputs, **kwargs):
            if self.partitioner is None:
                min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            else:
                self.partitioner(gm, joint_inputs, **kwargs)
            raise _PartitionDone

    compile_fx = compile_fx_module.compile_fx

    def compile_fx_partition_only(model_, example_inputs_, *args, config_patches=None, **kwargs):
        if config_patches is None or isinstance(config_patches.get("custom_partitioner_fn"), StopAfter):
            # compile_fx calling itself with the patches applied: pass through.
            return compile_fx(model_, example_inputs_, *args, config_patches=config_patches, **kwargs)
        patches = dict(config_patches)
        patches["custom_partitioner_fn"] = StopAfter(patches.get("custom_partitioner_fn"))
        try:
            return compile_fx(model_, example_inputs_, *args, config_patches=patches, **kwargs)
        except _PartitionDone:
            return model_.forward

    return mock.patch.object(compile_fx_module, "compile_fx", compile_fx_partition_only)


def fake_cuda_mode():
    """A ``FakeTensorMode`` whose factory calls make fake CUDA tensors; real
    tensors (a model built on the CPU) become fake ones when moved to ``"cuda"``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
