"""What verl's engine needs to drop zero-exposure samples and pack the rest itself.

``HiLoReFSDPEngine`` replaces verl's ``prepare_micro_batches`` by
``grpo.packing.drop_then_pack`` where that leaves the update exact; this
module holds the verl side of it, apart from the engine:

- ``skip_is_exact`` / ``drop_is_exact``: when a zero-advantage sample adds
  exactly nothing, and when its absence from a micro-batch changes no other
  sample's weight (every normaliser global, as verl's engine sets them);
- ``pack_budget``: verl's own budget, tokens per micro-batch under
  ``use_dynamic_bsz`` (the same per-sample token count verl balances) or
  samples per micro-batch;
- ``honest_metrics``: the per-micro-batch metrics of a packed update,
  weighted so that what verl aggregates is the whole batch's figure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss

#: Policy losses whose gradient is exactly 0 where every advantage is 0.
_SKIP_EXACT_LOSS_MODES = ("vanilla",)
#: ``loss_agg_mode``s whose every normaliser is a global total (``batch_num_tokens``,
#: ``global_batch_size``, ``dp_size``): a sample's term does not depend on which
#: other samples share its micro-batch. ``seq-mean-token-sum-norm`` divides by
#: the micro-batch's padded length unless ``loss_scale_factor`` is set.
_GLOBAL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")


def _ppo_config(loss_function: Callable | None) -> Any:
    """The ActorConfig of verl's ``ppo_loss`` partial; None for any other loss."""
    if not (isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss):
        return None
    return loss_function.keywords.get("config")


def skip_is_exact(loss_function: Callable | None) -> bool:
    """Whether a zero-advantage micro-batch has exactly zero loss and gradient under this loss.

    Only verl's ``ppo_loss`` with the vanilla policy loss and neither a KL
    loss nor an entropy term is known to be; anything else keeps every micro-batch.
    """
    config = _ppo_config(loss_function)
    if config is None:
        return False
    mode = config.policy_loss.get("loss_mode", "vanilla")
    return mode in _SKIP_EXACT_LOSS_MODES and not config.use_kl_loss and float(config.entropy_coeff) == 0.0


def drop_is_exact(loss_function: Callable | None, data: Any) -> bool:
    """Whether leaving zero-advantage samples out of every micro-batch keeps the update exact.

    ``skip_is_exact``, model outputs not returned (they would lack the
    dropped rows), no forced groups, and a ``loss_agg_mode`` whose normalisers
    are global (for the ``seq-mean`` modes: ``global_batch_size`` given).
    """
    import verl.utils.tensordict_utils as tu

    if not skip_is_exact(loss_function):
        return False
    if tu.get_non_tensor_data(data=data, key="return_model_output", default=False):
        return False
    if int(tu.get_non_tensor_data(data=data, key="force_group_size", default=1)) != 1:
        return False
    config = _ppo_config(loss_function)
    mode = str(config.loss_agg_mode)
    if mode == "seq-mean-token-sum-norm":
        return config.loss_scale_factor is not None and _global_batch(data)
    return mode in _GLOBAL_AGG_MODES and (mode.startswith("token") or _global_batch(data))


def _global_batch(data: Any) -> bool:
    import verl.utils.tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key="global_batch_size", default=None) is not None


def pack_budget(data: Any) -> tuple[list[float] | None, float]:
    """(per-sample cost, budget) as verl's ``prepare_micro_batches`` would cut ``data``.

    Dynamic batch size: each sample's token count (prompt + response, as verl
    balances them) against ``max_token_len_per_gpu * sp_size``; otherwise
    None and ``micro_batch_size_per_gpu`` samples.
    """
    import verl.utils.tensordict_utils as tu

    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        ids = data["input_ids"]
        lengths = ids.offsets().diff() if ids.is_nested else data["attention_mask"].sum(dim=1)  # (B,)
        sp = int(tu.get_non_tensor_data(data=data, key="sp_size", default=1))
        budget = float(tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)) * sp
        return [float(n) for n in lengths.tolist()], budget
    return None, float(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None))


def response_tokens(data: Mapping[str, Any]) -> torch.Tensor:
    """(B,) response tokens per sample (the tokens verl's per-token means run over)."""
    mask = data["response_mask"]
    if mask.is_nested:
        return torch.stack([m.sum() for m in mask.unbind()])
    return mask.sum(dim=-1)


def honest_metrics(metrics: Mapping[str, Any], share: float) -> dict[str, Any]:
    """One packed micro-batch's metrics, weighted for verl's aggregation over micro-batches.

    verl sums ``SUM`` metrics over micro-batches (``actor/pg_loss``: each
    micro-batch's term of the whole-batch loss; a dropped sample's term is
    exactly 0, so they stay as they are) and averages ``MEAN`` ones
    (``actor/pg_clipfrac``, ``actor/ppo_kl``, ...: per-token means). A
    ``MEAN`` metric is multiplied by ``share`` = this micro-batch's response
    tokens x micro-batches / the rank's response tokens, so that the average
    is the token mean over the rank's whole batch, dropped tokens counted as
    0 (exact for the clip fractions: a zero advantage never clips; for
    ``ppo_kl`` it is the on-policy value, the log-ratio being 0 up to
    rounding). ``share`` 0 (a padding run): every metric 0.
    """
    out: dict[str, Any] = {}
    for key, metric in metrics.items():
        if not isinstance(metric, Metric):
            out[key] = metric
            continue
        weight = share if metric.aggregation == AggregationType.MEAN else float(share != 0.0)
        weighted = Metric(aggregation=metric.aggregation)
        weighted.extend([v * weight for v in metric.values])
        out[key] = weighted
    return out


__all__ = ["drop_is_exact", "honest_metrics", "pack_budget", "response_tokens", "skip_is_exact"]
