"""TRL's ``GRPOTrainer`` with its actor update compiled by the hilore backend.

``HiLoReGRPOTrainer`` changes four things and leaves the rest to TRL:

1. Only the backbone of the training forward (the one whose log-probs get a
   gradient) runs through ``torch.compile(backend=HiLoReBackend(options))``.
   Generation and the old / reference log-probs run as TRL runs them, and so
   does TRL's fused, chunked LM head on top of the backbone.
2. TRL's gradient checkpointing is turned off: checkpointed layers leave the
   planner almost nothing to decide, and the hooks TRL adds when it toggles
   checkpointing around generation recompile the graph every round.
3. Each generation batch is padded to fixed shapes, its samples are grouped
   into microbatches by exposure bucket (where that keeps the update exact),
   each microbatch runs under ``hilore_compiler.exposure(bucket)``, and
   zero-exposure samples skip forward and backward where that is exact: with
   ``dapo`` they are dropped before the rest is packed
   (``grpo.packing.drop_then_pack``, the rule of ``actor_update`` and verl's
   engine); with ``grpo`` / ``dr_grpo`` (normalised per microbatch row)
   whole all-zero microbatches are skipped. Ranks skip the same slots.
   TRL's per-microbatch means (clip ratios, entropy) then average over the
   microbatches that ran, dropped tokens left out; the loss is TRL's.
4. Loss variants without closed-form token coefficients are refused
   (``GRPOLossConfig.from_trl``).

Per step TRL's log gains ``hilore/bucket_<name>`` (samples per bucket) and
``hilore/skipped_samples``; ``bucket_history`` keeps the same per generation.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from ..backend import HiLoReBackend, exposure
from ..grpo import (
    ExposureBuckets,
    GRPOLossConfig,
    exposure_before_forward,
    exposure_buckets,
    plan_buckets,
)
from ..grpo.packing import drop_then_pack
from .batching import Slot, dropped_slots, equal_slots, pad_batch, take_rows

#: Keys the trainer adds to each prepared microbatch (TRL ignores them): its
#: bucket, whether it may be skipped, and the samples it accounts for that do not run.
BUCKET_KEY, SKIP_KEY, SIZE_KEY = "hilore_bucket", "hilore_skip", "hilore_samples"
#: Batch keys of vision-language inputs, whose rows are not one per sample.
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "num_tiles", "spatial_shapes")
#: Loss types whose update does not depend on how samples are grouped into
#: microbatches of equal size (``bnpo`` normalises by each microbatch's tokens).
_ORDER_EXACT = ("grpo", "dapo", "dr_grpo")
#: Loss types whose normaliser is the generation batch's (``dapo``: its tokens),
#: so a microbatch may hold fewer rows: zero samples are dropped, not only
#: skipped in whole all-zero microbatches (``grpo`` and ``dr_grpo`` divide by
#: the microbatch's rows, so there every microbatch keeps TRL's size).
_DROP_EXACT = ("dapo",)


class _Prepared(dict):
    """A microbatch that ``_prepare_inputs`` already made; passed through unchanged."""


class HiLoReGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose training forward is planned by hilore, per exposure bucket.

    Takes ``GRPOTrainer``'s arguments plus:

    - ``hilore_options``: the backend's options (``codecs``, ``buckets``,
      ``memory_budget``, ``plan``, ...), as ``torch.compile(options=...)``.
    - ``exposure_order``: group samples by bucket inside one optimizer step
      instead of keeping TRL's shuffled order (True; TRL's shuffle still runs
      first, so the random stream is TRL's). Applied only where exact: ``grpo``, ``dapo``
      and ``dr_grpo`` with ``steps_per_generation == gradient_accumulation_steps``.
      For ``bnpo`` it is applied with a warning (see ``_choose_order``).
    - ``skip_zero``: skip microbatches whose samples all have zero exposure,
      where exact (``beta == 0``, no MoE aux loss, DDP or one process) (True).
    - ``pad_to_multiple_of``: prompt and completion lengths are rounded up to
      this (8). Not needed to stay planned: from the second length on the
      backbone's graph is dynamic and its plans hold over the lengths met
      (re-solved when a longer batch arrives); padding only makes those
      lengths, and so the re-solves, fewer. 1 pads nothing.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Any = None,
        *rest: Any,
        hilore_options: Mapping[str, Any] | None = None,
        exposure_order: bool = True,
        skip_zero: bool = True,
        pad_to_multiple_of: int = 8,
        **kwargs: Any,
    ):
        if args is None:
            raise ValueError("HiLoReGRPOTrainer needs args=trl.GRPOConfig(...)")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.loss_config = GRPOLossConfig.from_trl(args)  # refuses what has no closed form
        _turn_off_checkpointing(args, model)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.hilore_backend = HiLoReBackend(hilore_options)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.exposure_order = self._choose_order(exposure_order)
        self.skip_zero = skip_zero and self._skip_is_exact()
        self.bucket_history: list[dict[str, int]] = []
        self._compiled: dict[int, nn.Module] = {}
        self._skipped_this_step = 0

    # -- decisions made once ------------------------------------------------

    def _choose_order(self, wanted: bool) -> bool:
        """Whether to group samples by bucket; warns where it cannot or where it changes the update."""
        if not wanted:
            return False
        args = self.args
        if args.steps_per_generation != args.gradient_accumulation_steps:
            warnings.warn(
                f"HiLoReGRPOTrainer keeps TRL's shuffled order: steps_per_generation "
                f"({args.steps_per_generation}) != gradient_accumulation_steps "
                f"({args.gradient_accumulation_steps}), so one generation batch spans several "
                "optimizer steps and grouping by bucket would move samples between them.",
                stacklevel=3,
            )
            return False
        if self.loss_type not in _ORDER_EXACT:
            warnings.warn(
                "loss_type='bnpo' normalises each microbatch by its own token count, so grouping "
                "samples by exposure bucket changes which tokens share a normaliser: zero-advantage "
                "samples no longer dilute the others, and a microbatch of short completions weighs "
                "each token more. The update stays a bnpo update of the same samples, not the one a "
                "shuffled order gives; pass exposure_order=False to keep TRL's order.",
                stacklevel=3,
            )
        return True

    def _skip_is_exact(self) -> bool:
        """Zero-exposure samples have zero gradient and zero loss only without extra terms."""
        distributed = str(self.accelerator.distributed_type).rsplit(".", 1)[-1]
        return (
            self.beta == 0.0
            and not self.aux_loss_enabled
            and not self._entropy_bonus_enabled
            # DeepSpeed / FSDP run collectives inside every backward: all ranks
            # skipping together is not enough there.
            and distributed in ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU")
        )

    # -- the generation batch -----------------------------------------------

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        if isinstance(generation_batch, _Prepared):  # training_step prepared it already
            return generation_batch
        if not self.model.training:  # evaluation: TRL's way, uncompiled
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = self._microbatches(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _microbatches(self, batch: dict[str, Any]) -> list[_Prepared]:
        """Pad, bucket, order and cut one generation batch; record its histogram."""
        if any(batch.get(k) is not None for k in _MULTIMODAL_KEYS):
            raise NotImplementedError("HiLoReGRPOTrainer supports text-only models for now")
        batch = pad_batch(batch, self._pad_token_id(), self.pad_to_multiple_of)
        # TRL's own shuffle, always: it draws from the global random stream, and
        # skipping it would make every later generation sample other completions
        # than TRL's from the same seed, so a run and its GRPOTrainer control
        # would part. The exposure order below is a stable sort of the shuffled rows.
        batch = shuffle_sequence_dict(batch)
        n = self.args.steps_per_generation
        exposures = self._exposures(batch)  # (B,)
        buckets = self._buckets(batch, exposures)
        names = buckets.assign(exposures)
        self._record(Counter(names), buckets.names)
        if self.exposure_order and self.skip_zero and self.loss_type in _DROP_EXACT:
            slots = self._dropped_slots(names, exposures, buckets.names, n)
        else:
            slots = equal_slots(names, exposures, buckets.names, n, sort=self.exposure_order)
            skip = self._on_every_rank(tuple(s.all_zero for s in slots))
            slots = [Slot(s.rows, s.bucket, k and self.skip_zero, len(s.rows) if k and self.skip_zero else 0)
                     for s, k in zip(slots, skip)]
        return [_Prepared(take_rows(batch, s.rows), **{BUCKET_KEY: s.bucket, SKIP_KEY: s.all_zero,
                                                       SIZE_KEY: s.left_out}) for s in slots]

    def _dropped_slots(self, names: list[str], exposures: torch.Tensor, order: tuple[str, ...],
                       n: int) -> list[Slot]:
        """Zero samples dropped, the rest packed least exposed first, ``per_device_train_batch_size`` at most.

        Every rank runs as many microbatches as the busiest (they skip the same
        slots), splitting its own or running single dropped samples to get there.
        """
        x = exposures.detach().to("cpu", torch.float64).tolist()
        size = self.args.per_device_train_batch_size
        own = drop_then_pack(names, x, order, budget=size)
        runs = self._most_on_any_rank(max(1, len(own.microbatches)))
        return dropped_slots(drop_then_pack(names, x, order, budget=size, at_least=runs), n, runs)

    def _exposures(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """(B,) on-policy exposure of each sample under TRL's normalisation of one optimizer step."""
        mask = batch["completion_mask"]
        if batch.get("tool_mask") is not None:
            mask = mask * batch["tool_mask"]
        n_seq = mask.shape[0]  # grpo / dr_grpo: each sequence weighs 1 / (local generation batch)
        if self.loss_type == "dapo":
            n_tok = float(batch["num_items_in_batch"]) / self.accelerator.num_processes
        else:  # bnpo: about the local batch's tokens (its microbatches are not formed yet)
            n_tok = float(mask.sum().clamp(min=1))
        return exposure_before_forward(
            batch["advantages"], mask, self.loss_config, num_sequences=n_seq, num_tokens=n_tok,
            old_logprobs=batch.get("old_per_token_logps"), ref_logprobs=batch.get("ref_per_token_logps"),
        )

    def _buckets(self, batch: Mapping[str, Any], exposures: torch.Tensor) -> ExposureBuckets:
        """The plan's buckets in this batch's units; the plan is made by compiling now if need be."""
        if not self._compiled:  # first generation: compile once, so that the plan exists
            self._compile_now(batch)
            if not self.hilore_backend.graphs:
                warnings.warn(
                    "the hilore backend compiled nothing for the training forward: dynamo reused a "
                    "graph compiled earlier in this process (by another trainer's backend); call "
                    "torch._dynamo.reset() before building a second trainer",
                    stacklevel=2,
                )
        plan = next((g.plan for g in self.hilore_backend.graphs if g.plan is not None), None)
        if plan is not None:
            return plan_buckets(plan, exposures.shape[0])
        # No graph could be planned (the backend fell back to Inductor): the
        # batch's own quantiles, so that microbatches are still grouped.
        return exposure_buckets(exposures, self.hilore_backend.options.buckets)

    def _compile_now(self, batch: Mapping[str, Any]) -> None:
        """One training-shaped forward (no backward), so that the plan and its buckets exist."""
        rows = slice(0, self.args.per_device_train_batch_size)
        ids = torch.cat([batch["prompt_ids"][rows], batch["completion_ids"][rows]], dim=1)
        mask = torch.cat([batch["prompt_mask"][rows], batch["completion_mask"][rows]], dim=1)
        with torch.enable_grad(), self._compiled_backbone(self.model):
            self._get_per_token_logps_and_entropies(
                self.model, ids, mask, batch["completion_ids"].shape[1], compute_entropy=True
            )

    def _most_on_any_rank(self, count: int) -> int:
        """The largest ``count`` over the processes."""
        if self.accelerator.num_processes == 1:
            return count
        return int(self.accelerator.gather(torch.tensor([count], device=self.accelerator.device)).max())

    def _on_every_rank(self, flags: tuple[bool, ...]) -> tuple[bool, ...]:
        """Flags that hold on every process: a microbatch is skipped everywhere or nowhere."""
        if self.accelerator.num_processes == 1:
            return flags
        local = torch.tensor([int(f) for f in flags], device=self.accelerator.device)
        gathered = self.accelerator.gather(local).view(self.accelerator.num_processes, -1)
        return tuple(bool(v) for v in gathered.all(dim=0).tolist())

    def _record(self, counts: Counter, names: tuple[str, ...]) -> None:
        histogram = {name: int(counts.get(name, 0)) for name in names}
        self.bucket_history.append(histogram)
        for name, count in histogram.items():
            self._metrics["train"][f"hilore/bucket_{name}"].append(float(count))

    def _pad_token_id(self) -> int:
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        return int(tok.pad_token_id)

    # -- one microbatch -----------------------------------------------------

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        start = time.perf_counter()
        prepared = self._prepare_inputs(inputs)
        # TRL times generation inside its training_step; it happens here now.
        self._current_train_step_time += time.perf_counter() - start
        # The optimizer-step's last microbatch synchronises gradients across
        # ranks and makes sure every parameter has a .grad: never skip it.
        if isinstance(prepared, _Prepared):
            self._skipped_this_step += prepared[SIZE_KEY]
            if prepared[SKIP_KEY] and not self.accelerator.sync_gradients:
                self._step += 1  # what GRPOTrainer.training_step counts, for _prepare_inputs
                return torch.zeros((), device=self.accelerator.device)  # the loss of these samples is 0
        if self.accelerator.sync_gradients:
            self._metrics["train"]["hilore/skipped_samples"].append(float(self._skipped_this_step))
            self._skipped_this_step = 0
        return super().training_step(model, prepared, num_items_in_batch)

    def compute_loss(self, model: nn.Module, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        if not (model.training and isinstance(inputs, _Prepared)):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        with exposure(inputs[BUCKET_KEY]), self._compiled_backbone(model):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    @contextlib.contextmanager
    def _compiled_backbone(self, model: nn.Module) -> Iterator[None]:
        """Inside: the model's backbone attribute is its hilore-compiled twin.

        TRL's fused LM head looks the backbone up on every call
        (``model.base_model``), so swapping the submodule for the length of
        one loss computation routes exactly the training forward through the
        backend. Parameters are the same objects; nothing else sees the swap.
        """
        target = self.accelerator.unwrap_model(model)
        if hasattr(target, "get_base_model"):  # PEFT: TRL patched the base model's forward
            target = target.get_base_model()
        prefix = target.base_model_prefix
        backbone = target._modules[prefix]
        compiled = self._compiled.get(id(backbone))
        if compiled is None:
            # dynamic=None, as users compile: static at the first length, then one
            # dynamic graph whose plans hold over every length (no recompile per length).
            compiled = torch.compile(backbone, backend=self.hilore_backend)
            self._compiled = {id(backbone): compiled}
        target._modules[prefix] = compiled
        try:
            yield
        finally:
            target._modules[prefix] = backbone


def _turn_off_checkpointing(args: Any, model: Any) -> None:
    """Switch TRL's (and the model's) gradient checkpointing off, saying why."""
    on = any(getattr(args, name, False) for name in ("activation_checkpointing", "gradient_checkpointing"))
    # transformers 5 renamed gradient_* to activation_*; 4.x has only the old names.
    new_names = hasattr(model, "is_activation_checkpointing")
    flag = "is_activation_checkpointing" if new_names else "is_gradient_checkpointing"
    on_model = bool(getattr(model, flag, False))
    if not (on or on_model):
        return
    warnings.warn(
        "HiLoReGRPOTrainer turns gradient checkpointing off: hilore decides per activation what to "
        "store, compress or recompute, checkpointed layers leave it almost nothing to plan, and the "
        "hooks TRL adds when it toggles checkpointing around generation recompile the graph every "
        "round. Set a memory budget instead: hilore_options={'memory_budget': '1.10x-gc'}.",
        stacklevel=3,
    )
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, False)
    if on_model:
        model.activation_checkpointing_disable() if new_names else model.gradient_checkpointing_disable()


__all__ = ["BUCKET_KEY", "SKIP_KEY", "HiLoReGRPOTrainer"]
