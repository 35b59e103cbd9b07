"""The arms compared: the exact policy and the policy compiled under each plan.

An arm's model is what ``actor_update`` calls. ``exact`` is the eager policy
(autograd stores every activation: the reference gradient). The others run
``torch.compile(policy, backend=HiLoReBackend({"plan": plan}))``:

- ``hilore``: the solver's exposure-conditioned plan at a memory budget;
- ``hilore-blind``: the control for exposure conditioning: the same memory
  and error budget, solved as if one bucket held the whole update, the same
  decisions in every bucket (``solver.fixed.exposure_blind_plan``);
- ``blind-int8``: exposure- and cost-blind: every recovery unit int8 can
  encode is ``compress:int8`` in every bucket, the rest ``store``;
- ``store-all``: every unit stored; through the same backend, so it measures
  what Inductor's own rounding costs (the floor of any compiled arm).

The policy is traced once, at the very graph the arms
compile (the public ``trace`` at the arms' static shape), and every plan
is solved from that one trace: tracing profiles each unit and is the slow part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..backend import HiLoReBackend
from ..planfile import RECOMPUTE, STORE, BucketPlan, Plan
from ..tracefile import Trace

#: Codecs the plans may use (fp8 is slow to emulate on CPU and adds nothing here).
CODECS = ("bf16", "int8")


class FixedBatch(nn.Module):
    """Runs ``model`` at one batch size: pads smaller microbatches, drops the padding.

    A hilore plan is solved for one (batch, sequence) shape: a second shape
    makes dynamo recompile, with a symbolic batch (refused by the backend) or,
    under ``dynamic=False``, a static one the plan does not fit. ``actor_update`` cuts a batch
    into microbatches per bucket, so their sizes vary; padding with copies of
    the first row keeps one shape. The copies' logits are cut off before the
    loss, so no gradient reaches them and the gradient is unchanged.
    """

    def __init__(self, model: nn.Module, batch: int) -> None:
        super().__init__()
        self.model, self.batch = model, batch

    def forward(self, input_ids: Tensor) -> Tensor:
        b = input_ids.shape[0]  # (b, T)
        if b > self.batch:
            raise ValueError(f"microbatch of {b} rows exceeds the compiled batch {self.batch}")
        if b < self.batch:
            pad = input_ids[:1].expand(self.batch - b, -1)  # (batch - b, T): valid tokens
            input_ids = torch.cat([input_ids, pad], dim=0)
        return self.model(input_ids)[:b]  # (b, T, V)


@dataclass(frozen=True, slots=True, kw_only=True)
class Arm:
    """One side of a comparison: its name, eager policy, update model and plan."""

    name: str
    #: The eager module that owns the weights; sampling and scoring use it.
    policy: nn.Module
    #: What ``actor_update`` calls: ``policy`` itself, or its compiled ``FixedBatch``.
    model: nn.Module
    #: None for the exact arm.
    plan: Plan | None = None
    backend: HiLoReBackend | None = None


def trace_policy(policy: nn.Module, batch: int, seq_len: int, cost_model: str = "measured",
                 codecs: tuple[str, ...] = CODECS) -> Trace:
    """Trace ``policy`` at exactly (batch, seq_len), the static graph the arms compile.

    ``dynamic=False`` makes the tracer capture the joint graph a
    ``dynamic=False`` compile at this shape hands Inductor's partitioner, so
    the trace's unit keys are those the arms' plans are applied to.
    ``cost_model``: ``"measured"`` or ``"roofline:<device>"`` (codec errors
    are measured on the real activations either way). ``codecs``: those to measure.
    """
    from ..passes.tracer import TraceConfig, trace

    config = TraceConfig(cost_model=cost_model, codecs=codecs, model_name="tiny-eval", verbose=False,
                         dynamic=False)
    ids = torch.randint(0, policy.config.vocab_size, (batch, seq_len), generator=torch.Generator())
    return trace(policy, [ids], config=config)


def solve_plan(trace: Trace, budget: str, *, risk_budget: float | str | None, buckets: int) -> Plan:
    """The hilore plan at ``budget``; raises ``InfeasibleBudgetError`` if none fits."""
    from ..solver import solve

    return solve(trace, budget=budget, risk_budget=risk_budget, buckets=buckets, codecs=list(CODECS))


def blind_plan(trace: Trace, budget: str, *, risk_budget: float | str | None, buckets: int) -> Plan:
    """The exposure-blind control at the same memory and error budget (``solver.fixed``)."""
    from ..solver.fixed import exposure_blind_plan

    return exposure_blind_plan(trace, budget, risk_budget=risk_budget, buckets=buckets, codecs=list(CODECS))


def uniform_plan(trace: Trace, like: Plan, codec: str | None, label: str) -> Plan:
    """An exposure- and cost-blind plan with ``like``'s buckets and shape:
    ``compress:<codec>`` wherever the unit allows it, else ``store``
    (``codec=None``: store everything); ``solver.fixed_plan`` predicts it."""
    from ..solver import fixed_plan, uniform_codec

    specs = [b.bucket for b in like.buckets if not b.skip]
    return fixed_plan(trace, uniform_codec(codec), buckets=specs, codecs=list(CODECS), batch=like.batch,
                      seq_len=like.seq_len, label=label)


def option_counts(bucket: BucketPlan) -> dict[str, int]:
    """How many units of ``bucket`` are stored, compressed (per codec) and recomputed."""
    counts: dict[str, int] = {}
    for _, option in bucket.decisions:
        counts[option] = counts.get(option, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != STORE, kv[0] == RECOMPUTE, kv[0])))


def compiled_arm(name: str, policy: nn.Module, plan: Plan, cache_dir: str) -> Arm:
    """``policy`` compiled with the hilore backend under ``plan``, at the plan's batch.

    ``dynamic=False``: the plan is for one shape, and ``FixedBatch`` keeps it.
    """
    backend = HiLoReBackend({"plan": plan, "codecs": CODECS, "cache_dir": cache_dir, "verbose": False})
    compiled = torch.compile(policy, backend=backend, dynamic=False)
    return Arm(name=name, policy=policy, model=FixedBatch(compiled, plan.batch), plan=plan,
               backend=backend)


def exact_arm(policy: nn.Module) -> Arm:
    """The reference: the eager policy, every activation stored by autograd."""
    return Arm(name="exact", policy=policy, model=policy)


def load_weights(arm: Arm, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into the arm's policy in place (compiled graphs read the same tensors)."""
    with torch.no_grad():
        arm.policy.load_state_dict(state)
    arm.policy.zero_grad(set_to_none=True)
