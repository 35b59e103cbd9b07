"""The step's memory besides the trace's activations, and where a peak falls.

``memory.py`` models a plan's peak as kept bytes plus the most the step
holds at once besides them; this module holds the parts the trace's units do
not: the graph's outputs and the loss's own peak, each backward segment's
gradient workspace (the widest activation's gradient, or a weight's partial
gradient, and the gradient flowing between layers), the weights' gradients
made so far, the segments whose kept bytes backward has already freed
(``StepTerms``), and the parts of the worst moment (``PeakParts``).
"""

from __future__ import annotations

import dataclasses

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ..tracefile import TIED_PARTIALS, Trace, eval_size, parse_size
from ..vocabulary import group_of

if TYPE_CHECKING:
    from .memory import UnitCost


#: ``StepTerms.freed``'s name for the end of backward, where every layer segment is done.
END: Final = "end"


@functools.lru_cache(maxsize=4096)
def size_at(expr: str, batch: int, seq_len: int) -> int:
    """A trace's size expression at (batch, seq_len); cached because a trace repeats few distinct ones."""
    return eval_size(parse_size(expr), batch, seq_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTerms:
    """The step's memory besides the trace's activations, at the planned shape (module docstring)."""

    #: The graph's outputs, which the caller holds until backward is done.
    output_bytes: int = 0
    #: The outputs' gradient once the head's backward (``outside``, met
    #: first) is done: backward frees it there, unless a tied weight's
    #: gradient (an lm_head tied to the embedding) is summed at the end of
    #: backward, where Inductor also makes the head's partial from it.
    #: Measured on Qwen2.5-0.5B's widths (4 layers, 1 x 512, fp32): untied,
    #: store-all's peak is 1651.3 MB, a logits' worth (311 MB) under outputs
    #: + gradient + weight gradients; tied, 1953.0 MB, that sum plus the
    #: second partial. With LoRA (the tied embedding frozen) Qwen2.5-0.5B
    #: and Qwen2.5-3B measured store-all and GC within 0.2% of this; counted
    #: alive, they were 22% over.
    output_grad_bytes: int = 0
    #: A tied weight's second partial gradient (``tracefile.TIED_PARTIALS``),
    #: alive beside the first when backward sums them, last.
    tied_partial_bytes: int = 0
    #: The loss's own peak beyond the outputs (0: the loss is not known).
    loss_bytes: int = 0
    #: Per segment (``group_of``): the gradient workspace its backward holds.
    #: A recompute workspace is freed before backward's gradients of the
    #: segment are made, so the two never add: the segment holds the larger.
    gradient_bytes: Mapping[str, int] = field(default_factory=dict)
    #: The end of backward: outputs and their gradient, every weight's
    #: gradient (the embedding's, made last, included), and a second partial
    #: of each weight read in two segments (a tied embedding) beside it.
    end_bytes: int = 0
    #: Per segment: the weights' gradients alive in its backward: those this
    #: backward made so far (its own and those of every segment backward meets
    #: before it), plus ``held_gradient_bytes``. A compiled backward returns
    #: its new gradients only at its end, so they are alive beside the
    #: accumulated ``.grad`` until then.
    weight_gradient_bytes: Mapping[str, int] = field(default_factory=dict)
    #: Weight gradients alive from the step's start: every weight's when the
    #: update accumulates gradients over microbatches (the earlier
    #: microbatches made them), else 0.
    held_gradient_bytes: int = 0
    #: Per segment: the layer segments backward has finished before it. Their
    #: kept bytes are freed by then: backward releases a saved activation
    #: after its last use (autograd's saved tensors; Inductor's backward
    #: frees its inputs as it goes), and no later segment reads a layer's
    #: units. ``outside`` holds the head's units and those read last (the
    #: embedding's side), so it is never counted freed.
    passed: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def eager(self) -> StepTerms:
        """The same step run by eager autograd rather than a compiled backward.

        The two differ where a weight is tied (an lm_head tied to the
        embedding): eager autograd frees the outputs' gradient after the
        head's backward, as for any weight, and sums the two partials out of
        place at the end (the first, the second and their sum alive at
        once), where the compiled backward keeps the outputs' gradient to
        make the head's partial there. Eager GC measured 219.3 and 219.1 MiB
        over compiled GC on Qwen2.5-0.5B (tied, 4 and 24 layers, 1 x 512):
        the tied weight's 519.3 MiB less the logits' 296.8.
        """
        return dataclasses.replace(self, output_grad_bytes=0,
                                   end_bytes=self.end_bytes - self.output_grad_bytes + self.tied_partial_bytes)

    @property
    def backward_bytes(self) -> dict[str, int]:
        """Per segment: what its backward holds besides kept and rebuilt bytes
        with no recompute workspace: the outputs and their gradient, the
        gradient workspace and the weights' gradients."""
        return {g: self.recovering(g, 0) for g in self.gradient_bytes}

    @property
    def layer_segments(self) -> tuple[str, ...]:
        """The segments whose kept bytes are freed by the end of backward: every one but ``outside``."""
        return tuple(g for g in self.gradient_bytes if g != "outside")

    def freed(self, segment: str, kept: Mapping[str, int]) -> int:
        """Kept bytes backward has freed when it reaches ``segment`` (``END``:
        the end of backward), with ``kept``: a plan's kept bytes per segment."""
        done = self.layer_segments if segment == END else self.passed.get(segment, ())
        return sum(kept.get(g, 0) for g in done)

    def outputs_in(self, segment: str) -> int:
        """The outputs and what is alive of their gradient in the backward of ``segment`` (``END``: its end)."""
        return self.output_bytes + (self.output_bytes if segment == "outside" else self.output_grad_bytes)

    def recovering(self, segment: str, workspace: int) -> int:
        """What the backward of ``segment`` holds besides kept and rebuilt bytes
        while a recompute ``workspace`` is alive."""
        return (self.outputs_in(segment) + self.weight_gradient_bytes.get(segment, 0)
                + max(workspace, self.gradient_bytes.get(segment, 0)))

    def floor(self, kept: Mapping[str, int] | None = None) -> int:
        """The least the step adds to kept bytes, whatever is rebuilt, for a
        plan keeping ``kept`` bytes per segment (None: none freed)."""
        return max(p.total for p in self.phases(kept))

    @property
    def loss_phase_bytes(self) -> int:
        """What the loss's forward and backward hold besides kept bytes."""
        return self.output_bytes + self.loss_bytes + self.held_gradient_bytes

    def phases(self, kept: Mapping[str, int] | None = None) -> list[PeakParts]:
        """What the step holds besides kept bytes in each phase with nothing
        rebuilt (``floor``'s parts), for a plan keeping ``kept`` bytes per segment."""
        kept = kept or {}
        return [PeakParts(at="loss", outputs=self.output_bytes + self.loss_bytes,
                          weight_gradients=self.held_gradient_bytes),
                PeakParts(at="end of backward", outputs=self.outputs_in(END),
                          weight_gradients=self.end_bytes - self.outputs_in(END), freed=self.freed(END, kept)),
                *(self.segment(g, freed=self.freed(g, kept)) for g in self.gradient_bytes)]

    def segment(self, segment: str, *, rebuilt: int = 0, workspace: int = 0, freed: int = 0) -> PeakParts:
        """What the backward of ``segment`` holds besides kept bytes, with
        ``rebuilt`` bytes of units and a recompute ``workspace`` alive and
        ``freed`` kept bytes already released (``StepTerms.freed``)."""
        return PeakParts(at=f"backward of {segment}", rebuilt=rebuilt,
                         workspace=max(workspace, self.gradient_bytes.get(segment, 0)),
                         weight_gradients=self.weight_gradient_bytes.get(segment, 0),
                         outputs=self.outputs_in(segment), freed=freed)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeakParts:
    """Where a plan's predicted peak falls, and what is alive there besides kept bytes."""

    #: ``"loss"``, ``"end of backward"`` or ``"backward of <segment>"``.
    at: str
    #: Recomputed or decoded units alive there.
    rebuilt: int = 0
    #: The larger of the recompute workspace and the gradient workspace (the
    #: widest activation's gradient or a weight's partial gradient, and the
    #: gradient flowing between layers).
    workspace: int = 0
    #: The weights' gradients made so far.
    weight_gradients: int = 0
    #: The graph's outputs and their gradient, or the outputs and the loss's own peak.
    outputs: int = 0
    #: Kept bytes backward has already freed there (segments it has finished);
    #: subtracted, so ``total`` is what the step holds beyond the plan's kept bytes.
    freed: int = 0

    @property
    def total(self) -> int:
        return self.rebuilt + self.workspace + self.weight_gradients + self.outputs - self.freed


def step_terms(trace: Trace, segments: Mapping[str, Sequence[UnitCost]], *, batch: int, seq_len: int,
               flowing: int, loss_ratio: float, accumulate_gradients: bool = False) -> StepTerms:
    """The step's terms at (batch, seq_len) (module docstring); ``flowing``: the
    bytes of the gradient passed between layers; ``accumulate_gradients``: the
    step is a microbatch of an update that sums gradients over several, so
    every weight's gradient is alive from its start, beside the new ones."""
    outputs = size_at(trace.output_bytes, batch, seq_len)
    grads = trace.param_bytes
    held = sum(grads.values()) if accumulate_gradients else 0
    layers = sorted(us[0].layer for g, us in segments.items() if g != "outside")
    gradient: dict[str, int] = {}
    weights: dict[str, int] = {}
    passed: dict[str, tuple[str, ...]] = {}
    for g, us in segments.items():
        # Backward meets the head (outside) first, then the layers from the last one.
        so_far = grads.get("outside", 0)
        passed[g] = ()
        if g != "outside":
            so_far += sum(grads.get(group_of(i), 0) for i in layers if i >= us[0].layer)
            passed[g] = tuple(group_of(i) for i in layers if i > us[0].layer)
        # The widest activation's gradient, or a partial gradient of a weight
        # several ops read (a chunked lm_head's, made from the chunk's logits'
        # gradient once the rebuilt logits are consumed).
        gradient[g] = max([*(u.bytes for u in us), trace.partial_grad_bytes.get(g, 0)]) + flowing
        weights[g] = held + so_far
    # A tied weight's partials are both alive when backward sums them, last,
    # and the outputs' gradient with them (``StepTerms.output_grad_bytes``).
    tied = trace.partial_grad_bytes.get(TIED_PARTIALS, 0)
    output_grad = outputs if tied else 0
    end = outputs + output_grad + held + sum(grads.values()) + tied
    return StepTerms(output_bytes=outputs, output_grad_bytes=output_grad, tied_partial_bytes=tied,
                     loss_bytes=round(loss_ratio * outputs),
                     gradient_bytes=gradient,
                     end_bytes=end, weight_gradient_bytes=weights, held_gradient_bytes=held, passed=passed)


def gc_worst(rebuilt: Mapping[str, tuple[int, int]], step: StepTerms, kept: Mapping[str, int]) -> int:
    """What GC's step holds at its worst moment besides its kept bytes (``kept``
    per segment): the loss, the end of backward, or a layer's backward with
    that layer rebuilt (``rebuilt``: ``memory.gc_parts``).

    The whole layer is alive at once: GC recomputes every unit of it, so each
    is rebuilt with its recomputed readers, back to the layer's first cut
    (``rebuilt_from``)."""
    # A rebuilt layer's phase only adds to the same phase with nothing rebuilt (``phases``).
    return max([*(p.total for p in step.phases(kept)),
                *(step.segment(g, rebuilt=held, workspace=workspace, freed=step.freed(g, kept)).total
                  for g, (held, workspace) in rebuilt.items())])
