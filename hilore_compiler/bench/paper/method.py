"""``PaperMethod``: the recovery, allocator, profiling and calibration of this package, joined.

A step: before the forward every decoder layer gets its capture from the chosen plan (all R
without one). Between the loss and backward (``before_backward``) the GRPO coefficients omega
(``grpo.token_coefficients``: exact, clip activity and K3 KL included) give the exposure, the
sum of |omega| over response tokens; each layer's L risk is ``kappa * mean_error * exposure``;
the allocator picks every layer's action within the budget's bytes over the plan's all-R peak
and ``risk_budget * microbatch tokens / update tokens``; the bundles drop what it does not keep.

Set-up (``profile``, which the bench worker runs before its first step): GC's peak and the
budget; each layer's saved bytes and its L tensor at the scaled threshold; the calibration;
the isolated ranking, up to three capture plans and their tables; each plan run with the
scheduler, kept when it fits the budget, keeps the gradient error within
``GRADIENT_ERROR_THRESHOLD`` and beats all R; the fastest is the plan.

Where this differs from the reference, and why:

- One process, one device, any policy of the bench; peaks by the bench's meter (CUDA:
  ``max_memory_allocated``; CPU: the allocator's count, ``profile.measure_plan``), not
  NVML over four FSDP ranks.
- GC's peak: the bench's (``gc_peak_bytes``) on CUDA, same meter; on CPU the bench's is a
  VmHWM figure, so eager GC is measured here with the method's meter, as the reference's
  initialisation measures its own GC.
- The L threshold, 32 MiB at Qwen2.5-3B, is scaled to the model (``L_THRESHOLD_SHARE``), and
  the compute dtype is the layer input's: in fp32 L casts fp32 -> fp8 -> fp32.
- Calibration microbatches are batches of other seeds in the bench's shape, not training data.
- Plans are validated on the bench's batch, without the leave-one-out pruning of actions or
  the multi-update development replays; the bench has one shape, so one plan at most.
- The risk budget is the bench's error budget as a relative L2 error (the reference leaves
  it to a development selection; its README tries 0.010).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ...grpo import token_coefficients
from ...solver.budget import parse_budget
from ..measure import flat_grad, gradient_fidelity
from .allocator import allocate
from .calibration import Calibration, CalibrationStep, calibrate
from .layers import L_THRESHOLD_SHARE, PaperRecovery
from .profile import (
    H_FRACTIONS,
    CapturePlan,
    Measured,
    choose_captures,
    measure_plan,
    plan_tables,
    rank_units,
)

#: The reference's gradient error threshold for accepting a plan (``gradient_error_threshold``).
GRADIENT_ERROR_THRESHOLD = 0.015


@dataclass(frozen=True, slots=True, kw_only=True)
class PaperConfig:
    """What the ``paper`` method is run with."""

    #: The memory budget: ``"1.10x-gc"`` (the reference's ``memory_multiplier``) or bytes.
    memory_budget: str = "1.10x-gc"
    #: GC's measured peak the ``x-gc`` budget multiplies (used on CUDA, see the module docstring).
    gc_peak_bytes: int | None = None
    #: Bound on the predicted relative L2 gradient error of a whole update.
    risk_budget: float = 0.01
    #: Microbatches the calibration observes (the reference's ``calibration_microbatches``).
    calibration_microbatches: int = 16
    #: Timed steps per measured plan, after one warm-up step (the reference's ``--repeats``).
    repeats: int = 5

    def __post_init__(self) -> None:
        if self.calibration_microbatches < 1 or self.repeats < 1:
            raise ValueError("calibration_microbatches and repeats must be >= 1")
        if not (math.isfinite(self.risk_budget) and self.risk_budget >= 0):
            raise ValueError(f"risk_budget must be finite and >= 0, got {self.risk_budget}")


#: ``step(data)``: one actor step on ``data`` through this method's policy and ``before_backward``.
Step = Callable[[Any], None]


class PaperMethod:
    """The runtime on one policy: its recovery, plan and calibration, and what it decided."""

    def __init__(self, model: nn.Module, config: PaperConfig) -> None:
        self.model, self.config = model, config
        self.recovery = PaperRecovery(model)
        self.device = next(model.parameters()).device
        self.layers = len(self.recovery.layers)
        self.plan: CapturePlan | None = None
        self.calibration: dict[int, Calibration] = {}
        self.budget_bytes: int | None = None
        #: Captures and actions every step takes while profiling; None: the scheduler's.
        self.fixed: tuple[Sequence[str], Sequence[str]] | None = None
        self.exposure = 0.0
        self.facts: dict[str, Any] = {"l_threshold_share": L_THRESHOLD_SHARE}
        self.last: dict[str, Any] = {}
        #: Each layer's saved tensors' metadata and L tensor as profiled; a step that differs runs all R.
        self._profiled: list[tuple[list, int | None]] = []

    # -- the step ------------------------------------------------------------------------

    def policy(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits (B, T, V), every layer captured as the plan says."""
        captures = self.fixed[0] if self.fixed else self.plan.captures if self.plan else ("R",) * self.layers
        self.recovery.begin(captures)
        return self.model(input_ids)

    def before_backward(self, logprobs: torch.Tensor, data: Any, loss_config: Any) -> None:
        """Select every layer's action from this step's coefficients (the bench's step is
        on-policy: old log-probs are the step's own)."""
        if self.recovery.gc:  # measuring GC's peak: no bundles to select for
            return
        omega = token_coefficients(logprobs, logprobs.detach(), data.advantages, data.mask, loss_config)  # (B, T-1)
        self.exposure = float((omega.detach().double().abs() * data.mask.bool()).sum())
        if self.fixed is not None:
            taken = self.recovery.select(self.fixed[1])
            if taken != list(self.fixed[1]):
                raise RuntimeError(f"a profiled action fell back: asked {list(self.fixed[1])}, took {taken}")
            return
        tokens = int(data.mask.sum())
        self.last = self.schedule(self.exposure, microbatch_tokens=tokens, update_tokens=tokens)

    def schedule(self, exposure: float, *, microbatch_tokens: int, update_tokens: int) -> dict[str, Any]:
        """Allocate and select this step's actions; what was decided, for the record."""
        plan, bundles = self.plan, self.recovery.bundles
        if plan is None or self._saved_state() != self._profiled:
            # No plan, or the layers saved other tensors than profiled: all R, as the reference.
            return {"exposure": exposure, "actions": self.recovery.select(["R"] * self.layers)}
        available, risks = [], []
        for i in range(self.layers):
            offered = set(plan.admitted[i]) & bundles[i].available
            available.append(tuple(offered))
            risks.append(self.calibration[i].risk(exposure) if "L" in offered else 0.0)
        memory_left = self.budget_bytes - plan.all_r.peak_bytes
        risk_left = self.config.risk_budget * microbatch_tokens / update_tokens
        allocation = allocate(plan.utility, plan.memory, risks, plan.captures, available, memory_left, risk_left)
        return {"exposure": exposure, "risks": risks, "memory_left": memory_left, "risk_left": risk_left,
                "utility_s": allocation.utility, "actions": self.recovery.select(allocation.actions)}

    # -- set-up --------------------------------------------------------------------------

    def profile(self, step: Step, data: Any, batch: Callable[[int], Any]) -> None:
        """Measure, calibrate and choose the plan (module docstring); ``batch(k)`` is the
        k-th calibration microbatch."""
        start = time.perf_counter()
        gc_peak = self._gc_peak(step, data)
        parsed = parse_budget(self.config.memory_budget)
        store = self._trial(step, data)(("H",) * self.layers, ("H",) * self.layers).peak_bytes \
            if parsed.reference == "store" else 0
        self.budget_bytes = parsed.bytes_at(gc_bytes=gc_peak, store_bytes=store)
        eligible = self.find_l_tensors(step, data)
        self.calibration = calibrate(lambda k, captures: self._observe(step, batch(k), captures), eligible,
                                     self.layers, self.config.calibration_microbatches)
        offered = [("R", "H", "L") if i in self.calibration else ("R", "H") for i in range(self.layers)]
        trial = self._trial(step, data)
        ranked = rank_units(trial, offered, gc_peak)
        plans, seen = [], set()
        for fraction in H_FRACTIONS:
            captures = tuple(choose_captures(ranked, fraction, max(0.0, self.budget_bytes - gc_peak), self.layers))
            if captures in seen or set(captures) == {"R"}:
                continue
            seen.add(captures)
            all_r = trial(captures, ("R",) * self.layers)
            if all_r.peak_bytes <= self.budget_bytes:
                plans.append(plan_tables(trial, captures, offered, all_r))
        self.plan = self._validated(step, data, plans)
        self.facts.update(budget_bytes=self.budget_bytes, gc_peak_bytes=gc_peak, candidate_plans=len(plans),
                          calibrated_layers=sorted(self.calibration), profile_s=time.perf_counter() - start)

    def _gc_peak(self, step: Step, data: Any) -> int:
        if self.config.gc_peak_bytes is not None and self.device.type == "cuda":
            self.facts["gc_peak_source"] = "the bench's GC"
            return self.config.gc_peak_bytes
        self.recovery.gc = True
        try:
            peak = self._measure(step, data).peak_bytes
        finally:
            self.recovery.gc = False
        self.facts["gc_peak_source"] = "eager GC measured by the method"
        return peak

    def find_l_tensors(self, step: Step, data: Any) -> list[int]:
        """Set each layer's L threshold from its saved bytes; the layers that have an L tensor."""
        all_r = ("R",) * self.layers
        self.run_fixed(step, data, all_r, all_r)  # counts each layer's saved bytes
        layer_bytes = [self.recovery.bundles[i].activation_bytes for i in range(self.layers)]
        self.recovery.thresholds = [math.ceil(L_THRESHOLD_SHARE * b) for b in layer_bytes]
        self.run_fixed(step, data, all_r, all_r)  # finds each layer's L tensor at its threshold
        bundles = [self.recovery.bundles[i] for i in range(self.layers)]
        self._profiled = self._saved_state()
        self.facts.update(layer_saved_bytes=layer_bytes, l_threshold_bytes=self.recovery.thresholds,
                          selected=[b.selected for b in bundles],
                          l_tensor_shapes=[None if b.selected is None else list(b.records[b.selected][0])
                                           for b in bundles])
        return [i for i, b in enumerate(bundles) if b.selected is not None and not b.invalid_alias]

    def _saved_state(self) -> list[tuple[list, int | None]]:
        return [(b.records, b.selected) for b in self.recovery.bundles.values()]

    def _observe(self, step: Step, data: Any, captures: Sequence[str]) -> CalibrationStep:
        self.recovery.measure_error = True
        try:
            self.run_fixed(step, data, captures, captures)
        finally:
            self.recovery.measure_error = False
        bundles = [self.recovery.bundles[i] for i in range(self.layers)]
        return CalibrationStep(gradient=flat_grad(self.model), exposure=self.exposure,
                               errors=[b.reconstruction_error for b in bundles], selected=[b.selected for b in bundles])

    def _validated(self, step: Step, data: Any, plans: Sequence[CapturePlan]) -> CapturePlan | None:
        """The fastest plan whose scheduled steps fit the budget, keep the gradient error within
        ``GRADIENT_ERROR_THRESHOLD`` and beat all R; None if none does."""
        all_r = ("R",) * self.layers
        self.run_fixed(step, data, all_r, all_r)
        exact = flat_grad(self.model)
        self.plan = None
        baseline = self._measure(step, data)
        accepted = []
        for plan in plans:
            self.plan = plan
            plan.validated = self._measure(step, data)
            error = gradient_fidelity(flat_grad(self.model), exact)[1]
            if (plan.validated.peak_bytes <= self.budget_bytes and error <= GRADIENT_ERROR_THRESHOLD
                    and plan.validated.seconds < baseline.seconds):
                accepted.append(plan)
        self.facts["all_r_seconds"] = baseline.seconds
        return min(accepted, key=lambda p: p.validated.seconds, default=None)

    def run_fixed(self, step: Step, data: Any, captures: Sequence[str], actions: Sequence[str]) -> None:
        """One step with fixed captures and actions."""
        self.fixed = (captures, actions)
        try:
            self.model.zero_grad(set_to_none=True)
            step(data)
        finally:
            self.fixed = None

    def _measure(self, step: Step, data: Any) -> Measured:
        return measure_plan(lambda: step(data), lambda: self.model.zero_grad(set_to_none=True), self.device,
                            self.config.repeats)

    def _trial(self, step: Step, data: Any) -> Callable[[Sequence[str], Sequence[str]], Measured]:
        def trial(captures: Sequence[str], actions: Sequence[str]) -> Measured:
            self.fixed = (captures, actions)
            try:
                return self._measure(step, data)
            finally:
                self.fixed = None
        return trial

    def record(self) -> dict[str, Any]:
        """What the method found and decided, for the bench's record."""
        plan = None if self.plan is None else self.plan.to_json()
        calibration = {str(i): asdict(c) for i, c in self.calibration.items()}
        return {"paper": {**self.facts, "config": asdict(self.config), "plan": plan, "calibration": calibration,
                          "last_step": self.last}}
