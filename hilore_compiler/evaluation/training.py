"""The paired GRPO training runs: every arm trains from the same start on the same data.

For one seed every arm starts from the same weights (``build_model(seed=...)``)
and, at step k, draws its prompts and samples from a generator seeded by
(seed, k). Sampling is eager and deterministic, so as long as two arms' weights
are bitwise equal their rollouts are too; once an update differs (compression,
or only Inductor's rounding), the next samples may differ and the runs go
their own ways. Each run records a digest of every step's samples, which
tells how long an arm shared the exact arm's rollouts.

The update is ``actor_update`` on the arm's model (eager for ``exact``, the
compiled ``FixedBatch`` for the others), with the exposure buckets of
``RunSetup.buckets`` for every arm, so all arms cut the batch into the same
microbatches and sum the gradient in the same order; or, when it is None,
each arm's own plan's (``arms.arm_buckets``), as a user's trainer runs.

With a KL term (``GRPOConfig.beta`` > 0) the reference policy is the run's
initial weights (``build_model(seed=...)``, frozen), as in GRPO from a base
model. Every ``TrainConfig.fidelity_every`` steps a compiled arm's update
is measured against the exact one on the same batch (``stepfidelity``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..grpo import ExposureBuckets, GRPOConfig, UpdateConfig, actor_update
from ..models import build_model
from .arms import Arm, arm_buckets, load_weights
from .rollout import rollout, task_score
from .stepfidelity import StepFidelity, measured_update
from .task import TaskConfig, make_prompts
from ..progress import tell

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """One arm's GRPO run on the toy task."""

    #: Actor updates (one generation batch each, on-policy).
    steps: int = 300
    #: Prompts per generation batch.
    prompts_per_step: int = 8
    #: Samples per prompt (one GRPO group).
    group_size: int = 8
    #: AdamW learning rate. At 5e-4 the tiny policy goes from ~7% to ~95% on
    #: the ``max`` rule in 300 steps; 1e-3 learns faster but stalls near 86%
    #: (greedy answers freeze once groups stop disagreeing).
    lr: float = 5e-4
    #: Score the policy every this many steps (and at the start and the end).
    eval_every: int = 25
    #: Held-out prompts scored with greedy decoding.
    eval_prompts: int = 1000
    #: Seed of the held-out prompts, the same for every seed and arm.
    eval_seed: int = 12345
    #: The final score is the mean of this many last evaluations (steps 250,
    #: 275 and 300 by default): late in training greedy answers still flip
    #: between neighbouring evaluations by a few points (93.6 -> 85.7 -> 93.2
    #: seen on one exact run), and one evaluation would carry that into the
    #: paired difference.
    final_evals: int = 3
    #: Measure a compiled arm's update against the exact one every this many
    #: steps (``stepfidelity``: one more eager update each time); 0: never.
    fidelity_every: int = 0

    def __post_init__(self) -> None:
        if min(self.steps, self.prompts_per_step, self.eval_every, self.eval_prompts, self.final_evals) < 1:
            raise ValueError("steps, prompts_per_step, eval_every, eval_prompts and final_evals must be >= 1")
        if self.fidelity_every < 0:
            raise ValueError("fidelity_every must be >= 0")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a one-sample group has no advantage")


@dataclass(frozen=True, slots=True, kw_only=True)
class ArmRun:
    """What one arm did over one seed's run."""

    arm: str
    seed: int
    #: Mean training reward of each step's samples.
    rewards: tuple[float, ...]
    #: (step, greedy score on the held-out prompts): step 0 is the start.
    scores: tuple[tuple[int, float], ...]
    #: Short digest of each step's sampled token ids.
    digests: tuple[str, ...]
    seconds: float
    #: Seconds inside ``actor_update`` only.
    update_seconds: float
    #: Mean score of the last ``TrainConfig.final_evals`` evaluations after the start.
    final_score: float
    #: The measured steps' fidelity to the exact update (compiled arms only).
    fidelity: tuple[StepFidelity, ...] = ()

    @property
    def start_score(self) -> float:
        return self.scores[0][1]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of ``step``'s prompts and samples, the same for every arm."""
    # A large odd multiplier keeps (seed, step) pairs from colliding for any
    # realistic number of steps.
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def digest(ids: torch.Tensor) -> str:
    """12 hex digits identifying a batch of token ids."""
    # Through a list, not .numpy(): numpy is not a dependency.
    return hashlib.sha256(repr(ids.to(torch.int64).tolist()).encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSetup:
    """What every arm's run shares."""

    task: TaskConfig
    train: TrainConfig
    grpo: GRPOConfig
    update: UpdateConfig
    #: The exposure buckets every arm's ``actor_update`` uses; None: each arm's own.
    buckets: ExposureBuckets | None = None
    model: str = "tiny"


def reference_policy(setup: RunSetup, seed: int) -> nn.Module | None:
    """The KL term's reference, the run's initial weights, frozen; None without a KL term."""
    if setup.grpo.beta == 0.0:
        return None
    reference = build_model(setup.model, seed=seed)
    reference.requires_grad_(False)
    return reference


def train_arm(arm: Arm, seed: int, setup: RunSetup, progress: Progress | None = None) -> ArmRun:
    """Train ``arm`` from ``seed``'s initial weights for ``setup.train.steps`` updates."""
    say = progress or (lambda _msg: None)
    cfg = setup.train
    load_weights(arm, build_model(setup.model, seed=seed).state_dict())
    reference = reference_policy(setup, seed)
    optimizer = torch.optim.AdamW(arm.policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    held_out = make_prompts(setup.task, cfg.eval_prompts, torch.Generator().manual_seed(cfg.eval_seed))
    batch_size = cfg.prompts_per_step * cfg.group_size
    buckets = setup.buckets if setup.buckets is not None else arm_buckets(arm, batch_size)
    scores = [(0, task_score(arm.policy, setup.task, held_out))]
    rewards, digests, fidelity, in_update = [], [], [], 0.0
    start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        batch = rollout(arm.policy, setup.task, num_prompts=cfg.prompts_per_step,
                        group_size=cfg.group_size, generator=step_generator(seed, step), reference=reference)
        if not arm.exact and cfg.fidelity_every and step % cfg.fidelity_every == 0:
            report, measured = measured_update(arm.model, arm.policy, batch.batch, setup.grpo, setup.update,
                                               buckets, step)
            optimizer.step()
            optimizer.zero_grad()
            fidelity.append(measured)
        else:
            report = actor_update(arm.model, optimizer, batch.batch, setup.grpo, update=setup.update,
                                  buckets=buckets)
        in_update += report.seconds
        rewards.append(float(batch.rewards.mean()))
        digests.append(digest(batch.batch.input_ids))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            scores.append((step, task_score(arm.policy, setup.task, held_out)))
            say(f"{arm.name} seed {seed} step {step}/{cfg.steps}: reward {rewards[-1]:.3f}, "
                f"score {scores[-1][1]:.3f} ({time.perf_counter() - start:.0f} s)")
    last = [score for _, score in scores[1:][-cfg.final_evals:]]
    return ArmRun(arm=arm.name, seed=seed, rewards=tuple(rewards), scores=tuple(scores),
                  digests=tuple(digests), seconds=time.perf_counter() - start, update_seconds=in_update,
                  final_score=sum(last) / len(last), fidelity=tuple(fidelity))


def train_paired(arms: list[Arm], seeds: list[int], setup: RunSetup,
                 progress: Progress | None = None) -> list[ArmRun]:
    """Every arm on every seed, seed by seed, so a stopped run leaves whole pairs."""
    runs = []
    for seed in seeds:
        for arm in arms:
            runs.append(train_arm(arm, seed, setup, progress))
    return runs


def shared_steps(run: ArmRun, reference: ArmRun) -> int:
    """Leading steps whose samples equal ``reference``'s (same seed)."""
    n = 0
    for a, b in zip(run.digests, reference.digests):
        if a != b:
            break
        n += 1
    return n


def stderr_progress(message: str) -> None:
    """Progress lines on stderr, flushed (stdout carries the summary)."""
    tell(f"hilore eval: {message}")
