"""The keys of the zero-config plan cache: everything that shapes a graph's joint graph or its costs.

A cached plan is reused only where it was made for the same joint graph with
the same costs. Besides dynamo's graph code, the input shapes, dtypes and
devices and the planning options, that is: hilore's code and version,
torch's version, the default dtype, and the Inductor and functorch settings
(decompositions, RNG handling such as ``fallback_random``, partitioning,
custom joint-graph passes). Flipping any of them makes a new key, so a plan
whose units are not in the new joint graph is never served.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .options import BackendOptions
from .shapes import graph_shape, is_dynamic

#: Bumped when traces or plans made by older code must not be reused.
CACHE_VERSION = "4"

#: Settings the backend sets itself for each compile (the partitioner), or
#: that name where logs go: not part of what the user configured.
_OWN_SETTINGS = ("custom_partitioner_fn",)

#: Joint-graph passes a user may install: their identity (``uuid()``) is keyed,
#: since they rewrite the graph the plan is made on.
_CUSTOM_PASSES = ("joint_custom_pre_pass", "joint_custom_post_pass", "post_grad_custom_pre_pass",
                  "post_grad_custom_post_pass", "pre_grad_custom_pass")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """Hash of hilore's own source: a cached plan made by other code is stale."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def hilore_version() -> str:
    """The installed package's version ("unknown" when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hilore-compiler")
    except PackageNotFoundError:
        return "unknown"


def _canonical(value: Any) -> Any:
    """``value`` as JSON that is the same in every process (sets sorted, objects by type)."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(str(_canonical(v)) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    uuid = getattr(value, "uuid", None)
    # An object's repr may hold its address: key its class (and its own identity if it has one).
    return f"{type(value).__module__}.{type(value).__qualname__}:{uuid() if callable(uuid) else ''}"


def compiler_settings() -> dict[str, Any]:
    """The Inductor and functorch settings in force, as canonical JSON.

    Their "portable" views leave out what names files and workers (log and
    cache folders, compile threads); custom passes are keyed by identity.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    settings = {f"inductor.{k}": v for k, v in inductor_config.save_config_portable().items()}
    settings.update({f"functorch.{k}": v for k, v in functorch_config.save_config_portable().items()})
    for name in _OWN_SETTINGS:
        settings.pop(f"inductor.{name}", None)
    for name in _CUSTOM_PASSES:
        settings[f"inductor.{name}"] = getattr(inductor_config, name, None)
    return _canonical(settings)


def environment() -> list[Any]:
    """Versions and global settings that change a joint graph or its costs, for every key."""
    return [CACHE_VERSION, code_digest(), hilore_version(), torch.__version__, str(torch.get_default_dtype()),
            torch.are_deterministic_algorithms_enabled(), compiler_settings()]


def planning_options(options: BackendOptions) -> list[Any]:
    """The options that tracing and solving read: what a plan depends on besides the graph."""
    return [options.memory_budget, options.risk_budget, list(options.codecs), list(options.profiled_codecs),
            options.cost_model, options.buckets, options.loss_ratio, options.gc_peak_bytes, options.max_seq_len,
            options.min_seq_len, options.length_mix, options.length_buckets]


def cache_key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> str:
    """Key of a zero-config plan: graph, inputs, environment and the options planning reads."""
    return _key(gm, example_inputs, planning_options(options))


def trace_key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> str:
    """Key of a zero-config trace: ``cache_key`` without the options that only the solver reads.

    Plans for other budgets, buckets or loss sides of the same graph are
    solved from one trace, so they weigh the same measured costs: profiling
    again would give each plan its own timing noise (a 2-core CPU's spread
    moves decisions between near-equal options).
    """
    return _key(gm, example_inputs, ["trace", list(options.profiled_codecs), options.cost_model])


def _key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: list[Any]) -> str:
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    # Dtype and device of every input: they change the joint graph's
    # decompositions (autocast, fused kernels) and every measured cost.
    kinds = [(str(x.dtype), str(x.device)) for x in tensors]
    shapes: list[Any] = [tuple(x.shape) for x in tensors]
    if is_dynamic(example_inputs):
        # The symbolic shapes, and the call's sizes that costs are measured at.
        symbolic = [str(getattr(n.meta.get("example_value"), "shape", n.meta.get("example_value")))
                    for n in gm.graph.nodes if n.op == "placeholder"]
        shapes = [symbolic, graph_shape(example_inputs)]
    text = json.dumps([environment(), gm.code, repr(shapes), kinds, options], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def structure_key(gm: fx.GraphModule, example_inputs: Sequence[Any], options: BackendOptions) -> str:
    """Key of a graph's structure, the same on every rank that compiles "the same graph".

    The plan cache's keys name the device (``cuda:0`` on rank 0, ``cuda:1`` on
    rank 1) and the sizes (each rank packs its own micro-batch lengths, and
    dynamo compiles the first length static, the next ones symbolic), so
    they differ across ranks. This key keeps what decides the recovery units
    and their costs per token: the ops and how they connect, constants other
    than integers (an integer may be a size), the inputs' dtypes, device
    types and ranks (number of dims), whether the graph is dynamic and
    whether it records gradients (an evaluation graph of the same code is
    never planned), the environment and the planning options; sizes
    (integers and SymInt values) all read ``"size"``. A static and a dynamic
    graph of one block differ: a static graph's trace has its sizes as
    numbers, a dynamic one's as expressions of batch and sequence that hold
    at every length.
    """
    kept: dict[fx.Node, int] = {}
    nodes = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        if node.op != "output" and not _holds_tensor(value):
            continue  # a size, a shape check: what it computes is a size
        if node.op == "placeholder":
            entry: Any = ["input", str(value.dtype), value.device.type, value.dim()]
        else:
            target = node.target if isinstance(node.target, str) else _target_name(node.target)
            entry = [node.op, target, _structure(node.args, kept), _structure(node.kwargs, kept)]
        kept[node] = len(kept)
        nodes.append(entry)
    flags = [is_dynamic(example_inputs), torch.is_grad_enabled()]
    text = json.dumps([environment(), nodes, flags, planning_options(options)], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _holds_tensor(value: Any) -> bool:
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))


def _target_name(target: Any) -> str:
    """A callable's qualified name: the same in every process (its repr may hold an address)."""
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', str(target))}"


def _structure(value: Any, kept: dict[fx.Node, int]) -> Any:
    """An argument with graph values as their index and every integer or size as ``"size"``."""
    if isinstance(value, fx.Node):
        return ["node", kept[value]] if value in kept else "size"
    if isinstance(value, (list, tuple)):
        return [_structure(v, kept) for v in value]
    if isinstance(value, dict):
        return {str(k): _structure(v, kept) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, slice):
        return ["slice", *(_structure(v, kept) for v in (value.start, value.stop, value.step))]
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return "size"
    if value is None or isinstance(value, (bool, float, str)):
        return value
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)) or value is Ellipsis:
        return str(value)
    return _target_name(value) if callable(value) else type(value).__qualname__
