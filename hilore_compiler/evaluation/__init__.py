"""Does it hurt training? Gradient fidelity per bucket and a paired GRPO training run.

Modules in pipeline order:

- ``task``: a verifiable toy task generated in code (digit prompts, a rule
  checked position by position, exact-match or partial-credit reward).
- ``rollout``: sampling from the policy with a fixed generator (and the KL
  reference's log-probs); greedy score.
- ``arms``: the exact policy and the policy compiled under each plan (hilore,
  the exposure-blind int8 control, store-all), traced once; or planned by
  the backend itself as a user's compile is (``BENCH_ARMS``).
- ``fidelity``: each compiled arm's gradient against the exact one, per bucket.
- ``stepfidelity``: the same along a training run, on the batches it trains on.
- ``training``: paired GRPO runs, same start and data per seed for every arm.
- ``report``: scores, paired differences with a 95% t interval, the plot.
- ``suite``: ``run_evaluation``, the one-token eval of ``hilore eval``.
- ``comparison``: ``run_comparison``, the user-facing arms side by side.
- ``presets``: the comparisons ``hilore eval --task`` names (``multiples16``).
"""

from .report import PairedDifference, paired_difference, t_quantile_975
from .suite import EvalConfig, quick_config, run_evaluation
from .task import RULES, TaskConfig, make_prompts, reward

__all__ = [
    "EvalConfig",
    "PairedDifference",
    "RULES",
    "TaskConfig",
    "make_prompts",
    "paired_difference",
    "quick_config",
    "reward",
    "run_evaluation",
    "t_quantile_975",
]
