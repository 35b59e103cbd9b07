"""Exposure buckets: ranges of exposure that share one compiled variant.

Bucket ``"zero"`` holds samples whose exposure is exactly 0 (all c_t = 0, e.g.
a group with equal rewards and no KL term): they need no backward at all.
The nonzero exposures are split at quantiles into ``"b0"`` (lowest) ...
``"b{n-1}"`` (highest), so each bucket gets about the same number of samples.
Names, the interval rule ``(lo, hi]`` and the plan <-> batch exposure units
come from ``hilore_compiler.vocabulary``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..jsonio import FormatError, require
from ..vocabulary import ZERO_BUCKET, bucket_name, bucket_names, to_batch_exposure

BUCKETS_SCHEMA = "hilore.buckets/v1"
#: The zero bucket's name (``vocabulary.ZERO_BUCKET``), kept under its old name here.
ZERO = ZERO_BUCKET


@dataclass(frozen=True, slots=True)
class ExposureBuckets:
    """Where each nonzero bucket starts and ends, and the bucket names."""

    #: n + 1 ascending exposures: min, the n - 1 inner quantiles, max of the
    #: nonzero exposures they were made from. Bucket ``b{i}`` covers
    #: (edges[i], edges[i + 1]]; values outside [min, max] go to the end buckets.
    edges: tuple[float, ...]
    #: ``("zero", "b0", ..., "b{n-1}")``.
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.names) - 1
        if n < 1 or self.names != bucket_names(n):
            raise ValueError(f"names must be ('zero', 'b0', ...), got {self.names}")
        if len(self.edges) != n + 1 or any(a > b for a, b in zip(self.edges, self.edges[1:])):
            raise ValueError(f"need {n + 1} ascending edges for {n} buckets, got {self.edges}")

    @property
    def n_buckets(self) -> int:
        """Number of nonzero buckets."""
        return len(self.names) - 1

    def upper(self, name: str) -> float:
        """Largest exposure seen in bucket ``name`` (0 for ``"zero"``): what risk is charged at."""
        return 0.0 if name == ZERO else self.edges[self.names.index(name)]

    def assign(self, exposures: Tensor) -> list[str]:
        """Bucket name of each sample: (B,) exposures -> B names."""
        x = exposures.detach().to("cpu", torch.float64).reshape(-1)  # (B,)
        inner = torch.tensor(self.edges[1:-1], dtype=torch.float64)  # (n - 1,)
        # (lo, hi]: the number of inner edges strictly below x is x's bucket; an
        # infinite exposure (no bound before the forward) lands in the top one.
        index = torch.searchsorted(inner, x, right=False)  # (B,)
        # Exactly zero, not "small": only then is skipping the backward exact.
        return [ZERO if v == 0.0 else bucket_name(i) for v, i in zip(x.tolist(), index.tolist())]

    def to_json(self) -> dict[str, Any]:
        return {"schema": BUCKETS_SCHEMA, "edges": list(self.edges), "names": list(self.names)}

    @classmethod
    def from_json(cls, payload: dict[str, Any], where: str = "buckets") -> ExposureBuckets:
        if payload.get("schema") != BUCKETS_SCHEMA:
            raise FormatError(
                f"{where}: schema is {payload.get('schema')!r}, expected {BUCKETS_SCHEMA!r}"
            )
        edges = require(payload, "edges", list, where)
        names = require(payload, "names", list, where)
        if not all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in edges):
            raise FormatError(f"{where}.edges: expected numbers, found {edges!r}")
        try:
            return cls(edges=tuple(float(e) for e in edges), names=tuple(str(n) for n in names))
        except ValueError as e:
            raise FormatError(f"{where}: {e}") from e


def exposure_buckets(exposures: Tensor, n_buckets: int) -> ExposureBuckets:
    """Buckets whose edges are the 0, 1/n, ..., 1 quantiles of the nonzero ``exposures`` (B,).

    With no nonzero exposure at all every edge is 0: any later nonzero sample
    then lands in the top bucket, the highest-fidelity one, which is safe.
    """
    if n_buckets < 1:
        raise ValueError(f"n_buckets must be >= 1, got {n_buckets}")
    x = exposures.detach().to("cpu", torch.float64).reshape(-1)
    # Unbounded (inf) exposures go to the top bucket whatever the edges; they
    # would make the quantiles infinite.
    nonzero = x[(x != 0.0) & torch.isfinite(x)]
    if nonzero.numel() == 0:
        return ExposureBuckets(edges=(0.0,) * (n_buckets + 1), names=bucket_names(n_buckets))
    q = torch.linspace(0.0, 1.0, n_buckets + 1, dtype=torch.float64)
    edges = torch.quantile(nonzero, q).tolist()
    # Interpolated quantiles are monotone in exact arithmetic; make sure of it.
    edges = [max(edges[: i + 1]) for i in range(len(edges))]
    return ExposureBuckets(edges=tuple(edges), names=bucket_names(n_buckets))


def plan_buckets(plan: Any, num_sequences: int) -> ExposureBuckets:
    """The plan's exposure buckets in the units of this batch's exposures
    (``vocabulary.to_batch_exposure``: the plan's edges divided by N)."""
    solved = sorted((b.bucket for b in plan.buckets if not b.skip), key=lambda s: s.lo)
    if [s.name for s in solved] != list(bucket_names(len(solved))[1:]):
        raise ValueError(f"plan buckets must be b0..b{len(solved) - 1}, got {[s.name for s in solved]}")
    inner = [to_batch_exposure(s.hi, num_sequences) for s in solved[:-1]]
    return ExposureBuckets(edges=(0.0, *inner, float("inf")), names=bucket_names(len(solved)))
