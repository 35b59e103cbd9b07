"""``sac-milp``: PyTorch's memory-budgeted selective AC (``torch.distributed._tools.sac_ilp``), CUDA only.

Its flow, as torch's ``test/distributed/_tools/test_sac_ilp.py`` runs it:

1. ``estimate``: under ``FakeTensorMode``, a shadow of the policy (its class
   and config, fake weights on the same device and dtype) runs the bench's
   step (forward, fp32 token log-probs, GRPO loss, backward) twice under
   ``MemTracker`` (per-module memory snapshots; the second step counted),
   once under ``RuntimeEstimator``, and its forward and loss once under
   ``SACEstimator`` (each op's memory and runtime inside every non-leaf
   module), both estimators in ``operator-level-cost-model`` mode, the roofline
   torch's test uses.
2. ``plan``: ``aggregate_stats`` (which fits ``pwlf`` to each module's
   memory-recompute trade-off) and ``parse_module_info`` make the module tree;
   ``sac_milp`` picks the AC units (any non-leaf module, none nested) and the
   share of each one's activation memory to discard, under the budget in GiB.
3. ``apply``: a unit that discards a share r is checkpointed under the op-level
   policy ``get_optimal_checkpointing_policy_per_module`` solves at memory
   budget 1 - r, as torch's auto-SAC prototype applies ``ac_decisions``; a unit
   that discards all (r >= ``FULL_DISCARD``) is plainly checkpointed, as
   ``gc``'s layers are.

The budget. ``sac_milp`` bounds parameters + gradients + activations; the
bench's ceiling bounds the step's peak over what the process held before it
(parameters, the batch). So the budget in GiB is (ceiling + parameter bytes) /
2**30, the ceiling ``MethodOptions.hilore_budget`` (``<m>x-gc``: times GC's
measured peak, as the frontier plans at each ceiling, or a size).

CUDA only (``CUDA_ONLY``): torch 2.13's estimators time ops on CUDA alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..grpo import GRPOConfig, grpo_loss
from ..models import token_logprobs
from ..solver.budget import parse_budget
from .checkpointing import Checkpointed

#: The method's name, and its label in the report.
METHOD, LABEL = "sac-milp", "PT SAC MILP (sac_ilp)"

#: Why it refuses a CPU device.
CUDA_ONLY = ("torch 2.13's RuntimeEstimator and SACEstimator time every op either with a roofline model "
             "that asserts torch.cuda.is_available() ('operator-level-cost-model') or with "
             "torch.cuda.Event ('operator-level-benchmark')")

#: The estimators' mode: the roofline, as torch's test of ``sac_milp`` runs them.
ESTIMATE_MODE = "operator-level-cost-model"

#: Modules it imports that hilore does not depend on: ``sac_ilp`` the MILP solver,
#: ``SACEstimator`` the piecewise-linear fit (which needs scipy).
NEEDS_MODULES = ("pulp", "pwlf", "scipy")

#: A discard ratio at or over this is a whole recompute: ``sac_milp`` rounds r to 4 places.
FULL_DISCARD = 0.9999

#: One unit's op-level policy: per op name, save (1) or recompute (0) at each of its calls in order.
OpDecisions = tuple[tuple[str, tuple[int, ...]], ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SacMilpPlan:
    """What ``sac_milp`` chose for one step shape."""

    #: The budget it solved under, GiB (parameters included).
    budget_gib: float
    #: Module FQN (torch's: the root's class name first) -> share of its activation memory discarded.
    ac_decisions: dict[str, float]
    #: Module FQN -> its op-level policy (``OpDecisions``), None for a whole recompute.
    policies: dict[str, OpDecisions | None]
    #: ``sac_milp``'s estimate of the recompute time, ms.
    recomputation_ms: float
    #: ``sac_milp``'s upper bound on the peak, bytes; the baseline's without AC.
    peak_bytes: int
    baseline_peak_bytes: int

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["policies"] = {fqn: None if p is None else {name: list(d) for name, d in p}
                           for fqn, p in self.policies.items()}
        return out


def missing_modules() -> list[str]:
    """The modules of ``NEEDS_MODULES`` not installed here."""
    return [m for m in NEEDS_MODULES if importlib.util.find_spec(m) is None]


def budget_gib(text: str, gc_peak_bytes: int | None, param_bytes: int) -> float:
    """``sac_milp``'s budget for the bench budget ``text`` (``<m>x-gc`` or a size), GiB.

    Raises:
        ValueError: ``x-store``, or ``x-gc`` without GC's measured peak.
    """
    budget = parse_budget(text)
    if budget.reference == "store" or (budget.reference == "gc" and gc_peak_bytes is None):
        raise ValueError(f"{METHOD} plans at a size or a multiple of GC's measured peak (run gc too), "
                         f"not {text!r}")
    ceiling = budget.bytes_at(gc_bytes=gc_peak_bytes or 0, store_bytes=0)
    return (ceiling + param_bytes) / 2**30


def _step(model: nn.Module, batch: Sequence[torch.Tensor], loss_config: GRPOConfig, backward: bool = True) -> Any:
    """The bench's step (``worker.actor_step``) on ``batch`` = (ids, advantages, mask)."""
    ids, advantages, mask = batch
    logprobs = token_logprobs(model(ids), ids)  # (B, T-1) fp32
    loss = grpo_loss(logprobs, logprobs.detach(), advantages, mask, loss_config)
    return loss.backward() if backward else loss


def estimate(model: nn.Module, shape: tuple[int, int], loss_config: GRPOConfig) -> tuple[Any, Any, Any, nn.Module]:
    """``MemTracker``, ``RuntimeEstimator`` and ``SACEstimator`` of the step on a fake shadow of
    ``model`` at token shape (B, T), and the shadow (their module keys)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    param = next(model.parameters())
    with FakeTensorMode(), torch.device(param.device):
        with _default_dtype(param.dtype):  # not ``.to(dtype)``: fake parameters cannot be swapped
            shadow = type(model)(model.config)
        batch = (torch.randint(model.config.vocab_size, shape), torch.randn(shape[0]),
                 torch.ones(shape[0], shape[1] - 1))  # ids (B, T), advantages (B,), mask (B, T-1)
        memory = MemTracker()
        memory.track_external(shadow)
        with memory:
            for first in (True, False):  # as torch's test: the second step's statistics
                shadow.zero_grad(set_to_none=True)
                _step(shadow, batch, loss_config)
                if first:
                    memory.reset_mod_stats()
            last = memory.get_tracker_snapshot("current")
        for stats in memory.memory_tracking.values():
            # torch's test's fix-up: ModTracker calls no post-backward hook on a
            # module whose inputs need no gradient (the embedding's).
            stats.snapshots.setdefault(_ModState.POST_BW, []).append(last)
        runtime = RuntimeEstimator()
        shadow.zero_grad(set_to_none=True)
        with runtime(estimate_mode_type=ESTIMATE_MODE):
            _step(shadow, batch, loss_config)
        sac = SACEstimator()
        shadow.zero_grad(set_to_none=True)
        with sac(estimate_mode_type=ESTIMATE_MODE):
            loss = _step(shadow, batch, loss_config, backward=False)
        loss.backward()
    return memory, runtime, sac, shadow


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def plan(model: nn.Module, shape: tuple[int, int], budget: float, loss_config: GRPOConfig) -> SacMilpPlan:
    """``sac_milp`` at ``budget`` GiB for the step at token shape (B, T) on ``model``.

    Raises:
        ValueError: no AC plan fits the budget.
    """
    from torch.distributed._tools.ilp_utils import aggregate_stats, get_peak_memory_runtime_baseline, parse_module_info
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module, sac_milp

    memory, runtime, sac, shadow = estimate(model, shape, loss_config)
    device = next(shadow.parameters()).device
    graph = parse_module_info(aggregate_stats(shadow, memory, runtime, sac, device))
    baseline, _ = get_peak_memory_runtime_baseline(graph)
    decisions, recompute_ms, peak = sac_milp(graph, memory_budget=budget, world_size=1)
    if peak == -1:  # sac_milp's "no solution"
        raise ValueError(f"{METHOD}: no AC plan fits {budget:.4g} GiB (without AC the step needs "
                         f"{baseline / 2**30:.4g} GiB, parameters included)")
    policies: dict[str, OpDecisions | None] = {}
    for fqn, discard in decisions.items():
        stats = sac.sac_mod_stats[fqn]
        saved = [] if discard >= FULL_DISCARD else get_optimal_checkpointing_policy_per_module(stats, 1 - discard)
        policies[fqn] = by_op_name(stats.func_names, saved) if saved else None
    return SacMilpPlan(budget_gib=budget, ac_decisions=dict(decisions), policies=policies,
                       recomputation_ms=float(recompute_ms), peak_bytes=int(peak), baseline_peak_bytes=int(baseline))


def by_op_name(func_names: Sequence[str], saved: Sequence[int]) -> OpDecisions:
    """Per-op decisions regrouped per op name, in call order: an op the compiled trace adds or
    drops (functionalized in-place ops) then shifts no other op's decision, as one counter over
    all ops (torch's prototype's ``_SACPolicy``) would."""
    grouped: dict[str, list[int]] = collections.defaultdict(list)
    for name, save in zip(func_names, saved, strict=True):
        grouped[name].append(int(save))
    return tuple((name, tuple(d)) for name, d in grouped.items())


def milp_policy(decisions: dict[str, tuple[int, ...]], counts: dict[tuple[bool, str], int], ctx: Any, op: Any,
                *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The SAC policy of one unit: save (``PREFER_SAVE``) or recompute (``MUST_RECOMPUTE``) the
    k-th call of each op as its decisions say, as torch's prototype's ``_SACPolicy`` does;
    the ops SAC ignores, and calls the estimate did not see, recompute."""
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

    if op in OPS_TO_ALWAYS_SKIP:
        return CheckpointPolicy.MUST_RECOMPUTE
    key = (ctx.is_recompute, op.overloadpacket.__name__)
    k, counts[key] = counts[key], counts[key] + 1
    saved = decisions.get(key[1], ())
    if k >= len(saved):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE if saved[k] else CheckpointPolicy.MUST_RECOMPUTE


def _milp_contexts(decisions: OpDecisions) -> tuple[Any, Any]:
    # Fresh counters per checkpointed call: the forward and each recompute count from the first op.
    return create_selective_checkpoint_contexts(
        functools.partial(milp_policy, dict(decisions), collections.defaultdict(int)))


def apply(model: nn.Module, policies: dict[str, OpDecisions | None]) -> nn.Module:
    """Checkpoint each unit of ``policies`` (keys: torch's FQNs) in ``model``, in place; the
    model to run (a wrapper where the root itself is a unit)."""
    root = type(model).__name__
    for fqn, decisions in policies.items():
        context_fn = None if decisions is None else functools.partial(_milp_contexts, decisions)
        name = fqn.removeprefix(root).removeprefix(".")
        if not name:
            return Checkpointed(model, context_fn)  # no nested units: the root is the only one
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, Checkpointed(owner.get_submodule(child), context_fn))
    return model


class SacMilpPolicy(nn.Module):
    """``model`` under ``sac-milp``: planned on the first call, at that batch's shape (as a
    dynamo backend plans at its example inputs), then compiled."""

    def __init__(self, model: nn.Module, budget: float, loss_config: GRPOConfig) -> None:
        super().__init__()
        self.model, self.budget, self.loss_config = model, budget, loss_config
        self.plan: SacMilpPlan | None = None
        self.compiled: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.compiled is None:
            self.plan = plan(self.model, tuple(input_ids.shape), self.budget, self.loss_config)
            self.compiled = torch.compile(apply(self.model, self.plan.policies))
        return self.compiled(input_ids)  # (B, T, V)

    def record(self) -> dict[str, Any]:
        """The plan, for the worker's record (empty before the first call)."""
        return {} if self.plan is None else {"sac_milp": self.plan.to_json()}


def prepare(model: nn.Module, hilore_budget: str, gc_peak_bytes: int | None,
            loss_config: GRPOConfig | None) -> SacMilpPolicy:
    """``model`` as ``sac-milp`` runs it, planned at ``hilore_budget`` on the first call.

    Raises:
        ValueError: not on CUDA, a module it needs is missing, or the budget is unusable.
    """
    params = list(model.parameters())
    if params[0].device.type != "cuda":
        raise ValueError(f"{METHOD} runs on CUDA only: {CUDA_ONLY}")
    missing = missing_modules()
    if missing:
        raise ValueError(f"{METHOD} needs {', '.join(missing)} (pip install {' '.join(missing)})")
    budget = budget_gib(hilore_budget, gc_peak_bytes, sum(p.numel() * p.element_size() for p in params))
    return SacMilpPolicy(model, budget, loss_config or GRPOConfig())
