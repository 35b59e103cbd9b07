"""HiLoRe: what to store, compress or recompute for efficient GRPO training.

A profiling-then-planning compiler pass over torch.compile graphs. Modules in
pipeline order:

- ``models/``        built-in Llama- and GPT-style policies (random weights); ``models/hf_config``:
  Hugging Face causal LMs from a config alone (``--model hf:...``), LoRA by PEFT.
- ``passes/capture`` the joint graph Inductor hands its partitioner, and what min-cut saves.
- ``passes/annotate`` saved activations -> recovery units with stable keys.
- ``blockclasses``   layers alike up to the layer index (``passes/classes``: found on the
  graph, one layer profiled per class; ``solver/tying``: decided by a few shared patterns).
- ``passes/profile`` each unit's cost to store, compress or recompute (``passes/costmodel``: rooflines
  of the cards in ``devices``).
- ``passes/tracer``  the above as ``trace()`` -> ``Trace`` (``tracefile``: JSON).
- ``sizeexpr``       sizes of B and S: a whitelisted grammar, parsed with ast, never eval'd.
- ``validate``       one pass over a loaded trace or plan before anything plans with it.
- ``passes/calibration`` measured gradient sensitivity per (unit kind, codec).
- ``vocabulary``     the shared words: options, bucket names and interval rule, exposure units.
- ``solver/``        the ILP over exposure buckets (PuLP + CBC) -> ``Plan`` (``planfile``);
  ``solver/lengths``: plans over a range of sequence lengths; ``solver/timeline``: the
  predicted memory phase by phase; ``solver/devicefit``: peak + training state against a card.
- ``passes/apply``   tag MUST_SAVE / MUST_RECOMPUTE, insert codec encode/decode;
  ``passes/partition``: apply, then min-cut.
- ``backend/``       ``torch.compile(model, backend="hilore")``: options, planning (given,
  cached, or made on the joint graph; static or dynamic), plan matching, the partitioner
  Inductor calls per bucket, ``variants`` per length and exposure bucket, and ``runtime``'s
  ``exposure(bucket)``.
- ``grpo/``          GRPO loss, token coefficients, exposure, buckets, actor update.
- ``bench/``, ``evaluation/``  throughput/memory benchmark and fidelity checks.
- ``distributed/``   per-block compile (``compile_blocks``), FSDP2, one plan on every rank.
- ``codecs/``        bf16, int8, fp8: eager reference and FX graph builders.
- ``progress``       a progress line every few seconds for planning steps that take seconds.
- ``cli``            the ``hilore`` command.

Public API: ``trace``, ``solve``, ``exposure``, ``load_trace``, ``load_plan``,
``HiLoReBackend``, ``compile_blocks``. Heavy modules load on first use, so ``import hilore_compiler``
is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "trace": ("hilore_compiler.passes.tracer", "trace"),
    "TraceConfig": ("hilore_compiler.passes.tracer", "TraceConfig"),
    "solve": ("hilore_compiler.solver", "solve"),
    "exposure": ("hilore_compiler.backend.runtime", "exposure"),
    "load_trace": ("hilore_compiler.tracefile", "load_trace"),
    "load_plan": ("hilore_compiler.planload", "load_plan"),
    "Trace": ("hilore_compiler.tracefile", "Trace"),
    "Plan": ("hilore_compiler.planfile", "Plan"),
    "HiLoReBackend": ("hilore_compiler.backend", "HiLoReBackend"),
    "calibrate": ("hilore_compiler.passes.calibration", "calibrate"),
    "compile_blocks": ("hilore_compiler.distributed.blocks", "compile_blocks"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hilore_compiler' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)
