"""``hilore calibrate --model small -o TRACE.json``: measured sensitivity per (unit kind, codec).

``--model`` takes a built-in name or ``hf:CONFIG`` with its options (``commands.policy``).
"""

from __future__ import annotations

import argparse
import sys

from . import SUMMARIES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..models import DTYPES
    from .policy import add_model_arguments

    p = subparsers.add_parser(
        "calibrate", help=SUMMARIES["calibrate"],
        description="Compress one unit of each kind at a time and compare the gradient with the "
                    "exact one; the solver then bounds measured gradient error instead of a proxy.",
    )
    add_model_arguments(p)
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="parameter dtype of the policy; the trace's (hilore trace --dtype) (default float32)")
    p.add_argument("--trace", default=None, help="trace to calibrate (default: trace the model first)")
    p.add_argument("--batch", type=int, default=2, help="sequences (default 2; the trace's if given)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--codecs", default=None, help="codecs to calibrate, e.g. bf16,int8 (default: all usable)")
    p.add_argument("--per-unit", action="store_true",
                   help="measure every unit, not one per kind (a pass per unit and codec): for lossy "
                        "codecs such as int4, whose error differs across layers of a kind")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches of random tokens whose summed gradient is compared (default 1): "
                        "more read an update's error more closely, each costs a forward and backward per pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, help="where to write the calibrated trace")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..passes.calibration import CalibrationConfig, calibrate
    from .policy import build_policy
    from ..jsonio import check_output_path, save_or_fallback
    from ..tracefile import load_trace
    from ..passes.tracer import TraceConfig, trace
    from .trace import example_batch, grpo_trace_loss, trace_advantages
    from . import comma_list

    if args.microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {args.microbatches}")
    check_output_path(args.output, inputs=[args.trace] if args.trace else [])
    policy = build_policy(args, device="cpu", dtype=getattr(torch, args.dtype))
    model = policy.module
    source = load_trace(args.trace) if args.trace else None
    traced = source and _policy_dtype(source)
    if traced and traced != args.dtype:
        raise ValueError(f"{args.trace} was traced from a {traced} policy and --dtype is {args.dtype}: its "
                         f"units are not this policy's graph; pass --dtype {traced}")
    batch, seq_len = (source.batch, source.seq_len) if source else (args.batch, args.seq_len)
    ids = example_batch(model, batch, seq_len, args.seed, "cpu", vocab=policy.vocab_size)
    loss = grpo_trace_loss(ids, args.seed)
    if source is None:
        source = trace(model, [ids], loss, config=TraceConfig(model_name=policy.name, notes=policy.notes))
    exposure = float(trace_advantages(batch, args.seed).abs().mean())
    codecs = comma_list(args.codecs) if args.codecs else None
    more = []
    for k in range(1, args.microbatches):  # further microbatches: their own tokens and advantages
        other = example_batch(model, batch, seq_len, args.seed + k, "cpu", vocab=policy.vocab_size)
        more.append(([other], grpo_trace_loss(other, args.seed + k)))
    calibrated = calibrate(model, [ids], loss, source, exposure=exposure, more=more,
                           config=CalibrationConfig(codecs=codecs, per_unit=args.per_unit))
    path = save_or_fallback(calibrated.save, args.output, "trace")
    print(f"wrote {path}: sensitivities for {sum(bool(u.sensitivity) for u in calibrated.units)} "
          f"of {len(calibrated.units)} units", file=sys.stderr)
    return 0


def _policy_dtype(trace) -> str | None:
    """The parameter dtype a trace's policy had: that of most of its units (norm statistics
    stay fp32 in a bf16 policy); None if it has no floating units."""
    from collections import Counter

    from ..models import DTYPES

    counts = Counter(u.dtype for u in trace.units if u.dtype in DTYPES)
    return counts.most_common(1)[0][0] if counts else None
