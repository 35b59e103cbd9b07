"""Named comparisons ``hilore eval --task NAME`` runs (``max1``, the one-token eval, lives in ``suite``).

``multiples16``: 16 generated digits per response (the last digits of the
multiples of the prompt's largest digit, ``task``), rewarded with partial
credit; groups of 8, clip 0.2, K3 KL 0.001 to the initial weights; the tiny
built-in policy (2 layers, hidden 64, 0.1M parameters) from scratch.

Why these sizes, measured with one thread on 2 busy cores: an arm takes
0.17-0.21 s a step (about 0.13 s sampling 16 tokens with a full forward
each, 0.04-0.07 s the update), so 400 steps and the scoring take 70-85 s per
arm and seed. At lr 1e-3 the exact arm's greedy score rose from 6% to 41% over those
400 steps on seed 0 (9% to 40% on seed 1); 2e-3 was noisier and ended lower
(34% at 600); more prompts per step cost proportionally more time than they
saved steps; a wider or deeper policy costs time in proportion and was not
needed for the curve to rise. The fidelity of every compiled update is
measured at every 5th step (one extra eager update each), 80 steps a seed.

What the final score can resolve: runs on this task are chaotic. Plain
``torch.compile`` (``store-all``, whose updates match exact to 1 - cos ~ 1e-11)
sampled exact's very rollouts for 100-115 steps, then drifted, and ended
+6 and -18 pp from exact on seeds 0 and 1; collapses and recoveries of the
greedy score (40% -> 1% -> 20%) come and go with any perturbation. The paired
final-score difference of any arm therefore carries a spread of 10-20 pp
per seed that rounding alone produces; read it against ``store-all``'s, and
the per-bucket cosines for the plans' own error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..grpo import GRPOConfig
from .comparison import CompareConfig
from .task import TaskConfig
from .training import TrainConfig


def multiples16() -> CompareConfig:
    """The multi-token comparison's full run (16 seeds; a seed of 5 arms is about 6.5 minutes here)."""
    return CompareConfig(
        preset="multiples16",
        task=TaskConfig(prompt_digits=4, response_len=16, rule="multiples", partial_credit=True),
        train=TrainConfig(steps=400, prompts_per_step=8, group_size=8, lr=1e-3, eval_every=50,
                          eval_prompts=200, final_evals=3, fidelity_every=5),
        grpo=GRPOConfig(beta=0.001, eps_low=0.2, eps_high=0.2),
        seeds=16,
    )


#: Preset name -> its full configuration.
PRESETS: dict[str, Callable[[], CompareConfig]] = {"multiples16": multiples16}


def preset(name: str, **overrides: Any) -> CompareConfig:
    """The configuration of preset ``name`` with ``overrides`` (``CompareConfig`` fields)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)


def quick(config: CompareConfig) -> CompareConfig:
    """A few minutes end to end: two seeds, 60 steps, a small held-out set."""
    train = dataclasses.replace(config.train, steps=60, eval_every=30, eval_prompts=100, final_evals=1)
    return dataclasses.replace(config, train=train, seeds=2)
