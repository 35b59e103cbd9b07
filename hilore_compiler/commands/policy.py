"""The policy ``hilore trace`` and ``hilore calibrate`` build: a built-in model or ``hf:CONFIG``.

``--model small`` (any name of ``models.MODEL_CONFIGS``) builds a built-in
policy exactly as before; ``--model hf:NAME_OR_PATH`` a Hugging Face causal LM
from its config alone (``models.hf_config``), shaped by ``--layers``,
``--lora``, ``--lora-alpha`` and ``--lora-targets``, which only ``hf:`` models take.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..models.hf_config import (DEFAULT_LORA_TARGETS, HF_PREFIX, HFModelSpec, bundled_names, is_hf_model,
                                parse_model_arg, parse_model_ref)
from . import comma_list


def model_arg(text: str) -> str:
    """``--model``: a built-in name or ``hf:NAME_OR_PATH``."""
    from ..models import model_names

    if text in model_names() or (is_hf_model(text) and text[len(HF_PREFIX):].strip()):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(model_names())}, "
                                     "or hf:NAME_OR_PATH for a Hugging Face config)")


def add_model_arguments(p: argparse.ArgumentParser, default: str | None = "small") -> None:
    """``--model`` and the options of an ``hf:`` model (``default=None``: the command's own default)."""
    from ..models import model_names

    p.add_argument("--model", default=default, type=model_arg, metavar="MODEL",
                   help=f"built-in model ({', '.join(model_names())}; default {default or 'small'}), or "
                        "hf:NAME_OR_PATH: a transformers causal LM built "
                        "from its config alone (a folder with config.json, a .json file, a config shipped "
                        f"with the package: {', '.join(bundled_names())}; or a hub name), "
                        "random weights, nothing but the config downloaded")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="hf: models: keep the first N decoder layers (so that a deep model fits a CPU)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="hf: models: train PEFT LoRA adapters of rank R, the base weights frozen")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA's alpha (default 2 x R)")
    p.add_argument("--lora-targets", type=comma_list, default=DEFAULT_LORA_TARGETS,
                   help=f"modules LoRA wraps (default {','.join(DEFAULT_LORA_TARGETS)})")


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A built policy and how a trace names it."""

    module: torch.nn.Module
    #: The trace's ``model``: the built-in name, or ``HFModelSpec.describe``'s.
    name: str
    vocab_size: int
    #: What was built, for the trace's notes (empty for a built-in model).
    notes: tuple[str, ...] = ()


def hf_spec(args: argparse.Namespace) -> HFModelSpec | None:
    """The ``hf:`` model the options name, or None for a built-in one (which takes none of them).

    ``--model`` may be a reference with its options folded in
    (``hf:PATH?layers=4&lora=16``, as the benchmarks hand it to ``hilore
    calibrate``); flags given as well override them.
    """
    if not is_hf_model(args.model):
        given = [f for f, v in (("--layers", args.layers), ("--lora", args.lora), ("--lora-alpha", args.lora_alpha))
                 if v is not None]
        if given or tuple(args.lora_targets) != DEFAULT_LORA_TARGETS:
            raise ValueError(f"{', '.join(given) or '--lora-targets'} shape(s) an hf: model; "
                             f"{args.model} is built in")
        return None
    base = parse_model_ref(args.model)
    lora = base.lora if args.lora is None else args.lora
    targets = tuple(args.lora_targets) if tuple(args.lora_targets) != DEFAULT_LORA_TARGETS else base.lora_targets
    alpha = base.lora_alpha if args.lora_alpha is None else args.lora_alpha
    if lora is None and (alpha is not None or targets != DEFAULT_LORA_TARGETS):
        raise ValueError("--lora-alpha and --lora-targets need --lora R")
    return parse_model_arg(HF_PREFIX + base.name_or_path, layers=base.layers if args.layers is None else args.layers,
                           lora=lora, lora_alpha=alpha, lora_targets=targets)


def model_ref(args: argparse.Namespace) -> str | None:
    """The model ``args`` name as one string for the benchmarks' workers: a built-in
    name, or ``HFModelSpec.ref`` of the ``hf:`` model and its options; None when no
    ``--model`` was given (the command's default)."""
    if args.model is None:
        hf_spec(argparse.Namespace(**{**vars(args), "model": "small"}))  # options without a model: refused
        return None
    spec = hf_spec(args)
    return args.model if spec is None else spec.ref()


def build_policy(args: argparse.Namespace, *, device: str, dtype: torch.dtype | None) -> Policy:
    """The policy ``args`` name, on ``device`` (``"meta"``: nothing allocated) in ``dtype``
    (None: float32), weights seeded by ``args.seed``."""
    from ..models import build_model
    from ..models.hf_config import build_from_config, load_config

    spec = hf_spec(args)
    if spec is None:
        model = build_model(args.model, device=device, dtype=dtype, seed=args.seed)
        return Policy(module=model, name=args.model, vocab_size=model.config.vocab_size)
    config = load_config(spec)
    model = build_from_config(spec, config, device=device, dtype=dtype, seed=args.seed)
    return Policy(module=model, name=spec.describe(config.num_hidden_layers), vocab_size=config.vocab_size,
                  notes=_hf_notes(spec, config, model, device=device, seed=args.seed))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """A Hugging Face causal LM's decoder layers."""
    return model.get_decoder().layers


def _hf_notes(spec: HFModelSpec, config, model: torch.nn.Module, *, device: str, seed: int) -> tuple[str, ...]:
    """What was built: the architecture, where, in which dtype, and the LoRA adapters."""
    from ..passes.tracer import frozen_parameter_bytes
    from ..solver.budget import format_bytes

    params = list(model.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    where = "on the meta device (no weights)" if device == "meta" else f"with random weights (seed {seed})"
    notes = [f"{spec.name_or_path}: {type(model).__name__} built from its config alone {where}, "
             f"{config.num_hidden_layers} layers, sdpa attention, use_cache and dropout off; parameters {', '.join(dtypes)}"]
    if spec.lora is not None:
        import peft

        adapters = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.requires_grad})
        notes.append(f"LoRA (peft {peft.__version__}): r={spec.lora}, alpha {spec.alpha:g}, dropout 0, on "
                     f"{','.join(spec.lora_targets)}; adapters {', '.join(adapters)}, trained "
                     f"{format_bytes(trained)}; base weights frozen, {format_bytes(frozen_parameter_bytes(model))}")
    return tuple(notes)
