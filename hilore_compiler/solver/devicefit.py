"""Whether a plan's step fits the card its roofline trace was made for.

A plan's ``memory_bytes`` is the step's predicted peak above what the
process held before the step (``memory.py``): the weights and the optimizer
state. So a card must hold that peak plus the *training state*:

    state = frozen parameters                 (a LoRA model's base weights, once)
          + trained parameters
          + AdamW's exp_avg and exp_avg_sq    (each the size and dtype of its
                                               parameter, as torch.optim.AdamW keeps them)

The trained parameters' gradients are not in it: backward makes them inside
the step, and the peak already counts those made so far (``peak_parts``'s
``weight_gradients``; all of them at the end of backward), so adding them
again would count them twice. What this leaves out: the optimizer step's own
temporaries (it runs after backward, when the activations are gone), the CUDA
context and the allocator's fragmentation, so a fit within a few percent of
the card is a close call.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass

from ..devices import DEVICES, DeviceSpec, GiB
from ..planfile import Plan
from .budget import format_bytes

#: AdamW's moments per trained parameter (exp_avg, exp_avg_sq), each of its size.
ADAMW_MOMENTS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingState:
    """What the process holds through the step besides the step's own memory (module docstring)."""

    trained_bytes: int
    #: 0 where the trace did not record frozen parameters (``frozen_known``).
    frozen_bytes: int
    frozen_known: bool = True

    @property
    def total_bytes(self) -> int:
        return self.frozen_bytes + (1 + ADAMW_MOMENTS) * self.trained_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFit:
    """One predicted peak, plus the training state, against one card's memory."""

    device: DeviceSpec
    peak_bytes: int
    state: TrainingState

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.state.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device.memory_bytes

    @property
    def room_bytes(self) -> int:
        """The largest step peak the card holds beside the state: the budget that would fit."""
        return self.device.memory_bytes - self.state.total_bytes


def plan_device(plan: Plan) -> DeviceSpec | None:
    """The card a plan's costs are for (``roofline:<device>``), or None (measured costs)."""
    kind, _, name = plan.cost_source.partition(":")
    return DEVICES.get(name) if kind == "roofline" else None


def training_state(plan: Plan) -> TrainingState | None:
    """The plan's training state, or None where its trace recorded no parameter bytes."""
    if plan.trained_param_bytes is None:
        return None
    return TrainingState(trained_bytes=plan.trained_param_bytes, frozen_bytes=plan.frozen_param_bytes or 0,
                         frozen_known=plan.frozen_param_bytes is not None)


def device_fits(plan: Plan) -> list[tuple[tuple[str, ...], DeviceFit]]:
    """Per distinct predicted peak among the plan's buckets (buckets sharing a plan
    share one): the buckets and their fit; empty when the plan names no card or
    its trace recorded no parameter bytes."""
    device, state = plan_device(plan), training_state(plan)
    if device is None or state is None:
        return []
    peaks: dict[int, list[str]] = {}
    for b in plan.buckets:
        if not b.skip:
            peaks.setdefault(b.memory_bytes, []).append(b.bucket.name)
    return [(tuple(names), DeviceFit(device=device, peak_bytes=peak, state=state)) for peak, names in peaks.items()]


def _article(label: str) -> str:
    """``a`` or ``an`` before a product name read letter by letter (an L40S, an H100, a B200)."""
    return "an" if label[:1] in "AEFHILMNORSX" else "a"


def suggested_budget(room_bytes: int) -> str:
    """A ``--budget`` no larger than ``room_bytes``: to two decimals of its largest binary
    unit, rounded down (``40.09GiB``), so that it fits."""
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if room_bytes >= size:
            return f"{math.floor(room_bytes / size * 100) / 100:.2f}{unit}"
    return str(room_bytes)


def fit_line(fit: DeviceFit) -> str:
    """``fits an L40S (48.00 GiB): peak 31.20 GiB + state 7.90 GiB, 8.90 GiB free``, or by
    how much it does not and the budget that would."""
    card = f"{_article(fit.device.label)} {fit.device.label} ({format_bytes(fit.device.memory_bytes)})"
    parts = f"peak {format_bytes(fit.peak_bytes)} + state {format_bytes(fit.state.total_bytes)}"
    if fit.fits:
        return f"fits {card}: {parts}, {format_bytes(fit.device.memory_bytes - fit.total_bytes)} free"
    over = format_bytes(fit.total_bytes - fit.device.memory_bytes)
    if fit.room_bytes <= 0:
        return f"does not fit {card} by {over}: {parts}; the training state alone does not fit"
    return f"does not fit {card} by {over}: {parts}; --budget {suggested_budget(fit.room_bytes)} would"


def fit_lines(plan: Plan, width: int = 100) -> list[str]:
    """The plan's fit on its card, one line per distinct peak, then what the state
    holds, wrapped to ``width``; empty when the plan names no card or its trace
    recorded no parameter bytes."""
    fits = device_fits(plan)
    if not fits:
        return []
    state = fits[0][1].state
    frozen = (f"frozen weights {format_bytes(state.frozen_bytes)}" if state.frozen_known
              else "frozen weights not recorded by the trace")
    lines = [f"{', '.join(names)}: {fit_line(fit)}" for names, fit in fits]
    lines.append(f"(state: {frozen}, trained {format_bytes(state.trained_bytes)} + AdamW moments "
                 f"{format_bytes(ADAMW_MOMENTS * state.trained_bytes)}; their gradients are in the peak)")
    return [textwrap.fill(line, width, initial_indent="  ", subsequent_indent="      ") for line in lines]
