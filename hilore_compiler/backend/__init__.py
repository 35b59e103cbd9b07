"""The ``hilore`` torch.compile backend.

Modules, in the order a compile meets them:

- ``options``     ``BackendOptions``: what ``options={...}`` may say.
- ``shapes``      which input carries a graph's (batch, sequence); static or dynamic.
- ``cachekey``    the plan cache's keys: graph, inputs, compiler settings, versions, options.
- ``cache``       ``PlanCache``: cached plans and traces, moved aside when they do not fit.
- ``planning``    where a graph's plan comes from (given, cached, solved now).
- ``partitioner`` the custom partitioner Inductor calls: plan, apply, min-cut.
- ``compiler``    ``HiLoReBackend``: one Inductor variant per distinct bucket plan.
- ``variants``    which variant runs each (length, exposure) bucket; a dynamic graph's
                  re-solves for lengths outside its plans.
- ``runtime``     ``exposure(bucket)``: which compiled variant runs.

``torch.compile(model, backend="hilore")`` resolves to ``hilore_backend``
through the ``torch_dynamo_backends`` entry point.
"""

from .compiler import LAST_BACKENDS, CompiledGraph, HiLoReBackend, hilore_backend
from .options import BackendOptions
from .runtime import current_bucket, exposure

__all__ = ["BackendOptions", "CompiledGraph", "HiLoReBackend", "LAST_BACKENDS", "current_bucket",
           "exposure", "hilore_backend"]
