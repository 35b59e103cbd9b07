"""``hilore trace --model small --batch B --seq-len S -o TRACE.json``: profile a built-in model
or a Hugging Face config (``--model hf:PATH``, ``commands.policy``)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..jsonio import check_output_path, save_or_fallback
from ..devices import DEVICES, GiB, device_spec
from ..models.hf_config import DEFAULT_LORA_TARGETS
from ..vocabulary import DEFAULT_CODECS
from . import SUMMARIES
from ..passes.depth import CAPTURED_LAYERS, stack_differs
from .policy import add_model_arguments, build_policy, decoder_layers, hf_spec


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..models import DTYPES

    p = subparsers.add_parser(
        "trace", help=SUMMARIES["trace"],
        description="Capture the joint forward+backward graph torch.compile builds for one GRPO "
                    "actor update, group the saved activations into recovery units and measure "
                    "what each costs to store, compress or recompute.",
    )
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=2,
                   help="sequences per microbatch (default 2; a batch of 1 is traced at 2 so that "
                        "sizes keep the batch symbol B)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--cost-model", default="measured",
                   help="'measured' (run here) or " + ", ".join(f"'roofline:{d}'" for d in DEVICES)
                   + "; roofline traces build the model on the meta device (no weights in memory)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype of the policy (default: float32 measured, bfloat16 for roofline)")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                   help=f"codecs to measure (default {','.join(DEFAULT_CODECS)}, the backend's; a trace "
                        "may measure more, such as fp8 or int4, for plans that opt in)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capture-layers", choices=("auto", "all"), default="auto",
                   help=f"hf: models deeper than {CAPTURED_LAYERS} layers whose middle layers are built alike: "
                        f"'auto' captures the first {CAPTURED_LAYERS} and gives the others their units "
                        "(the same trace, in a fraction of the time); 'all' captures every layer (default auto)")
    p.add_argument("-o", "--output", required=True, help="where to write the trace JSON")
    p.set_defaults(run=run)


def trace_advantages(batch: int, seed: int) -> torch.Tensor:
    """(B, 1) standard-normal advantages, like group-normalised GRPO ones."""
    return torch.randn(batch, 1, generator=torch.Generator().manual_seed(seed))


def grpo_trace_loss(input_ids: torch.Tensor, seed: int) -> Callable[[Any], torch.Tensor]:
    """A GRPO-shaped loss for tracing: advantage-weighted token log-probs.

    The saved activations do not depend on the loss (it runs outside the
    compiled graph); this keeps the traced step the same as an actor update.
    A sample's exposure in plan units is its |advantage|. It takes the
    logits, or a Hugging Face model's output, whose ``.logits`` it reads.
    """
    from ..models import token_logprobs

    advantages = trace_advantages(input_ids.shape[0], seed).to(input_ids.device)

    def loss(out: Any) -> torch.Tensor:
        logits = getattr(out, "logits", out)  # (B, T, V)
        return -(token_logprobs(logits, input_ids) * advantages).mean()

    return loss


def example_batch(model: torch.nn.Module, batch: int, seq_len: int, seed: int, device,
                  vocab: int | None = None) -> torch.Tensor:
    """Random token ids in the model's vocabulary (``vocab``, default its config's; no data sets
    are downloaded)."""
    vocab = model.config.vocab_size if vocab is None else vocab
    if torch.device(device).type == "meta":
        return torch.empty(batch, seq_len, dtype=torch.long, device="meta")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)


def run(args: argparse.Namespace) -> int:
    from ..passes.tracer import TraceConfig, frozen_parameter_bytes, trace

    check_output_path(args.output)  # before minutes of profiling, not after
    roofline = args.cost_model != "measured"
    if roofline:
        device_spec(args.cost_model)  # an unknown device fails before the model is built
    device = "meta" if roofline else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if roofline else None)
    full, cut = _depth_cut(args, dtype)
    policy = build_policy(args if cut is None else cut, device=device, dtype=dtype)
    ids = example_batch(policy.module, args.batch, args.seq_len, args.seed, device, vocab=policy.vocab_size)
    notes = (command_line(args), *policy.notes)
    if cut is not None:
        layers = len(decoder_layers(full.module))
        notes += (f"captured the first {CAPTURED_LAYERS} of {layers} layers: layers 2-{layers - 2} repeat "
                  f"layer 2's units, layer {layers - 1} layer 3's (their middle layers are built alike; "
                  "--capture-layers all captures every layer)",)
    if roofline:
        notes += ("meta device: codec errors measured on synthetic N(0,1) rows of each unit's width",)
    if policy.notes:  # what the costs are for, said once beside what was built
        notes += (f"costs: {_costs_for(args.cost_model)}; parameters "
                  f"{args.dtype or ('bfloat16' if roofline else 'float32')}",)
    config = TraceConfig(cost_model=args.cost_model, codecs=tuple(c for c in args.codecs.split(",") if c),
                         repeats=args.repeats, model_name=(full or policy).name, notes=notes,
                         full_layers=None if cut is None else len(decoder_layers(full.module)))
    result = trace(policy.module, [ids], grpo_trace_loss(ids, args.seed), config=config)
    if cut is not None:  # the whole model's base weights, not the cut's
        result = dataclasses.replace(result, frozen_param_bytes=frozen_parameter_bytes(full.module))
    path = save_or_fallback(result.save, args.output, "trace")
    print(f"wrote {path}: {len(result.units)} recovery units over {result.num_layers} layers, "
          f"fingerprint {result.fingerprint}", file=sys.stderr)
    return 0


def _depth_cut(args: argparse.Namespace, dtype: torch.dtype | None) -> tuple[Any, argparse.Namespace | None]:
    """The whole ``hf:`` model on the meta device and the options that build its first
    ``CAPTURED_LAYERS`` layers, when the trace may be made from those (``passes.depth``);
    ``(None, None)`` otherwise (a built-in model, ``--capture-layers all``, a shallow or
    mixed stack: said once)."""
    if args.capture_layers == "all" or hf_spec(args) is None:
        return None, None
    full = build_policy(args, device="meta", dtype=dtype)
    layers = decoder_layers(full.module)
    why = stack_differs(layers, getattr(full.module.config, "layer_types", None))
    if why is not None:
        if len(layers) > CAPTURED_LAYERS:
            print(f"hilore trace: capturing all {len(layers)} layers: {why}", file=sys.stderr)
        return None, None
    return full, argparse.Namespace(**{**vars(args), "layers": CAPTURED_LAYERS if args.layers is None
                                       else min(args.layers, CAPTURED_LAYERS)})


def command_line(args: argparse.Namespace) -> str:
    """The ``hilore trace`` command that made a trace, for its notes."""
    line = (f"hilore trace --model {args.model} --batch {args.batch} --seq-len {args.seq_len} "
            f"--cost-model {args.cost_model}" + (f" --dtype {args.dtype}" if args.dtype else ""))
    for flag, value in (("--layers", args.layers), ("--lora", args.lora), ("--lora-alpha", args.lora_alpha)):
        if value is not None:
            line += f" {flag} {value:g}"
    if args.lora is not None and tuple(args.lora_targets) != DEFAULT_LORA_TARGETS:
        line += f" --lora-targets {','.join(args.lora_targets)}"
    return line


def _costs_for(cost_model: str) -> str:
    """The cost model in words: measured here, or the card a roofline is for."""
    if cost_model == "measured":
        return "measured on this machine's CPU"
    spec = device_spec(cost_model)
    return f"roofline of {spec.label} ({spec.memory_bytes // GiB} GiB; {cost_model})"
