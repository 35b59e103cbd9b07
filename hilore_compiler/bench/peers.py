"""The planners that ship with PyTorch, as ``hilore bench`` methods whose knob is searched per ceiling.

Each is configured the way PyTorch's own sources tell users to, through the
config module that holds it, patched only while the first call compiles
(every method runs in a process of its own):

- ``pt-budget``: ``torch._functorch.config.activation_memory_budget`` with
  its defaults, the quantized 0-1 knapsack ``dp`` over recompute, runtimes
  counted in FLOPs (``FlopCounterMode``).
- ``pt-budget-greedy``: the same knapsack solved greedily by runtime per byte
  (``activation_memory_budget_solver="greedy"``).
- ``pt-budget-ilp``: solved exactly by scipy's MILP (``"ilp"``); needs scipy,
  which hilore does not depend on.
- ``pt-budget-knee``: ``"dynamic_memory_budget_dp"``: the DP run at the knee
  of its runtime-memory Pareto curve under the budget (PyTorch calls it
  experimental), so it may save less than the budget allows.
- ``pt-budget-profile``: ``dp`` with ``activation_memory_budget_runtime_estimator
  ="profile"``, each recompute candidate benchmarked: torch 2.13 times it with
  ``benchmarker.benchmark_gpu`` (Triton's ``do_bench``), so it runs on CUDA only.
- ``inductor-fp8``: Inductor's ``activation_quantization_aten_pass``
  (``torch._inductor.config.post_grad_fusion_options``): after Inductor's own
  partition, every saved activation of at least ``size_in_mb`` is kept in
  float8 (e5m2, scaled, its defaults) and dequantized in backward. Its
  ``allowed_dtypes`` lists fp32 beside its default bf16 so that fp32 runs
  quantize too; ``exclude_primals``: parameters stay resident, so an fp8 copy
  of one saved for backward adds memory.

Their knob (``Probe.budget``) is searched as ``pt-budget``'s always was: a grid
of probes, one worker each, and at each ceiling the fastest whose measured
peak fits (``search.py``, ``frontier.py``). ``activation_memory_budget``'s grid
is ``search.grid``; ``inductor-fp8``'s is ``FP8_SIZE_FACTORS``.

Left out: ``dp_knapsack_sliding_hirschberg`` solves the same quantized DP as
``dp`` in less solver memory (the same choices up to ties), and the per-region
``region_activation_memory_budget`` with one budget everywhere is the global one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._functorch.config  # not imported by ``import torch``; holds activation_memory_budget
import torch._inductor.config

from .search import grid


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSolver:
    """One ``activation_memory_budget`` configuration: the knapsack solver and runtime estimator."""

    #: ``torch._functorch.config.activation_memory_budget_solver``.
    solver: str = "dp"
    #: ``torch._functorch.config.activation_memory_budget_runtime_estimator``.
    estimator: str = "flops"
    #: Why it cannot run on a CPU-only torch (None: it can).
    needs_cuda: str | None = None
    #: A module it imports that hilore does not depend on (None: none).
    needs_module: str | None = None


#: The memory-budget methods, by method name (``pt-budget`` first: PyTorch's defaults).
PT_BUDGETS: dict[str, BudgetSolver] = {
    "pt-budget": BudgetSolver(),
    "pt-budget-greedy": BudgetSolver(solver="greedy"),
    "pt-budget-ilp": BudgetSolver(solver="ilp", needs_module="scipy"),
    "pt-budget-knee": BudgetSolver(solver="dynamic_memory_budget_dp"),
    "pt-budget-profile": BudgetSolver(
        estimator="profile",
        needs_cuda="the 'profile' runtime estimator times each op with benchmarker.benchmark_gpu "
                   "(Triton's do_bench), which torch 2.13 has for CUDA only"),
}

#: Inductor's fp8 saved activations.
INDUCTOR_FP8 = "inductor-fp8"

#: Methods whose knob is searched over a grid of probes, per ceiling on the frontier.
SEARCHED = (*PT_BUDGETS, INDUCTOR_FP8)

#: ``inductor-fp8``'s ``size_in_mb`` probes, as multiples of one (B, T, hidden) activation of
#: the step. A Llama layer saves hidden-sized tensors, k/v at half that (grouped-query
#: attention, half as many kv heads), MLP intermediates at intermediate/hidden (2.7x for
#: ``small``) and row statistics far below: 0.25 quantizes all but the statistics, 0.75
#: the hidden-sized and MLP ones, 1.5 the MLP intermediates alone. PyTorch's default, 100
#: MB, quantizes nothing at ``small``'s sizes (its largest activation is 11 MB).
FP8_SIZE_FACTORS = (0.25, 0.75, 1.5)

#: ``post_grad_fusion_options["activation_quantization_aten_pass"]`` apart from ``size_in_mb``.
FP8_PASS_OPTIONS = {"quant_type": "torch.float8_e5m2", "use_scaling": True,
                    "allowed_dtypes": "torch.bfloat16;torch.float32", "exclude_primals": True}

#: Labels for the report.
LABELS = {
    "pt-budget": "PT mem-budget",
    "pt-budget-greedy": "PT mem-budget, greedy",
    "pt-budget-ilp": "PT mem-budget, ILP",
    "pt-budget-knee": "PT mem-budget, knee DP",
    "pt-budget-profile": "PT mem-budget, profiled",
    INDUCTOR_FP8: "Inductor fp8 activations",
}


def hidden_state_mb(model: str, batch: int, seq_len: int, dtype: str) -> float:
    """MiB of one (B, T, hidden) activation of the step (``inductor-fp8``'s unit)."""
    from ..models import hidden_size

    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return batch * seq_len * hidden_size(model) * itemsize / 2**20


def probe_grid(method: str, probes: int, unit_mb: float) -> list[float]:
    """The knob values ``method``'s search tries: ``search.grid(probes)`` budgets for the
    memory-budget methods, ``FP8_SIZE_FACTORS`` times ``unit_mb`` (``hidden_state_mb``) MiB
    thresholds for ``inductor-fp8``."""
    if method == INDUCTOR_FP8:
        return [round(f * unit_mb, 4) for f in FP8_SIZE_FACTORS]
    if method in PT_BUDGETS:
        return grid(probes)
    raise ValueError(f"{method!r} is not a searched method ({', '.join(SEARCHED)})")


def knob_name(method: str) -> str:
    """What ``method``'s searched value sets (the ``MethodOptions`` field and the record's key)."""
    return "fp8_size_mb" if method == INDUCTOR_FP8 else "activation_memory_budget"


def compile_context(method: str, knob: float | None, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The config patch ``method`` compiles under, with its searched ``knob``.

    Raises:
        ValueError: the knob is missing or out of range, or the method cannot run on
            ``device`` (CUDA only) or here (a module it needs is not installed).
    """
    if knob is None or knob < 0 or (method in PT_BUDGETS and knob > 1):
        raise ValueError(f"{method} needs {knob_name(method)} >= 0 (<= 1 for a budget), got {knob}")
    if method == INDUCTOR_FP8:
        options = {"activation_quantization_aten_pass": {**FP8_PASS_OPTIONS, "size_in_mb": knob}}
        return functools.partial(torch._inductor.config.patch, post_grad_fusion_options=options)
    solver = PT_BUDGETS[method]
    if solver.needs_cuda and device.type != "cuda":
        raise ValueError(f"{method} runs on CUDA only: {solver.needs_cuda}")
    if solver.needs_module and importlib.util.find_spec(solver.needs_module) is None:
        raise ValueError(f"{method} needs {solver.needs_module} (pip install {solver.needs_module})")
    patch = {"activation_memory_budget": knob}
    if method != "pt-budget":
        # The solver and the estimator are left out of AOTAutograd's cache key
        # (functorch config's _save_config_ignore), so with the cache a variant
        # would be served pt-budget's partition at the same budget.
        patch.update(activation_memory_budget_solver=solver.solver,
                     activation_memory_budget_runtime_estimator=solver.estimator, enable_autograd_cache=False)
    return functools.partial(torch._functorch.config.patch, **patch)
