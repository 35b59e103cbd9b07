"""Calibration: measured gradient sensitivity per (unit kind, codec).

For each unit kind (``mlp.gate_proj.linear``, ``self_attn.sdpa``, ...) one
representative unit (in the middle layer) is compressed with one codec while
every other unit is stored; the gradient of a calibration batch is compared
with the exact (store-all) one:

    sensitivity(kind, codec) = ||g_compressed - g_exact|| / ||g_exact||

the relative gradient error of an update whose whole coefficient mass goes
through the compressed unit (``solver/risk.py``). The loss is linear in the
per-token coefficients (on-policy), so the size of the calibration batch's
advantages does not change it. The value is written to every unit of that
kind: layers of one kind share a measurement, their activations having the
same statistics after normalisation. That holds to about 1.4x for most
kinds, not for all: under int4 on ``small`` (sequence 256) layer 0's
input-norm output errs 8x layer 2's (4.7e-2 against 5.6e-3), and the second
residual add of the last layer 3x the shared value. Where the error budget binds (lossy codecs), ``per_unit``
measures every unit instead. On a GRPO update of 8 microbatches, the units
of a blind int4 plan, measured one by one, add up in quadrature to the
plan's measured error within 1%; their per-kind sensitivities to 14% under it.
``measured_error`` measures a whole plan's error, to check how per-unit
errors combine (in quadrature).

Cost: the joint graph is traced once (``JointRunner``), then each (kind,
codec), or (unit, codec) with ``per_unit``, is one eager run of it with that
unit's codec applied, per microbatch: about 0.2 s each for the ``tiny``
model. Plans that recompute, and graphs the runner cannot run directly,
take one eager AOT compile per plan instead (``_gradient``), about 1 s on
``tiny`` and 5-40 s for ``small`` at sequence 2048 on 2 shared cores.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .annotate import annotate_units
from .apply import apply_decisions
from .capture import default_partition, fresh_code, inductor_partition, light_copy
from .partition import partition_with_decisions
from ..tracefile import RecoveryUnit, Trace
from ..vocabulary import COMPRESS_PREFIX, STORE, compress
from ..progress import tell


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationConfig:
    """Options of ``calibrate``."""

    #: Codecs to calibrate; None: every codec the trace measured as usable.
    codecs: tuple[str, ...] | None = None
    #: Layer whose units represent their kind; None: the middle layer.
    layer: int | None = None
    #: Measure every unit, not one per kind: a pass per (unit, codec) instead
    #: of per (kind, codec). Worth it where the error budget binds: one kind's
    #: units differ across layers, up to 8x under int4 (module docstring).
    per_unit: bool = False
    verbose: bool = True


def _grab_graph(model: torch.nn.Module, example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, list]:
    """The dynamo graph of ``model`` and its real inputs (parameters included)."""
    grabbed: list = []

    def grab(gm: fx.GraphModule, inputs: Sequence[Any]):
        grabbed.append((gm, list(inputs)))
        return gm

    def calibrated(*args: Any) -> Any:
        return model(*args)

    torch.compile(fresh_code(calibrated), backend=grab, dynamic=False)(*example_inputs)
    if len(grabbed) != 1:
        raise RuntimeError(f"calibration needs a model without graph breaks, found {len(grabbed)} graphs")
    return grabbed[0]


#: A calibration microbatch: the model's inputs and the loss of its output.
Microbatch = tuple[Sequence[Any], Callable[[Any], torch.Tensor]]


def _runs(example_inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor], inputs: list,
          more: Sequence[Microbatch]) -> list[tuple[list, Callable[[Any], torch.Tensor]]]:
    """The graph's input lists for the example microbatch and each of ``more``:
    the example's tensors swapped for the other microbatch's, parameters shared."""
    slots = []
    for position, example in enumerate(example_inputs):
        if isinstance(example, torch.Tensor):
            found = [i for i, x in enumerate(inputs) if x is example]
            if len(found) != 1:
                raise RuntimeError(f"calibration: example input {position} is not one input of the captured graph")
            slots.append((position, found[0]))
    runs = [(list(inputs), loss_fn)]
    for n, (other, other_loss) in enumerate(more):
        if len(other) != len(example_inputs):
            raise ValueError(f"calibration microbatch {n + 1}: {len(other)} inputs, the example has "
                             f"{len(example_inputs)}")
        args = list(inputs)
        for position, slot in slots:
            tensor = other[position]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != example_inputs[position].shape:
                raise ValueError(f"calibration microbatch {n + 1}: input {position} must be a tensor of the "
                                 f"example's shape {tuple(example_inputs[position].shape)}")
            args[slot] = tensor
        runs.append((args, other_loss))
    return runs


def _aot_backend(partitioner: Callable) -> Callable:
    """An AOTAutograd backend that runs eagerly (no Inductor) around ``partitioner``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g),
                        bw_compiler=lambda g, _: make_boxed_func(g),
                        partition_fn=inductor_partition(partitioner),
                        decompositions=select_decomp_table())


def _gradient(gm: fx.GraphModule, runs: Sequence[tuple[list, Callable[[Any], torch.Tensor]]],
              params: list[torch.nn.Parameter], decisions: Mapping[str, str]) -> torch.Tensor:
    """The parameter gradient with ``decisions`` applied, run eagerly (no Inductor),
    accumulated over ``runs`` (graph inputs, loss) as an update accumulates it.

    One AOT compile per call: the general path, for graphs ``JointRunner`` cannot run.
    """
    def partitioner(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        made = partition_with_decisions(joint, joint_inputs, decisions, **kwargs)
        return made.fw, made.bw

    compiled = _aot_backend(partitioner)(gm, runs[0][0])
    for p in params:
        p.grad = None
    for inputs, loss_fn in runs:
        out = compiled(*inputs)
        loss_fn(_single(out)).backward()
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None])


def _single(out: Any) -> Any:
    """The model's output as the loss takes it: the tensor itself when the graph has one output."""
    return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


class JointRunner:
    """Runs one joint graph, captured once, under any plan of compressed and stored units.

    A compressed unit changes only what backward reads (``apply``: backward
    reads a decoded copy, forward the exact value), so a plan's gradient is
    the joint graph's own gradient outputs after ``apply_decisions``, run
    eagerly on the real inputs with the loss's gradient as tangents. The
    tangents do not depend on the plan: forward is exact under every one. The
    joint graph is traced once, where an AOT compile per plan (``_gradient``)
    traces and partitions it anew each time: most of calibration's time.

    ``from_graph`` returns None where this does not apply (graph outputs that
    are not the tangents' one-to-one, parameters that are not graph inputs);
    plans that recompute take the general path too, as recomputation is
    exact in value but not in its random ops.
    """

    def __init__(self, joint: fx.GraphModule, saved_names: set[str], num_fwd_outputs: int,
                 params: list[torch.nn.Parameter], param_slots: list[int]) -> None:
        self.joint, self.saved_names, self.num_fwd_outputs = joint, saved_names, num_fwd_outputs
        self.params, self.param_slots = params, param_slots

    @classmethod
    def from_graph(cls, gm: fx.GraphModule, inputs: list, params: list[torch.nn.Parameter]) -> JointRunner | None:
        """Capture ``gm``'s joint graph as Inductor's partitioner gets it; None if it cannot be run directly."""
        got: dict[str, Any] = {}

        def record(joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            fw, bw, got["saved"] = default_partition(joint, joint_inputs, **kwargs)
            got["joint"], got["num_fwd_outputs"] = light_copy(joint), kwargs["num_fwd_outputs"]
            return fw, bw

        _aot_backend(record)(gm, inputs)
        joint = got["joint"]
        placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
        primals = [n for n in placeholders if not n.name.startswith("tangents")]
        slots = [next((i for i, x in enumerate(inputs) if x is p), None) for p in params]
        if len(primals) != len(inputs) or None in slots or getattr(joint, "_in_spec", None) is not None:
            return None
        return cls(joint, got["saved"], got["num_fwd_outputs"], params, slots)

    def tangents(self, gm: fx.GraphModule, inputs: list, loss_fn: Callable[[Any], torch.Tensor]
                 ) -> list[torch.Tensor] | None:
        """d loss / d output for each tangent of the joint graph; None if they do not pair up."""
        expected = [n.meta.get("val") for n in self.joint.graph.nodes
                    if n.op == "placeholder" and n.name.startswith("tangents")]
        with torch.no_grad():
            out = gm(*inputs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != len(expected) or not all(
                isinstance(o, torch.Tensor) and isinstance(e, torch.Tensor) and o.shape == e.shape
                and o.dtype == e.dtype for o, e in zip(outs, expected)):
            return None
        leaves = [o.detach().requires_grad_() for o in outs]
        loss = loss_fn(_single(tuple(leaves)) if isinstance(out, (tuple, list)) else leaves[0])
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(o) if g is None else g for o, g in zip(outs, grads)]

    def gradient(self, runs: Sequence[tuple[list, list[torch.Tensor]]], decisions: Mapping[str, str]) -> torch.Tensor:
        """The flat parameter gradient under ``decisions``, summed over ``runs`` (inputs, tangents)."""
        joint = light_copy(self.joint)
        apply_decisions(joint, annotate_units(joint, self.saved_names), decisions)
        total: list[torch.Tensor | None] = [None] * len(self.params)
        with torch.no_grad():
            for inputs, tangents in runs:
                grads = joint(*inputs, *tangents)[self.num_fwd_outputs:]
                for i, slot in enumerate(self.param_slots):
                    if grads[slot] is not None:
                        total[i] = grads[slot] if total[i] is None else total[i] + grads[slot]
        return torch.cat([g.flatten() for g in total if g is not None])


def _representatives(trace: Trace, layer: int | None) -> dict[str, RecoveryUnit]:
    """One unit per kind: the one in ``layer`` (middle by default) or the first."""
    layers = sorted({u.layer for u in trace.units if u.layer is not None})
    middle = layer if layer is not None else (layers[len(layers) // 2] if layers else None)
    chosen: dict[str, RecoveryUnit] = {}
    for unit in trace.units:
        best = chosen.get(unit.kind)
        if best is None or (unit.layer == middle and best.layer != middle):
            chosen[unit.kind] = unit
    return chosen


def measured_error(model: torch.nn.Module, example_inputs: Sequence[Any],
                   loss_fn: Callable[[Any], torch.Tensor], trace: Trace,
                   plans: Sequence[Mapping[str, str]],
                   progress: Callable[[str], None] | None = None,
                   more: Sequence[Microbatch] = ()) -> list[float]:
    """Relative gradient error of each plan (``{unit key: option}``, others stored) vs store-all.

    ``more``: further microbatches (``plan_gradients``). ``progress`` hears
    of each plan as it starts.
    """
    exact, *approx = plan_gradients(model, example_inputs, loss_fn, trace, [{}, *plans], progress=progress,
                                    more=more)
    return [float((g - exact).norm() / exact.norm().clamp_min(1e-30)) for g in approx]


def plan_gradients(model: torch.nn.Module, example_inputs: Sequence[Any],
                   loss_fn: Callable[[Any], torch.Tensor], trace: Trace,
                   plans: Sequence[Mapping[str, str]],
                   progress: Callable[[str], None] | None = None,
                   more: Sequence[Microbatch] = ()) -> list[torch.Tensor]:
    """The flat parameter gradient under each plan (``{unit key: option}``, others stored).

    ``more``: further microbatches of the example's shape, each with its own
    loss; the gradient is the sum over all of them, as an update accumulates
    it (one compile per plan, a forward and backward per microbatch). The
    model's ``.grad`` are reset to None afterwards. ``progress`` hears of
    each plan as it starts.
    """
    gm, inputs = _grab_graph(model, example_inputs)
    runs = _runs(example_inputs, loss_fn, inputs, more)
    params = [p for p in model.parameters() if p.requires_grad]
    store_all = {u.key: STORE for u in trace.units}
    runner, tangent_runs = None, None
    if all(o == STORE or o.startswith(COMPRESS_PREFIX) for plan in plans for o in plan.values()):
        runner = JointRunner.from_graph(gm, inputs, params)
        if runner is not None:
            tangent_runs = [(args, runner.tangents(gm, args, fn)) for args, fn in runs]
            if any(t is None for _, t in tangent_runs):
                runner = None
    out = []
    for i, plan in enumerate(plans):
        if progress is not None:
            what = ", ".join(f"{k} {o}" for k, o in plan.items()) or "store-all"
            progress(f"{i + 1}/{len(plans)}: {what}")
        decisions = {**store_all, **plan}
        out.append(runner.gradient(tangent_runs, decisions) if runner is not None
                   else _gradient(gm, runs, params, decisions))
    for p in params:
        p.grad = None
    return out


def calibrate(model: torch.nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
              trace: Trace, *, exposure: float | None = None,
              config: CalibrationConfig = CalibrationConfig(), more: Sequence[Microbatch] = ()) -> Trace:
    """Measure sensitivity per (unit kind or unit, codec) and return the trace with it filled in.

    ``example_inputs`` must have the traced shape. ``more``: further
    microbatches of that shape with their own losses: the errors are then
    those of their summed gradient, an update's (the update's own loss over
    several microbatches predicts its error better than one microbatch:
    module docstring). ``exposure`` is accepted
    for older callers and ignored: the sensitivity is a relative error, which
    does not depend on the batch's exposure (module docstring).
    """
    del exposure
    pairs = [(kind, unit, codec) for kind, unit in _calibrated_units(trace, config)
             for codec, cost in unit.codecs.items()
             if cost.usable and (config.codecs is None or codec in config.codecs)]

    def progress(message: str) -> None:
        tell(f"hilore calibrate: {message}")

    errors = measured_error(model, example_inputs, loss_fn, trace,
                            [{unit.key: compress(codec)} for _, unit, codec in pairs],
                            progress=progress if config.verbose else None, more=more)
    measured: dict[tuple[str, str], float] = {}
    for (name, _, codec), rel in zip(pairs, errors):
        measured[name, codec] = rel
        if config.verbose:
            print(f"hilore calibrate: {name:<40} {codec:<5} rel. gradient error {rel:.2e}",
                  file=sys.stderr, flush=True)
    units = tuple(_with_sensitivity(u, measured, config.per_unit) for u in trace.units)
    if config.per_unit:
        note = (f"sensitivity calibrated on {len(measured)} (unit, codec) pairs: relative gradient "
                "error with the unit compressed")
    else:
        note = (f"sensitivity calibrated on {len(measured)} (kind, codec) pairs: relative gradient "
                "error with the unit compressed, shared across layers of a kind")
    return dataclasses.replace(trace, units=units, notes=(*trace.notes, note))


def _calibrated_units(trace: Trace, config: CalibrationConfig) -> list[tuple[str, RecoveryUnit]]:
    """(name the measurement is filed under, unit measured): every unit, or one per kind."""
    if config.per_unit:
        return [(u.key, u) for u in trace.units]
    return list(_representatives(trace, config.layer).items())


def _with_sensitivity(unit: RecoveryUnit, measured: Mapping[tuple[str, str], float],
                      per_unit: bool) -> RecoveryUnit:
    name = unit.key if per_unit else unit.kind
    found = {codec: measured[name, codec] for codec, cost in unit.codecs.items()
             if cost.usable and (name, codec) in measured}
    return dataclasses.replace(unit, sensitivity={**unit.sensitivity, **found}) if found else unit
