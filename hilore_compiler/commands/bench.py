"""``hilore bench``: actor-update throughput and peak memory of GC, the baselines and HiLoRe."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import SUMMARIES, comma_list, length_list
from .policy import add_model_arguments, model_ref
from ..progress import tell

if TYPE_CHECKING:
    from ..bench.runner import BenchConfig

#: Where result files go unless ``-o`` says otherwise (relative to the working directory).
RESULTS_DIR = Path("bench") / "results"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..bench.actor import ACTOR_METHODS
    from ..bench.methods import CUDA_ONLY, METHODS
    from ..bench.process import HEAPS
    from ..bench.runner import BenchConfig, QUICK
    from ..models import DTYPES

    d = BenchConfig()
    p = subparsers.add_parser(
        "bench", help=SUMMARIES["bench"],
        description=(
            "Run one GRPO actor update (forward, token log-probs, GRPO loss, backward) per step "
            "with every method in its own process, alternating, and report tokens/s, peak memory "
            "and gradient fidelity against store-all, as ratios to gradient checkpointing. "
            "Defaults are the full configuration; --quick runs the tiny model. Exit status 1 if "
            "a method failed (its row says why), 0 otherwise, targets met or not."),
    )
    p.add_argument("--quick", action="store_true",
                   help="tiny model, short sequence, fewer repeats: "
                        + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    add_model_arguments(p, default=None)
    p.add_argument("--batch", type=int, help=f"sequences per step (default {d.batch})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--repeats", type=int, help=f"rounds of alternation (default {d.repeats})")
    p.add_argument("--steps-per-round", type=int,
                   help=f"measured steps per method per round (default {d.steps_per_round})")
    p.add_argument("--warmup", type=int, help=f"steps after compiling, not in the rounds (default {d.warmup})")
    p.add_argument("--settle-rounds", type=int,
                   help=f"alternating rounds after every set-up, before the counted ones, not counted "
                        f"(default {d.settle_rounds})")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)} "
                                     f"(default {','.join(d.methods)}; CUDA only: {','.join(CUDA_ONLY)}); "
                                     f"with --actor-update of "
                                     f"{','.join(ACTOR_METHODS)} (default all)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help=f"(default {d.device})")
    p.add_argument("--dtype", choices=DTYPES,
                   help=f"parameter dtype of the policy; log-probs and loss stay fp32 (default {d.dtype})")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: torch's)")
    p.add_argument("--heap", choices=HEAPS,
                   help=f"CPU: the heap timed workers run on: glibc's default, as a trainer runs, or fixed "
                        f"(mmap threshold 32 MiB, never trimmed), which takes out a per-process placement "
                        f"effect larger than what separates two close plans; peaks are measured apart either "
                        f"way (default {d.heap})")
    p.add_argument("--hilore-budget", help=f"HiLoRe's memory budget (default {d.hilore_budget})")
    p.add_argument("--pt-budget", type=float,
                   help="fixed activation_memory_budget for pt-budget and its solver variants "
                        "(default: searched to HiLoRe's peak)")
    p.add_argument("--budget-probes", type=int,
                   help=f"budgets the pt-budget search tries, one process each, spread over [0, 1]; "
                        f"the fastest whose peak fits HiLoRe's is kept (default {d.budget_probes})")
    p.add_argument("--seed", type=int, help=f"weights and batch seed (default {d.seed})")
    p.add_argument("--cache-dir", help="persistent Inductor and hilore caches, shared by later runs "
                                       "(default: fresh per run; cached traces and plans are keyed by graph, "
                                       "options and hilore's code, so a changed hilore traces and plans again)")
    p.add_argument("--actor-update", action="store_true",
                   help="run the whole bucketed GRPO actor update on a realistic batch (groups of 8, "
                        "binary rewards, zero-variance groups, second-iteration clipping): store-all, GC, "
                        "uniform int8, HiLoRe exposure-blind, with buckets, and GC, blind and buckets "
                        "with the zero skip (bench/actor.py); "
                        "--model, --seq-len, --repeats, --threads, --hilore-budget, --methods apply")
    p.add_argument("--lengths", type=functools.partial(length_list, flag="--lengths", at_least=2),
                   help="run the step at each of these sequence lengths (comma-separated, e.g. "
                        "256,512,1024,2048): GC, store-all and HiLoRe with one plan over the range, with length "
                        "buckets and static per length, in one run (bench/lengths.py); --model, --batch, "
                        "--repeats, --steps-per-round, --hilore-budget, --codecs, --threads, --seed apply")
    p.add_argument("--loss-type", choices=("dapo", "grpo"), help="--actor-update's normalisation (default dapo)")
    p.add_argument("--risk-budget", help="HiLoRe's error budget, e.g. cos>=0.99 (default cos>=0.999)")
    p.add_argument("--codecs", help="codecs HiLoRe may use, comma-separated, or 'none' for store and "
                                    "recompute only (default bf16,int8; int4 is the lossy opt-in)")
    p.add_argument("--step-chunks", type=chunk_list,
                   help="hilore-step chooses its log-prob chunk size among these token counts, "
                        "comma-separated, or 'auto' for sizes making 2 to 8 chunks: each priced by the "
                        "memory model, the fitting ones compiled and timed (default: gc-chunked's 128)")
    p.add_argument("--ceilings", type=ceiling_list,
                   help="the memory-speed frontier: comma-separated memory ceilings as multiples of GC's "
                        "measured peak, e.g. 0.8,1.0,1.1,1.5x-gc; each budgeted method (hilore, hilore-blind, "
                        "int8-recompute, hilore-step, sac-milp; pt-budget*, inductor-fp8 over their probes) is "
                        "planned or searched at each, the others placed where "
                        "their peaks fall; a per-ceiling table and frontier-<model>-T<len>.{json,png}")
    p.add_argument("--calibrate", action="store_true",
                   help="with --ceilings: plan from a trace calibrated per unit (hilore calibrate --per-unit, "
                        "a forward and backward per unit and codec, about 10 minutes for small at 2048 tokens) "
                        "instead of proxy sensitivities")
    p.add_argument("-o", "--output", help="result JSON (default bench/results/bench-<model>-T<len>.json; with "
                                          "--actor-update actor-update-<model>-T<len>-<loss>.json)")
    p.add_argument("--verl-zero", action="store_true",
                   help="time verl's FSDP2 actor update (2 gloo ranks, tiny random Qwen2, dynamic batch size) "
                        "at 0/25/50/75%% all-equal-reward groups: verl's engine with GC, hilore skipping whole "
                        "zero micro-batches, hilore dropping zero samples (--repeats rounds; --quick: smaller)")
    p.add_argument("--compile-cost", action="store_true",
                   help="first-compile seconds, step time and kernels of plain Inductor and zero-config hilore "
                        "on a Hugging Face Llama from a config (hidden 128, batch 2, seq 256, fp32), back to back "
                        "in fresh processes at each of --depths (bench/compile_cost.py; --quick: tiny)")
    p.add_argument("--memory-check", action="store_true",
                   help="predicted against measured whole-step peaks: store-all, GC compiled and eager, and "
                        "zero-config HiLoRe (1.10x-gc, the loss modelled), each in a fresh process measuring "
                        "peaks only, on --model (hf:qwen2.5-0.5b ...), --batch, --seq-len, --dtype "
                        "(bench/memory_check.py); memory-check-<model>-b<B>-t<T>.json")
    p.add_argument("--depths", type=functools.partial(length_list, flag="--depths"),
                   help="with --compile-cost: the Llama's layer counts (default 2,8,32)")
    p.add_argument("--nproc", type=int,
                   help="FSDP2 across this many processes (gloo on CPU, nccl on GPUs): GC, store-all "
                        "and HiLoRe compiled per block; --batch is then per rank "
                        "(see hilore_compiler/bench/distributed.py)")
    p.set_defaults(run=run)


def codec_list(text: str) -> tuple[str, ...]:
    """``--codecs``: comma-separated names; ``none`` for no codec at all."""
    return () if text.strip().lower() == "none" else comma_list(text)


def ceiling_list(text: str) -> tuple[float, ...]:
    """``--ceilings``: multiples of GC's peak, ``0.8,1.0,1.1x-gc`` (an ``x-gc`` suffix on any is allowed)."""
    try:
        ceilings = tuple(float(c.lower().removesuffix("x-gc").removesuffix("x")) for c in comma_list(text))
    except ValueError:
        ceilings = ()
    if not ceilings or min(ceilings) <= 0:
        raise argparse.ArgumentTypeError(f"--ceilings takes positive multiples of GC's peak like 0.8,1.0,1.1x-gc, "
                                         f"not {text!r}")
    return ceilings


def chunk_list(text: str) -> tuple[int, ...]:
    """``--step-chunks``: ``auto`` or comma-separated positive token counts."""
    if text.strip().lower() == "auto":
        return (0,)
    try:
        sizes = tuple(int(c) for c in comma_list(text))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--step-chunks takes 'auto' or positive token counts like 64,128,256, "
                                         f"not {text!r}")
    return sizes


def actor_config_from_args(args: argparse.Namespace):
    """ActorBenchConfig from its defaults and the options that apply to it."""
    from ..bench.actor import ActorBenchConfig

    names = {"model": "model", "seq_len": "seq_len", "repeats": "repeats", "threads": "threads",
             "hilore_budget": "budget", "loss_type": "loss_type", "risk_budget": "risk_budget",
             "seed": "seed", "warmup": "warmup", "steps_per_round": "steps_per_round",
             "settle_rounds": "settle_rounds", "heap": "heap"}
    if getattr(args, "device", None) == "cuda":
        # Its workers, peaks and loss-side measure are the CPU's; a CUDA run
        # would be labelled as one while running on the CPU.
        raise ValueError("--actor-update runs on the CPU only for now; drop --device cuda, or run the "
                         "step bench on the GPU: hilore bench --device cuda --dtype bfloat16 --model tinyllama-8l")
    values = {field: getattr(args, flag) for flag, field in names.items() if getattr(args, flag, None) is not None}
    if getattr(args, "codecs", None):
        values["codecs"] = codec_list(args.codecs)
    if getattr(args, "methods", None):
        values["methods"] = comma_list(args.methods)
    return ActorBenchConfig(**values)


def run_actor(args: argparse.Namespace) -> int:
    """``--actor-update``: run, print the table, save the JSON."""
    from ..bench.actor import run_actor_bench
    from ..bench.actor_report import format_table

    config = actor_config_from_args(args)
    name = f"actor-update-{_slug(config.model)}-T{config.seq_len}-{config.loss_type}.json"
    output = Path(args.output or RESULTS_DIR / name)
    report = run_actor_bench(config, _progress)
    _save_report(report, output, format_table)
    return 1 if any(r["status"] != "ok" for r in report["rows"]) else 0


def _save_report(report: dict, output: Path, render) -> None:
    """Stamp the command that made ``report``, print it as a table, write it atomically."""
    from ..jsonio import write_json_atomic

    report["command"] = _command()
    print(render(report))
    print(f"results: {write_json_atomic(output, report)}")


def run_compile_cost(args: argparse.Namespace) -> int:
    """``--compile-cost``: run, print the table, save the JSON."""
    from ..bench.compile_cost import QUICK, CompileCostConfig, format_table, run_compile_cost as run_bench

    values: dict = dict(QUICK) if args.quick else {}
    values.update({k: v for k, v in (("depths", args.depths), ("threads", args.threads), ("batch", args.batch),
                                     ("seq_len", args.seq_len), ("dtype", args.dtype)) if v is not None})
    if args.model is not None:
        if not args.model.startswith("hf:"):
            raise SystemExit(f"hilore bench: error: --compile-cost compiles Hugging Face models (hf:CONFIG); "
                             f"{args.model} is built in")
        values["model"] = args.model
        if args.depths is None:  # the model as given: its --layers, or every layer of its config
            values["depths"] = (_layers_of(args.model),)
    config = CompileCostConfig(**values)
    depths = "-".join(map(str, config.depths))
    name = f"{_unlayered_slug(config.model)}-b{config.batch}-t{config.seq_len}" if config.model \
        else f"llama-h{config.hidden}"
    output = Path(args.output or RESULTS_DIR / f"compile-cost-{name}-l{depths}.json")
    report = run_bench(config, _progress)
    _save_report(report, output, format_table)
    return 1 if any(r["status"] != "ok" for r in report["rows"]) else 0


def run_memory_check(args: argparse.Namespace) -> int:
    """``--memory-check``: run, print the table, save the JSON."""
    from ..bench.memory_check import MemoryCheckConfig, format_table, run_memory_check as run_check
    from ..bench.runner import resolve_device

    values: dict = {"model": args.model or "small", "device": resolve_device(args.device or "auto")}
    values.update({k: v for k, v in (("batch", args.batch), ("seq_len", args.seq_len), ("dtype", args.dtype),
                                     ("threads", args.threads), ("seed", args.seed), ("warmup", args.warmup),
                                     ("cache_dir", args.cache_dir)) if v is not None})
    if args.methods:
        values["methods"] = comma_list(args.methods)
    try:
        config = MemoryCheckConfig(**values)
    except ValueError as e:
        print(f"hilore bench: error: {e}", file=sys.stderr)
        return 2
    dtype = "" if config.dtype == "float32" else f"-{config.dtype}"
    output = Path(args.output or RESULTS_DIR / f"memory-check-{_slug(config.model)}-b{config.batch}"
                                               f"-t{config.seq_len}{dtype}.json")
    report = run_check(config, _progress)
    _save_report(report, output, format_table)
    return 1 if any(r["status"] != "ok" for r in report["rows"]) else 0


def run_zero_shares(args: argparse.Namespace) -> int:
    """``--verl-zero``: run, print the table, save the JSON."""
    from ..bench.verl_zero import QUICK, VerlZeroConfig, format_table, run_verl_zero

    values: dict = dict(QUICK) if args.quick else {}
    if args.repeats is not None:
        values["rounds"] = args.repeats
    if args.seed is not None:
        values["seed"] = args.seed
    config = VerlZeroConfig(**values)
    output = Path(args.output or RESULTS_DIR / f"verl-zero-h{config.hidden}-l{config.layers}.json")
    report = run_verl_zero(config)
    _save_report(report, output, format_table)
    return 0


def run_lengths(args: argparse.Namespace) -> int:
    """``--lengths``: run, print the tables, save the JSON."""
    from ..bench.lengths import LengthsBenchConfig, render_lengths, run_lengths_bench
    from ..jsonio import write_json_atomic

    values: dict = {"model": "tiny", "repeats": 3} if args.quick else {}
    names = {"model": "model", "batch": "batch", "repeats": "repeats", "steps_per_round": "steps_per_round",
             "hilore_budget": "hilore_budget", "seed": "seed", "threads": "threads", "cache_dir": "cache_dir",
             "heap": "heap"}
    values.update({field: getattr(args, flag) for flag, field in names.items() if getattr(args, flag, None) is not None})
    if args.methods:
        values["methods"] = comma_list(args.methods)
    if args.codecs:
        values["hilore_codecs"] = codec_list(args.codecs)
    config = LengthsBenchConfig(lengths=args.lengths, **values)
    name = f"lengths-{_slug(config.model)}-T{'-'.join(map(str, config.lengths))}.json"
    output = Path(args.output or RESULTS_DIR / name)
    result = run_lengths_bench(config, _progress)
    result["command"] = _command()
    print(f"results: {write_json_atomic(output, result)}")  # first: the table is read from it
    print(render_lengths(result))
    return 1 if any(m["status"] != "ok" for m in result["methods"].values()) else 0


def config_from_args(args: argparse.Namespace):
    """BenchConfig from the defaults, then ``--quick``'s preset, then explicit options."""
    from ..bench.runner import BenchConfig, QUICK

    values = dict(QUICK) if args.quick else {}
    for f in dataclasses.fields(BenchConfig):
        given = getattr(args, f.name, None)
        if given is not None and f.name != "methods":
            values[f.name] = given
    if args.methods:
        values["methods"] = comma_list(args.methods)
    if getattr(args, "codecs", None):
        values["hilore_codecs"] = codec_list(args.codecs)
    if getattr(args, "risk_budget", None):
        values["hilore_risk_budget"] = args.risk_budget
    return BenchConfig(**values)


def _layers_of(model: str) -> int:
    """Decoder layers of the ``hf:`` reference ``model``: its ``layers`` option, else its config's."""
    from ..models.hf_config import load_config, parse_model_ref

    return load_config(parse_model_ref(model)).num_hidden_layers


def _unlayered_slug(model: str) -> str:
    """``model_slug`` of the ``hf:`` reference ``model`` without its depth (which the depths name)."""
    from ..models.hf_config import parse_model_ref

    return dataclasses.replace(parse_model_ref(model), layers=None).slug()


def _slug(model: str) -> str:
    """``model`` as result file names write it (``models.model_slug``)."""
    from ..models import model_slug

    return model_slug(model)


def _command() -> str:
    """The command line that made a result, for its file."""
    return "hilore " + " ".join(sys.argv[1:])


def _progress(message: str) -> None:
    tell(f"bench: {message}")


def run(args: argparse.Namespace) -> int:
    from ..bench.host import bf16_emulation_warning
    from ..bench.plot import save_png
    from ..bench.report import format_table, format_targets, summarise, to_json
    from ..bench.runner import resolve_device, run_bench

    try:
        args.model = model_ref(args)  # hf: options folded in: one string reaches every worker
    except ValueError as e:
        print(f"hilore bench: error: {e}", file=sys.stderr)
        return 2
    if args.nproc:
        from ..bench.distributed import run_command

        if args.model is not None and args.model.startswith("hf:"):
            print("hilore bench: error: --nproc runs the built-in policies only; an hf: model's FSDP2 bench "
                  "is not built yet (its sharding of a Hugging Face model is tests/test_fsdp*.py's)",
                  file=sys.stderr)
            return 2
        return run_command(args)
    if args.actor_update:
        return run_actor(args)
    if args.compile_cost:
        return run_compile_cost(args)
    if args.memory_check:
        return run_memory_check(args)
    if args.verl_zero:
        return run_zero_shares(args)
    if args.lengths:
        return run_lengths(args)
    config = config_from_args(args)
    warning = bf16_emulation_warning(resolve_device(config.device), config.dtype)
    if warning:
        _progress(f"warning: {warning}")
    if config.ceilings:
        return run_frontier_command(config, args.output)
    output = Path(args.output or RESULTS_DIR / f"bench-{_slug(config.model)}-T{config.seq_len}.json")
    result = run_bench(config, _progress)
    report = summarise(result)
    print(format_table(report))
    print("targets (paper, at 1.10 x GC's peak):")
    print(format_targets(report))
    _write_results(report, output, to_json, save_png, result.run_dir)
    return 1 if any(r.status != "ok" for r in result.runs) else 0


def _write_results(report, path: Path, to_json, save_png, run_dir: str | None) -> None:
    """Save a report's JSON, stamped with the command that made it, and its PNG beside it;
    say where they (and any kept logs) are."""
    from ..jsonio import write_json_atomic

    print(f"results: {write_json_atomic(path, {**to_json(report), 'command': _command()})}")
    png = save_png(report, path.with_suffix(".png"))
    print(f"plot: {png}" if png else "plot: skipped (pip install matplotlib)")
    if run_dir:
        print(f"a run failed; worker logs kept in {run_dir}")


def run_frontier_command(config: "BenchConfig", output: str | None) -> int:
    """``--ceilings``: run the frontier, print its tables, save the JSON and the PNG."""
    from ..bench.frontier import run_frontier
    from ..bench.frontier_report import format_ceiling_table, format_points_table, summarise_frontier, to_json
    from ..bench.plot import save_frontier_png

    dtype = "" if config.dtype == "float32" else f"-{config.dtype}"
    path = Path(output or RESULTS_DIR / f"frontier-{_slug(config.model)}-T{config.seq_len}{dtype}.json")
    result = run_frontier(config, _progress)
    report = summarise_frontier(result)
    print(format_ceiling_table(report))
    print()
    print(format_points_table(report))
    _write_results(report, path, to_json, save_frontier_png, result.run_dir)
    return 1 if any(p.status == "failed" for p in result.points) else 0
