"""How each benchmarked method turns the policy into a compiled model.

Every method compiles the same policy with ``torch.compile``; they differ only
in what the backward pass gets to keep:

- ``store-all``: Inductor defaults (its min-cut partition), the speed ceiling.
- ``gc``: ``torch.utils.checkpoint`` (non-reentrant) around every decoder layer.
- ``gc-eager``: the same, not compiled (``--memory-check`` only: the eager
  trainer's GC, against which a compiled step is often measured).
- ``sac``: selective activation checkpointing as torchtitan does it: inside
  each layer, matmul and attention outputs are saved, the rest recomputed.
- ``sac-op``: torchtitan's op-level selective AC, its real policy
  (``checkpointing.op_selective_context_fn``): as ``sac``, but every second
  ``aten.mm`` of a layer is recomputed, not saved.
- ``sac-layer2``: torchtitan's layer-level selective AC at frequency 2: every
  second decoder layer (1, 3, ...: torchtitan counts layers from 1 and wraps
  a multiple of the frequency) under ``gc``'s checkpoint, the others as
  store-all.
- ``gc-int8``: GC whose checkpoints, each layer's input hidden states, are
  kept int8 (``checkpointing.Int8Checkpointed``: reentrant-style, the layers
  compiled one by one and the model between them, with a graph break
  around each layer).
- CUDA only: ``gc-offload``, GC with its checkpoints in pinned host memory, and
  ``sac-offload``, ``sac-op`` saving to the host (``offload.py``); ``sac-milp``,
  PyTorch's ``sac_milp`` planned at ``hilore_budget`` (``sac_milp.py``).
- ``pt-budget`` and its solver variants (``pt-budget-greedy``, ``-ilp``,
  ``-knee``, ``-profile``), and ``inductor-fp8``: the planners that ship with
  PyTorch (``peers.py``): plain ``torch.compile`` under the config patch that
  selects them, their knob (the memory budget, fp8's size threshold) searched
  by the runner, per ceiling on the frontier.
- ``uniform-int8``: the hilore backend with a plan that compresses every
  recovery unit int8 can encode and stores the rest: compression without
  exposure or cost awareness.
- ``int8-recompute``: uniform int8 made to fit a budget: the hilore backend
  solving one plan (one bucket, exposure ignored) with int8 the only codec
  and no error budget (``UNBOUNDED_RISK``), so it recomputes what int8 alone
  cannot fit. Storing stays open: recomputation never reads a compressed
  input, so what a recomputed unit reads is stored or recomputed itself.
  It plans from HiLoRe's trace (``trace_codecs``), so both weigh the same
  measured costs.
- ``hilore``: the hilore backend, solving its own plan at ``1.10x-gc``, a
  multiple of ``gc``'s measured peak when ``gc`` ran first (the runner's),
  else of GC's predicted peak.
- ``hilore-blind``: the same backend, budget and codecs with one exposure
  bucket: int8/bf16 compression mixed with recompute, blind to exposure;
  the strongest exposure-blind competitor at HiLoRe's memory.

- ``paper``: the paper authors' reference runtime (``ChnIRuI/HiLoRe``) in our own code
  (``bench/paper/``), eager: every decoder layer kept (H), kept with one MLP tensor in fp8 (L) or
  recomputed (R), chosen per step after the loss from the GRPO coefficients by a dynamic
  program over measured per-layer costs, at ``hilore_budget`` of GC's measured peak. Its
  profiling and calibration run in the worker's set-up (``PreparedMethod.profile``).

``sac-op``, ``sac-layer2``, ``gc-int8``, ``int8-recompute``, ``paper`` and the CUDA-only peers run only
when named with ``--methods``.

The token log-probs and the GRPO loss run eagerly after the compiled policy,
as ``grpo.actor_update`` runs them, identically for every method, except in
the step methods, which compile the whole actor step as one graph
(``grpo.compiled_step``: forward, fp32 log-probs, loss) and are only run when
named with ``--methods``:

- ``gc-chunked``: ``gc`` plus chunked log-probs (``chunk_tokens`` tokens at a
  time under checkpoint, so no (B, T, V) logits tensor is alive), no planning.
- ``hilore-step``: the hilore backend on the whole step with log-probs in
  chunks of the same size, not checkpointed: the planner decides per chunk
  whether backward gets its logits stored or recomputed, and spends what
  recomputing them frees on the layers' activations; its ``x-gc`` budget is
  a multiple of ``gc-chunked``'s measured peak (the runner's), the baseline
  it competes with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..planfile import Plan
from . import offload, peers, sac_milp
from .checkpointing import op_selective_context_fn, selective_context_fn, wrap_layers, wrap_layers_int8

#: Method names in the order they are set up (``hilore`` before
#: ``uniform-int8``, which reuses the trace the hilore worker cached, and
#: before ``pt-budget``, whose budget is searched to match HiLoRe's peak).
METHODS = ("store-all", "gc", "gc-eager", "sac", "sac-op", "sac-layer2", "gc-int8", *offload.METHODS, "hilore",
           "hilore-blind", "uniform-int8", "int8-recompute", "paper", sac_milp.METHOD, *peers.SEARCHED, "gc-chunked",
           "hilore-step")

#: Methods that refuse a CPU device, each saying why when prepared.
CUDA_ONLY = (*offload.METHODS, sac_milp.METHOD, *(m for m, s in peers.PT_BUDGETS.items() if s.needs_cuda))

#: Methods that run the whole actor step compiled as one graph (``grpo.compiled_step``).
STEP_METHODS = ("gc-chunked", "hilore-step")

#: ``hilore bench``'s methods when none are named: the step methods, the
#: torchtitan/int8 checkpointing baselines and ``int8-recompute`` only by name.
DEFAULT_METHODS = ("store-all", "gc", "sac", "hilore", "hilore-blind", "uniform-int8", "pt-budget")

#: How the report names each method.
LABELS = {
    "store-all": "store-all",
    "gc": "GC",
    "gc-eager": "GC, eager",
    "sac": "selective AC",
    "sac-op": "selective AC (op, torchtitan)",
    "sac-layer2": "selective AC (every 2nd layer)",
    "gc-int8": "GC + int8 checkpoints",
    **offload.LABELS,
    sac_milp.METHOD: sac_milp.LABEL,
    **peers.LABELS,
    "uniform-int8": "uniform int8",
    "int8-recompute": "int8 + recompute",
    "hilore": "HiLoRe",
    "hilore-blind": "HiLoRe blind",
    "paper": "paper (reference runtime)",
    "gc-chunked": "GC + chunked log-probs",
    "hilore-step": "HiLoRe whole step",
}

#: Methods that run the hilore backend (and so pick an exposure bucket).
HILORE_BACKENDS = ("hilore", "hilore-blind", "uniform-int8", "int8-recompute", "hilore-step")

#: Methods whose plan is one bucket for every batch, exposure ignored.
ONE_BUCKET = ("hilore-blind", "int8-recompute")

#: ``int8-recompute``'s bound on the update's squared relative gradient error:
#: a relative error of 1 never binds, so like ``uniform-int8`` it compresses
#: blind to error.
UNBOUNDED_RISK = 1.0

#: Exposure buckets of ``hilore-blind``: one plan for every batch, exposure ignored.
BLIND_BUCKETS = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class MethodOptions:
    """What the methods need besides the model; the same for every worker of a run."""

    #: HiLoRe's memory budget (``"1.10x-gc"``: the paper's ceiling).
    hilore_budget: str = "1.10x-gc"
    #: Codecs HiLoRe's plan may use.
    hilore_codecs: tuple[str, ...] = ("bf16", "int8")
    #: HiLoRe's error budget (``solver.parse_risk_budget``); None: the default, cos >= 0.999.
    hilore_risk_budget: str | None = None
    #: Non-zero exposure buckets of HiLoRe's plan.
    hilore_buckets: int = 3
    #: Where the hilore backend caches traces and plans; shared by the workers
    #: of one run so that ``uniform-int8`` reuses the trace ``hilore`` made.
    hilore_cache_dir: str = ""
    #: The codec of the ``uniform-int8`` baseline.
    uniform_codec: str = "int8"
    #: ``activation_memory_budget`` of ``pt-budget`` and its variants in [0, 1]; set per worker.
    activation_memory_budget: float | None = None
    #: ``inductor-fp8``'s ``size_in_mb``: saved activations of at least this many MiB go fp8.
    fp8_size_mb: float | None = None
    #: Print the hilore backend's planning messages (into the worker's log).
    verbose: bool = True
    #: The loss's peak over the logits' bytes (``measure.loss_side``), which
    #: HiLoRe's memory model adds to the step; the worker measures it.
    loss_ratio: float | None = None
    #: The hilore workers measure the loss's peak (``loss_ratio``) before
    #: planning; False leaves it to the backend's model (a zero-config compile).
    measure_loss: bool = True
    #: GC's measured peak (bytes): ``x-gc`` budgets are multiples of it; None:
    #: of GC's predicted peak. The runner sets it from the warm-up of the GC
    #: that runs the same step (``launcher.REFERENCE_GC``): ``gc`` for ``hilore``
    #: and ``hilore-blind``, ``gc-chunked`` for ``hilore-step``.
    gc_peak_bytes: int | None = None
    #: Tokens per chunk of ``gc-chunked``'s log-probs: with a 128k vocabulary
    #: one chunk's fp32 logits are 128 * 128256 * 4 B = 66 MB.
    chunk_tokens: int = 128
    #: Chunk sizes ``hilore-step`` chooses among (``grpo.choose_chunk_tokens``:
    #: priced by the memory model, the fitting ones timed); empty: it runs
    #: ``chunk_tokens``, as ``gc-chunked`` does. ``(0,)``: the default candidates.
    step_chunks: tuple[int, ...] = ()
    #: ``paper``'s calibration microbatches (the reference's 16).
    paper_calibration_microbatches: int = 16
    #: ``paper``'s timed steps per profiled plan, after one warm-up (the reference's 5).
    paper_repeats: int = 5

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> MethodOptions:
        """Inverse of ``dataclasses.asdict`` (JSON turns tuples into lists)."""
        return cls(**{**obj, "hilore_codecs": tuple(obj["hilore_codecs"]),
                      "step_chunks": tuple(obj.get("step_chunks", ()))})


@dataclass(slots=True, kw_only=True)
class PreparedMethod:
    """A compiled policy and what its first call must run under."""

    name: str
    #: ``policy(input_ids (B, T)) -> logits (B, T, V)``, compiled lazily by torch.compile.
    policy: Callable[[torch.Tensor], torch.Tensor]
    #: Context for the first call, where dynamo, AOTAutograd and Inductor run.
    compile_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    #: The hilore backend object, for its plan and partition records.
    backend: Any = None
    #: Step methods: the compiled ``step(input_ids, old_logprobs, advantages,
    #: mask) -> loss`` that replaces ``policy`` plus the eager loss.
    step: Callable[..., torch.Tensor] | None = None
    #: What the method decided, for the worker's record, read after the first call (``sac-milp``'s plan).
    record: Callable[[], dict[str, Any]] = dict
    #: Called by the step between the loss and backward, ``before_backward(logprobs (B, T-1),
    #: data, loss_config)`` (``paper``: selects each layer's recovery from the loss's coefficients).
    before_backward: Callable[[torch.Tensor, Any, Any], None] | None = None
    #: Run by the worker's set-up before the first call, ``profile(step, data, batch)``: ``step(d)``
    #: runs one step on a batch ``d``, ``data`` is the bench's batch, ``batch(k)`` a k-th batch of
    #: other seeds (``paper``: its profiling and calibration).
    profile: Callable[[Callable[[Any], None], Any, Callable[[int], Any]], None] | None = None


def uniform_plan(trace: Any, codec: str, loss_ratio: float | None = None, **terms: Any) -> Plan:
    """A plan with ``compress:<codec>`` on every unit where the codec is usable, else ``store``.

    One bucket (one compiled variant): the decisions ignore exposure and cost.
    ``solver.fixed`` checks them against the rules and predicts their bytes
    (with the loss's peak, ``loss_ratio``, as HiLoRe's plans are). ``terms``
    go to ``fixed_plan`` too (``codecs``, ``exposure_mix``,
    ``accumulate_gradients``: the actor bench predicts its peak as it does
    the solved plans').
    """
    from ..solver import fixed_plan, uniform_codec

    return fixed_plan(trace, uniform_codec(codec), buckets=1, label=f"uniform-{codec}", loss_ratio=loss_ratio,
                      **terms)


class UniformCodecBackend:
    """A dynamo backend: the hilore backend with ``uniform_plan`` of the graph's trace.

    The trace is the one the hilore planner caches for the same graph and
    codecs (``planning.trace_key``), so with a shared cache directory it is
    the trace the hilore worker already made, even when HiLoRe's own solve
    failed.
    """

    def __init__(self, options: dict[str, Any], codec: str) -> None:
        from ..backend import BackendOptions, HiLoReBackend

        self.options = BackendOptions.from_mapping(options)
        self.codec = codec
        self.inner = HiLoReBackend(self.options)

    @property
    def graphs(self) -> list:
        return self.inner.graphs

    def _trace(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from ..backend.cache import PlanCache
        from ..backend.planning import graph_shape, trace_graph, trace_key

        key = trace_key(gm, example_inputs, self.options)
        cache = PlanCache.open(self.options.cache_dir, key, self.options, trace_key=key)
        trace = cache.load_trace()
        if trace is None:
            trace = trace_graph(gm, example_inputs, self.options, *graph_shape(example_inputs),
                                name=f"graph-{key[:8]}")
            cache.save_trace(trace)
        return trace

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        plan = uniform_plan(self._trace(gm, example_inputs), self.codec, self.options.loss_ratio)
        self.inner.options = dataclasses.replace(self.options, plan=plan)
        return self.inner(gm, example_inputs)


def _hilore_options(options: MethodOptions, buckets: int | None = None) -> dict[str, Any]:
    # strict: a plan that does not fit, or fails to compile, raises in the
    # worker (with the smallest feasible budget) instead of falling back to
    # Inductor's partition, which a bench would measure as the method.
    return {"memory_budget": options.hilore_budget, "codecs": options.hilore_codecs,
            "risk_budget": options.hilore_risk_budget,
            "buckets": options.hilore_buckets if buckets is None else buckets,
            "cache_dir": options.hilore_cache_dir, "verbose": options.verbose, "strict": True,
            "loss_ratio": options.loss_ratio, "gc_peak_bytes": options.gc_peak_bytes}


def backend_options(name: str, options: MethodOptions) -> dict[str, Any]:
    """The hilore backend options method ``name`` (one of ``HILORE_BACKENDS``) compiles with;
    ``hilore eval`` trains its arms under the same ones."""
    if name not in HILORE_BACKENDS:
        raise ValueError(f"{name!r} does not run the hilore backend; those that do: {', '.join(HILORE_BACKENDS)}")
    hilore = _hilore_options(options, BLIND_BUCKETS if name in ONE_BUCKET else None)
    if name == "int8-recompute":
        hilore.update(codecs=(options.uniform_codec,), risk_budget=UNBOUNDED_RISK)
        if options.uniform_codec in options.hilore_codecs:
            # HiLoRe's trace: both plans then weigh the same measured costs.
            hilore.update(trace_codecs=tuple(options.hilore_codecs))
    return hilore


def _prepare_step(name: str, model: nn.Module, options: MethodOptions, loss_config: Any) -> PreparedMethod:
    from ..grpo import compiled_step

    if name == "gc-chunked":
        step = compiled_step(wrap_layers(model), loss_config, backend="inductor",
                             chunk_tokens=options.chunk_tokens)
        return PreparedMethod(name=name, policy=model, step=step)
    from ..backend import HiLoReBackend

    backend = HiLoReBackend(_hilore_options(options))
    step = compiled_step(model, loss_config, backend=backend, chunk_tokens=options.chunk_tokens,
                         checkpoint_chunks=False)
    return PreparedMethod(name=name, policy=model, step=step, backend=backend)


def tuned_step(model: nn.Module, options: MethodOptions, loss_config: Any, batch: Sequence[torch.Tensor],
               progress: Callable[[str], None] | None = None) -> tuple[PreparedMethod, dict[str, Any]]:
    """``hilore-step`` with its chunk size chosen among ``options.step_chunks`` on ``batch``
    (compiles every fitting candidate); the prepared method and the choice's record."""
    from ..grpo import choose_chunk_tokens

    candidates = None if options.step_chunks == (0,) else options.step_chunks
    choice = choose_chunk_tokens(model, loss_config, batch, options=_hilore_options(options),
                                 candidates=candidates, progress=progress)
    prepared = PreparedMethod(name="hilore-step", policy=model, step=choice.step, backend=choice.backend)
    return prepared, choice.to_json()


def _prepare_paper(model: nn.Module, options: MethodOptions) -> PreparedMethod:
    """``paper``, eager, at HiLoRe's memory budget and error budget (as a relative L2 error)."""
    from ..solver.risk import parse_risk_budget
    from .paper import PaperConfig, PaperMethod

    config = PaperConfig(memory_budget=options.hilore_budget, gc_peak_bytes=options.gc_peak_bytes,
                         risk_budget=math.sqrt(parse_risk_budget(options.hilore_risk_budget)),
                         calibration_microbatches=options.paper_calibration_microbatches,
                         repeats=options.paper_repeats)
    method = PaperMethod(model, config)
    return PreparedMethod(name="paper", policy=method.policy, before_backward=method.before_backward,
                          profile=method.profile, record=method.record)


def prepare_method(name: str, model: nn.Module, options: MethodOptions, loss_config: Any = None) -> PreparedMethod:
    """Wrap and ``torch.compile`` ``model`` (in place) the way method ``name`` runs it.

    ``loss_config`` (a ``GRPOConfig``) is needed by the ``STEP_METHODS`` only,
    whose compiled step includes the loss.
    """
    if name in STEP_METHODS:
        return _prepare_step(name, model, options, loss_config)
    if name == "store-all":
        return PreparedMethod(name=name, policy=torch.compile(model))
    if name == "gc":
        return PreparedMethod(name=name, policy=torch.compile(wrap_layers(model)))
    if name == "gc-eager":
        return PreparedMethod(name=name, policy=wrap_layers(model))
    if name == "sac":
        return PreparedMethod(name=name, policy=torch.compile(wrap_layers(model, selective_context_fn())))
    if name == "sac-op":
        return PreparedMethod(name=name, policy=torch.compile(wrap_layers(model, op_selective_context_fn())))
    if name == "sac-layer2":
        return PreparedMethod(name=name, policy=torch.compile(wrap_layers(model, every=2)))
    if name == "gc-int8":
        return PreparedMethod(name=name, policy=torch.compile(wrap_layers_int8(model)))
    if name in offload.METHODS:
        policy, context = offload.prepare(name, model)
        return PreparedMethod(name=name, policy=policy, compile_context=context)
    if name == sac_milp.METHOD:
        policy = sac_milp.prepare(model, options.hilore_budget, options.gc_peak_bytes, loss_config)
        return PreparedMethod(name=name, policy=policy, record=policy.record)
    if name == "paper":
        return _prepare_paper(model, options)
    if name in peers.SEARCHED:
        # The config patch is read when the first call compiles; it is per
        # process anyway, as every method runs in its own.
        knob = getattr(options, peers.knob_name(name))
        device = next(model.parameters()).device
        return PreparedMethod(name=name, policy=torch.compile(model),
                              compile_context=peers.compile_context(name, knob, device))
    if name in HILORE_BACKENDS:
        from ..backend import HiLoReBackend

        hilore = backend_options(name, options)
        backend = (UniformCodecBackend(hilore, options.uniform_codec) if name == "uniform-int8"
                   else HiLoReBackend(hilore))
        return PreparedMethod(name=name, policy=torch.compile(model, backend=backend), backend=backend)
    raise ValueError(f"unknown method {name!r}; methods: {', '.join(METHODS)}")
