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

The multi-token comparison (``presets``) trains other arms: what a user gets,
each planned by the backend itself on its first call (``BENCH_ARMS``):

- ``hilore``: ``torch.compile(policy, backend="hilore")`` with no options,
  which is ``memory_budget="1.10x-gc"`` and codecs bf16, int8;
- ``hilore-int4``: the same with int4 allowed too (codecs bf16, int8, int4);
- ``int8-recompute``: ``hilore bench``'s method of that name: one bucket, int8
  the only codec, no error budget, recompute where int8 alone does not fit;
- ``store-all``: plain ``torch.compile`` (Inductor's own partition, nothing
  lossy): the control for what compiling alone changes. Its updates differ
  from eager by rounding only, so its paired difference to ``exact`` is how
  far rounding alone moves a run, the floor the others are read against.

Each is a ``hilore bench`` method (the hilore ones with the backend options of
``bench.methods.backend_options``), so another method that runs the hilore
backend is one line of ``BENCH_ARMS``. A method with a runtime of its own,
such as main's eager ``paper`` (a ``before_backward`` hook fed the loss's
log-probs, and a profiling pass at set-up), needs its own branch in
``bench_arm`` and ``warm_up``, and ``actor_update`` a hook before backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..backend import HiLoReBackend
from ..backend.runtime import exposure
from ..grpo import ExposureBuckets, plan_buckets
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
    #: None for the exact arm and plain ``torch.compile``.
    plan: Plan | None = None
    backend: HiLoReBackend | None = None

    @property
    def exact(self) -> bool:
        """True when the update runs the eager policy itself (the reference)."""
        return self.model is self.policy


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


#: Arms the backend plans itself: arm name -> (``hilore bench`` method, ``MethodOptions`` fields
#: that differ from the bench's defaults).
BENCH_ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "hilore": ("hilore", {}),
    "hilore-int4": ("hilore", {"hilore_codecs": ("bf16", "int8", "int4")}),
    "int8-recompute": ("int8-recompute", {}),
    "store-all": ("store-all", {}),
    # "paper": ("paper", {}): see the module docstring for what its runtime needs besides this line.
}


def arm_backend_options(name: str, cache_dir: str) -> dict[str, Any]:
    """The hilore backend options arm ``name`` of ``BENCH_ARMS`` compiles with."""
    from ..bench.methods import MethodOptions, backend_options

    method, fields = BENCH_ARMS[name]
    # measure_loss=False: the loss's peak is the backend's model of it, as in a zero-config compile.
    options = MethodOptions(hilore_cache_dir=cache_dir, verbose=False, measure_loss=False, **fields)
    return backend_options(method, options)


def bench_arm(name: str, policy: nn.Module, batch: int, cache_dir: str) -> Arm:
    """``policy`` compiled as arm ``name`` of ``BENCH_ARMS``; planned on its first call (``warm_up``).

    ``dynamic=False``, with ``FixedBatch`` holding one shape: the graph is the
    static one a first compile gets, whatever else this process compiled
    (dynamo would otherwise mark a dimension dynamic once it saw two sizes).
    """
    if BENCH_ARMS[name][0] == "store-all":  # Inductor's defaults, as the bench's store-all
        compiled = torch.compile(policy, dynamic=False)
        return Arm(name=name, policy=policy, model=FixedBatch(compiled, batch))
    backend = HiLoReBackend(arm_backend_options(name, cache_dir))
    compiled = torch.compile(policy, backend=backend, dynamic=False)
    return Arm(name=name, policy=policy, model=FixedBatch(compiled, batch), backend=backend)


def warm_up(arm: Arm, batch: int, seq_len: int) -> Arm:
    """Compile ``arm`` now; returns it with the plan the backend made (unchanged if it had one).

    The first call plans and compiles every bucket's forward, but AOTAutograd
    compiles a backward on its first use: one forward and backward per bucket
    keeps those compiles out of the training run's timings.
    """
    ids = torch.randint(0, arm.policy.config.vocab_size, (batch, seq_len), generator=torch.Generator())
    arm.model(ids).float().pow(2).mean().backward()  # plans, outside any bucket
    if arm.plan is None and arm.backend is not None:
        graphs = arm.backend.graphs
        if len(graphs) != 1 or graphs[0].plan is None:
            raise RuntimeError(f"arm {arm.name}: expected one planned graph, got {len(graphs)} "
                               f"({'no plan' if graphs else 'none compiled'})")
        arm = dataclasses.replace(arm, plan=graphs[0].plan)
    for bucket in arm.plan.buckets if arm.plan is not None else ():
        with exposure(bucket.bucket.name):
            arm.model(ids).float().pow(2).mean().backward()
    arm.policy.zero_grad(set_to_none=True)
    return arm


def arm_buckets(arm: Arm, num_sequences: int) -> ExposureBuckets | None:
    """The exposure buckets ``arm`` updates a batch of ``num_sequences`` with: its plan's
    (``grpo.plan_buckets``), as the trl integration uses them; None for an arm without
    a plan (``actor_update`` then cuts at the batch's quantiles)."""
    return None if arm.plan is None else plan_buckets(arm.plan, num_sequences)


def exact_arm(policy: nn.Module) -> Arm:
    """The reference: the eager policy, every activation stored by autograd."""
    return Arm(name="exact", policy=policy, model=policy)


def load_weights(arm: Arm, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into the arm's policy in place (compiled graphs read the same tensors)."""
    with torch.no_grad():
        arm.policy.load_state_dict(state)
    arm.policy.zero_grad(set_to_none=True)
