"""verl's FSDP2 engine with the actor's decoder blocks compiled by the hilore backend.

verl (0.9) runs the actor update in ``FSDPEngine.forward_backward_batch``
(``verl/workers/engine/fsdp/transformer_impl.py``) and builds the engine named
by ``EngineRegistry`` for the model type and ``strategy``. Importing this module
(verl does it for ``actor_rollout_ref.model.external_lib=
hilore_compiler.integrations.verl``) registers ``HiLoReFSDPEngine`` in place of
``FSDPEngineWithLMHead``; it acts only where the engine config is a
``HiLoReFSDPEngineConfig`` with a ``hilore`` field (verl's ``_target_``
override), so the reference model and the critic run exactly as verl runs them.

With ``hilore`` set, the engine:

1. compiles each decoder block in place (``block.compile``: class and
   state-dict keys stay, so ``apply_fsdp2`` still finds and shards the blocks)
   with the hilore backend before FSDP2 wraps it, with the packed length
   symbolic: one graph per block whatever the micro-batch's token count, its
   plans re-solved when a longer one arrives (``backend/variants.py``); under
   ``use_dynamic_bsz`` planned for verl's token budget from the start
   (``planned_lengths``), so every rank runs the plans rank 0 made
   (``distributed/plan_share``);
2. turns HF gradient checkpointing off, with a warning, and refuses activation
   offload;
3. in ``forward_backward_batch``, where dropping is exact
   (``verl_packing.drop_is_exact``: ``ppo_loss`` with the vanilla policy
   loss, no KL loss, no entropy term, model outputs not returned, global
   normalisers), sets verl's normalisers over the whole batch, then leaves the
   zero-exposure samples out and packs the rest least exposed first under
   verl's own budget (``grpo.packing.drop_then_pack``: tokens per micro-batch
   with ``use_dynamic_bsz``, samples otherwise), so that a micro-batch holds
   one exposure bucket wherever the counts allow; every rank runs as many
   micro-batches as the busiest, and each runs under ``exposure(bucket)`` of
   its most exposed sample. Logged metrics are weighted to the whole batch
   (``verl_packing.honest_metrics``).
   Elsewhere (or with ``hilore_drop_zero=False``) it keeps verl's
   micro-batches, runs them least exposed first under the bucket of their
   most exposed sample, and skips whole zero-exposure micro-batches where
   ``skip_is_exact``, only in slots every data-parallel rank skips
   (``slots.schedule_slots``). ``forward_only`` passes run eagerly, as verl's.

Ordering needs no random numbers, so a run and its verl control draw the same
random stream.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from verl.utils.device import get_device_id
from verl.workers.config import FSDPEngineConfig
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from ..backend import BackendOptions, HiLoReBackend, exposure
from ..distributed.blocks import compile_blocks
from ..grpo import GRPOLossConfig, exposure_before_forward, exposure_buckets, plan_buckets
from ..grpo.buckets import ExposureBuckets
from ..grpo.packing import bucket_histograms, drop_then_pack
from ..vocabulary import ZERO_BUCKET
from .slots import microbatch_bucket, most_on_any_rank, schedule_slots
from .verl_packing import drop_is_exact, honest_metrics, pack_budget, response_tokens, skip_is_exact

#: ``torch.compile``'s ``dynamic`` for the blocks: None, as users compile. The
#: first packed length compiles static; at the second dynamo makes the packed
#: length symbolic (only it: ``dynamic=True`` would make FSDP2's unsharded
#: parameters' sizes symbolic too), and that one planned graph serves every
#: token count ``use_remove_padding`` / ``use_dynamic_bsz`` packs.
DYNAMIC_SHAPES = None
#: verl's ``loss_agg_mode`` -> the GRPO normalisation with the same token weights,
#: for exposure units; other modes are bucketed as token-mean (zero stays exact).
_AGG_TO_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


@dataclass
class HiLoReFSDPEngineConfig(FSDPEngineConfig):
    """``FSDPEngineConfig`` plus the hilore backend's options.

    Select it with verl's ``_target_`` override of the actor's ``fsdp_config``.
    """

    #: The hilore backend's options (``codecs``, ``buckets``, ``memory_budget``,
    #: ``plan``, ...), as ``torch.compile(options=...)``. None: verl's engine as is.
    hilore: Optional[dict[str, Any]] = None
    #: Run micro-batches least exposed first (the update is the same sum).
    hilore_exposure_order: bool = True
    #: Skip zero-exposure micro-batches where exact, on every rank together.
    hilore_skip_zero: bool = True
    #: Where exact (``verl_packing.drop_is_exact``), leave zero-exposure samples
    #: out before micro-batches are formed and pack the rest by exposure under
    #: verl's budget (``grpo.packing``); False: verl's micro-batches, whole ones skipped.
    hilore_drop_zero: bool = True


class HiLoReFSDPEngine(FSDPEngineWithLMHead):
    """``FSDPEngineWithLMHead`` whose decoder blocks are planned by hilore, per exposure bucket.

    Without ``engine_config.hilore`` every method is verl's own. With it,
    ``hilore_backends`` holds each block's backend (``.graphs``: what it
    compiled) and ``bucket_history`` one record per update: samples per
    bucket and micro-batches skipped on this rank.
    """

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any, checkpoint_config: Any):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        options = getattr(engine_config, "hilore", None)
        self.hilore_options: dict[str, Any] | None = None if options is None else dict(options)
        self.hilore_backends: list[HiLoReBackend] = []
        self.bucket_history: list[dict[str, Any]] = []
        if self.hilore_options is not None:
            self._refuse_what_hilore_cannot_run()
            # Parsed once here, so a wrong option fails before the model is built.
            self._n_buckets = BackendOptions.from_mapping(self.hilore_options).buckets

    def _refuse_what_hilore_cannot_run(self) -> None:
        cfg, model = self.engine_config, self.model_config
        if cfg.strategy != "fsdp2":
            raise ValueError(f"the hilore engine compiles blocks before FSDP2 wraps them: set "
                             f"strategy='fsdp2' (got {cfg.strategy!r}), or drop the hilore field")
        if model.enable_activation_offload:
            raise ValueError("enable_activation_offload moves the activations hilore plans to CPU behind its "
                             "back: set actor_rollout_ref.model.enable_activation_offload=False, and give hilore "
                             "a memory budget instead")
        if self.ulysses_sequence_parallel_size > 1:
            raise ValueError("the hilore engine does not support Ulysses sequence parallelism yet: its all-to-all "
                             "runs inside the attention of each compiled block; set "
                             "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1")
        if not self.use_remove_padding:
            raise ValueError("the hilore engine plans packed micro-batches: set "
                             "actor_rollout_ref.model.use_remove_padding=True")

    # -- building --------------------------------------------------------------

    def _build_module(self) -> torch.nn.Module:
        module = super()._build_module()
        if self.hilore_options is None or self.engine_config.forward_only:
            return module
        if self.model_config.enable_gradient_checkpointing:
            warnings.warn(
                "the hilore engine turns gradient checkpointing off: hilore decides per activation what to "
                "store, compress or recompute, and checkpointed blocks leave it almost nothing to plan. Set "
                "actor_rollout_ref.model.enable_gradient_checkpointing=False and a memory budget "
                "(fsdp_config.hilore.memory_budget, default 1.10x-gc) instead.", stacklevel=2)
            module.gradient_checkpointing_disable()
        options = planned_lengths(self.hilore_options, self.engine_config)
        self.hilore_backends = compile_blocks(module, options, dynamic=DYNAMIC_SHAPES, in_place=True)
        return module

    # -- the update --------------------------------------------------------------

    def forward_backward_batch(self, data: Any, loss_function: Callable, forward_only: bool = False) -> Any:
        if self.hilore_options is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        if forward_only:
            # Log-probs need no saved activations, so nothing to plan: run the
            # blocks eagerly, as verl does, rather than compile a no-grad graph per shape.
            with torch.compiler.set_stance("force_eager"):
                return super().forward_backward_batch(data, loss_function, forward_only)
        if self.engine_config.hilore_skip_zero and self.engine_config.hilore_drop_zero \
                and drop_is_exact(loss_function, data):
            return self._packed_update(data, loss_function)
        return self._planned_update(data, loss_function)

    def _planned_update(self, data: Any, loss_function: Callable) -> Any:
        """verl's micro-batch loop, in exposure order, with the zero skip (see the module docstring)."""
        import verl.utils.tensordict_utils as tu

        micro_batches, indices = self._micro_batches(data)
        samples, names = self._sample_buckets(micro_batches, data, _loss_agg_mode(loss_function))
        buckets = [microbatch_bucket(s, names) for s in samples]
        returns_outputs = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        schedule = schedule_slots(
            buckets, names, sort=self.engine_config.hilore_exposure_order,
            skip_zero=self.engine_config.hilore_skip_zero and not returns_outputs
            and skip_is_exact(loss_function),
            group=self.get_data_parallel_group(), device=get_device_id())
        outputs: list[dict[str, Any]] = [{"loss": 0.0, "metrics": {}} for _ in micro_batches]
        for k, i in enumerate(schedule.run):
            meta = self._run_micro_batch(micro_batches[i], loss_function, buckets[i], i,
                                         last=k == len(schedule.run) - 1)
            if not returns_outputs:
                meta.pop("model_output", None)
            outputs[i] = meta
        flat = [name for per_sample in samples for name in per_sample]
        ends = list(itertools.accumulate((len(per_sample) for per_sample in samples), initial=0))
        self._record(flat, names, [range(a, b) for a, b in zip(ends, ends[1:])], skipped=len(schedule.skipped))
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _packed_update(self, data: Any, loss_function: Callable) -> Any:
        """Zero-exposure samples dropped, the rest packed least exposed first under verl's budget.

        Every rank runs as many micro-batches as the busiest (FSDP's
        collectives pair up): a rank splits its own to get there, and where it
        has too few samples left it runs the shortest one with its loss times 0
        (a padding run, first, so the last run is real work where there is any).
        """
        import verl.utils.tensordict_utils as tu

        self._global_normalisers(data)
        exposures = microbatch_exposures(data, data, _loss_agg_mode(loss_function))  # (B_rank,)
        edges = self._edges(exposures)
        names, x = edges.assign(exposures), exposures.tolist()
        costs, budget = pack_budget(data)
        own = drop_then_pack(names, x, edges.names, budget=budget, costs=costs)
        n = most_on_any_rank(max(1, len(own.microbatches)), self.get_data_parallel_group(), get_device_id())
        packing = drop_then_pack(names, x, edges.names, budget=budget, costs=costs, at_least=n)
        tokens = response_tokens(data).double()  # (B_rank,)
        shortest = int(torch.argmin(tokens if costs is None else torch.tensor(costs)))
        pads = n - len(packing.microbatches)
        slots = [((shortest,), ZERO_BUCKET, True)] * pads + [
            (rows, bucket, False) for rows, bucket in zip(packing.microbatches, packing.buckets)]
        outputs = []
        for k, (rows, bucket, pad) in enumerate(slots):
            micro_batch = tu.index_select_tensor_dict(data, list(rows))
            meta = self._run_micro_batch(micro_batch, loss_function, bucket, k, last=k == n - 1, pad=pad)
            meta.pop("model_output", None)  # not returned (drop_is_exact): do not keep it alive
            share = 0.0 if pad else float(tokens[list(rows)].sum()) * n / max(float(tokens.sum()), 1.0)
            meta["metrics"] = honest_metrics(meta.get("metrics", {}), share)
            outputs.append(meta)
        self._record(names, edges.names, packing.microbatches, skipped=0, dropped=len(packing.dropped), pads=pads)
        return postprocess_batch_func(output_lst=outputs, indices=None, data=data)

    def _run_micro_batch(self, micro_batch: Any, loss_function: Callable, bucket: str, k: int, *,
                         last: bool, pad: bool = False) -> dict[str, Any]:
        """verl's forward_step and backward of one micro-batch under ``exposure(bucket)``; its meta."""
        with self._gradient_sync_context(is_last_micro_batch=last), exposure(bucket), \
                torch.profiler.record_function(f"micro_batch{k}"):
            loss, meta = self.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
            if pad:  # runs only so that the collectives pair up: adds exactly nothing
                loss = loss * 0.0
            if self.scaler is not None:  # fp16 parameters: verl's loss scaling
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        return meta

    def _global_normalisers(self, data: Any) -> None:
        """verl's own: the global response-token count and the dp size, on ``data`` (over the whole batch)."""
        import verl.utils.tensordict_utils as tu

        tu.assign_non_tensor(data, sp_size=self.ulysses_sequence_parallel_size)
        tokens = data["loss_mask"].sum().to(get_device_id())
        torch.distributed.all_reduce(tokens, op=torch.distributed.ReduceOp.SUM, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

    def _micro_batches(self, data: Any) -> tuple[list[Any], Any]:
        """verl's own preparation: global token count, dp size, then its micro-batches."""
        self._global_normalisers(data)
        return prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True)

    def _edges(self, exposures: torch.Tensor) -> ExposureBuckets:
        """The plan's buckets in the units of this rank's exposures (B_rank,); before a plan, their quantiles."""
        plan = next((g.plan for b in self.hilore_backends for g in b.graphs if g.plan is not None), None)
        if plan is not None:
            return plan_buckets(plan, int(exposures.numel()))
        return exposure_buckets(exposures, self._n_buckets)

    def _sample_buckets(self, micro_batches: list[Any], data: Any,
                        loss_agg_mode: str) -> tuple[list[list[str]], tuple[str, ...]]:
        """Per micro-batch, the bucket of each of its samples (in the plan's units); the bucket names."""
        exposures = [microbatch_exposures(mb, data, loss_agg_mode) for mb in micro_batches]
        edges = self._edges(torch.cat(exposures))
        return [edges.assign(x) for x in exposures], edges.names

    def _record(self, names: list[str], order: tuple[str, ...], microbatches: Any, *, skipped: int,
                dropped: int = 0, pads: int = 0) -> None:
        """This update's samples per bucket, micro-batches skipped, samples dropped, per-micro-batch buckets."""
        counts = {name: names.count(name) for name in order}
        self.bucket_history.append({**counts, "skipped_microbatches": skipped, "dropped_samples": dropped,
                                    "padding_microbatches": pads,
                                    "microbatch_buckets": bucket_histograms(names, microbatches)})


def planned_lengths(options: Mapping[str, Any], engine_config: Any) -> dict[str, Any]:
    """The hilore options with verl's token budget as the lengths to plan for, unless given.

    Under ``use_dynamic_bsz`` a packed micro-batch holds at most
    ``max_token_len_per_gpu`` tokens (a longer sample alone excepted, which
    is planned all the same, with a warning), so zero-config plans are made
    for 1 to that many tokens from the start: no re-solve as lengths creep
    up, and every rank plans the one range, so every rank runs rank 0's
    plans (``distributed/plan_share``) rather than re-solving its trace for
    lengths of its own. Left as they are where the user set either bound or
    gave a plan.
    """
    options = dict(options)
    budget = getattr(engine_config, "max_token_len_per_gpu", None)
    given = {"plan", "max_seq_len", "min_seq_len"} & {k for k, v in options.items() if v is not None}
    if given or not getattr(engine_config, "use_dynamic_bsz", False) or not budget:
        return options
    return {**options, "min_seq_len": 1, "max_seq_len": int(budget)}


def _loss_agg_mode(loss_function: Callable | None) -> str:
    """The loss's ``loss_agg_mode`` where it is verl's ``ppo_loss``; token-mean (verl's default) otherwise."""
    config = getattr(loss_function, "keywords", {}).get("config") if loss_function is not None else None
    return str(getattr(config, "loss_agg_mode", "token-mean"))


def _padded(x: torch.Tensor) -> torch.Tensor:
    """(B, T) dense from a jagged nested tensor (padding 0) or a dense one."""
    return torch.nested.to_padded_tensor(x, 0.0) if x.is_nested else x


def microbatch_exposures(micro_batch: Mapping[str, Any], data: Mapping[str, Any],
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """(B_mb,) on-policy exposure of each sample of a micro-batch, under verl's global normalisers.

    verl's ``token-mean`` divides by the global response-token count times
    ``1 / dp_size`` (the ``dapo`` weights with this rank's share of the
    tokens); ``seq-mean-token-mean`` by the sequences (``grpo``). Exactly zero
    where every advantage under the response mask is zero.
    """
    import verl.utils.tensordict_utils as tu

    adv = _padded(micro_batch["advantages"]).to(torch.float64)  # (B, R)
    mask = _padded(micro_batch["response_mask"]).to(torch.float64)  # (B, R)
    dp = float(tu.get_non_tensor_data(data=data, key="dp_size", default=1))
    global_batch = tu.get_non_tensor_data(data=data, key="global_batch_size", default=None)
    n_seq = int(round(float(global_batch) / dp)) if global_batch is not None else adv.shape[0]
    tokens = float(tu.get_non_tensor_data(data=data, key="batch_num_tokens", default=mask.sum().item()))
    config = GRPOLossConfig(loss_type=_AGG_TO_LOSS_TYPE.get(loss_agg_mode, "dapo"))
    return exposure_before_forward(adv, mask, config, num_sequences=n_seq, num_tokens=tokens / dp)


def _skip_verls_trl_value_head_patch() -> None:
    """Let verl build models next to trl 1.x, which this package's ``trl`` extra installs.

    verl 0.9.1's ``apply_monkey_patch`` imports trl's
    ``AutoModelForCausalLMWithValueHead`` whenever trl is installed, to patch
    that class's ``state_dict``; trl 1.x no longer has it, so every model
    build fails. With such a trl, verl is told trl is absent: the patch
    touched only that class, which then does not exist.
    """
    import importlib

    import verl.models.transformers.monkey_patch as verl_patch

    if not verl_patch.is_trl_available():
        return
    for where in ("trl.experimental.ppo", "trl"):  # where verl looks, in its order
        try:
            with warnings.catch_warnings():  # trl warns on any import from trl.experimental
                warnings.simplefilter("ignore")
                if hasattr(importlib.import_module(where), "AutoModelForCausalLMWithValueHead"):
                    return
        except ImportError:
            continue
    verl_patch.is_trl_available = lambda: False


def register() -> None:
    """Make verl build ``HiLoReFSDPEngine`` wherever it would build ``FSDPEngineWithLMHead``."""
    table = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        for key, cls in list(table.get(backend, {}).items()):
            if cls is FSDPEngineWithLMHead:
                table[backend][key] = HiLoReFSDPEngine


_skip_verls_trl_value_head_patch()
register()

__all__ = ["DYNAMIC_SHAPES", "HiLoReFSDPEngine", "HiLoReFSDPEngineConfig", "microbatch_exposures",
           "planned_lengths", "register", "skip_is_exact"]
