"""Numbers of the evaluation: per-arm scores, paired differences with a 95% interval, a plot.

The paired difference of two arms is taken seed by seed (same start, same
data), and its 95% interval is the Student t interval over seeds:
``mean +- t_{0.975, n-1} * sd / sqrt(n)``. Scores are fractions in the runs
and percentage points (pp) here.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .training import ArmRun, shared_steps

#: Two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30 (standard tables).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
#: The standard normal 0.975 quantile.
Z_975 = 1.959964
#: The paper's bound on the paired downstream score difference, in pp.
TARGET_PP = 0.6


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the table up to 30, beyond it the Cornish-Fisher expansion
    in 1/df around the normal quantile (off by < 1e-3 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    z = Z_975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


@dataclass(frozen=True, slots=True, kw_only=True)
class PairedDifference:
    """Mean of per-seed differences a - b with its 95% t interval (same units as the inputs)."""

    mean: float
    low: float
    high: float
    #: Standard deviation of the differences (0 with one pair).
    sd: float
    n: int


def paired_difference(a: Sequence[float], b: Sequence[float]) -> PairedDifference:
    """Paired a - b over seeds; with one pair the interval is unbounded (no spread known)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need equally many paired values, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    mean = statistics.fmean(diffs)
    if len(diffs) == 1:
        return PairedDifference(mean=mean, low=-math.inf, high=math.inf, sd=0.0, n=1)
    sd = statistics.stdev(diffs)
    half = t_quantile_975(len(diffs) - 1) * sd / math.sqrt(len(diffs))
    return PairedDifference(mean=mean, low=mean - half, high=mean + half, sd=sd, n=len(diffs))


def _mean_curve(curves: list[Sequence[float]]) -> list[float]:
    return [statistics.fmean(values) for values in zip(*curves)]


def arm_summary(runs: list[ArmRun]) -> dict[str, Any]:
    """One arm over its seeds: start/final score (pp) and mean curves."""
    return {
        "seeds": [r.seed for r in runs],
        "start_score_pp": 100 * statistics.fmean(r.start_score for r in runs),
        "final_score_pp": 100 * statistics.fmean(r.final_score for r in runs),
        "final_score_pp_per_seed": [100 * r.final_score for r in runs],
        "reward_curve": _mean_curve([r.rewards for r in runs]),
        "score_steps": [step for step, _ in runs[0].scores],
        "score_curve_pp": [100 * s for s in _mean_curve([[s for _, s in r.scores] for r in runs])],
        "seconds_per_step": statistics.fmean(r.seconds / len(r.rewards) for r in runs),
        "update_seconds_per_step": statistics.fmean(r.update_seconds / len(r.rewards) for r in runs),
    }


def training_summary(runs: list[ArmRun], reference: str = "exact") -> dict[str, Any]:
    """Per-arm summaries and each arm's paired final-score difference to ``reference``."""
    by_arm: dict[str, dict[int, ArmRun]] = {}
    for r in runs:
        by_arm.setdefault(r.arm, {})[r.seed] = r
    out: dict[str, Any] = {"arms": {a: arm_summary(list(s.values())) for a, s in by_arm.items()}}
    ref = by_arm.get(reference, {})
    diffs = {}
    for arm, seeds in by_arm.items():
        paired = sorted(set(seeds) & set(ref)) if arm != reference else []
        if not paired:
            continue
        d = paired_difference([100 * seeds[s].final_score for s in paired],
                              [100 * ref[s].final_score for s in paired])
        diffs[arm] = {
            **asdict(d), "unit": "pp", "minus": reference,
            "meets_target": abs(d.mean) < TARGET_PP,
            "interval_within_target": -TARGET_PP < d.low and d.high < TARGET_PP,
            "shared_rollout_steps": [shared_steps(seeds[s], ref[s]) for s in paired],
        }
    out["paired_differences"] = diffs
    out["target_pp"] = TARGET_PP
    return out


def step_fidelity_summary(runs: list[ArmRun]) -> dict[str, dict[str, dict[str, float]]]:
    """Per compiled arm and bucket, over every measured step of every seed: the mean and
    lowest cosine of the arm's bucket gradient with the exact one, the steps measured and
    the samples they held; bucket ``"update"`` is the whole update."""
    cosines: dict[str, dict[str, list[tuple[float, int]]]] = {}
    for run in runs:
        for f in run.fidelity:
            arm = cosines.setdefault(run.arm, {})
            for bucket, cos in f.cosine.items():
                arm.setdefault(bucket, []).append((cos, f.samples.get(bucket, 0)))
            arm.setdefault("update", []).append((f.update_cosine, sum(f.samples.values())))
    return {arm: {bucket: {"mean_cosine": statistics.fmean(c for c, _ in values),
                           "min_cosine": min(c for c, _ in values),
                           "steps": len(values), "samples": sum(n for _, n in values)}
                  for bucket, values in sorted(buckets.items(), key=lambda kv: (kv[0] == "update", kv[0]))}
            for arm, buckets in cosines.items()}


def format_step_fidelity(summary: dict[str, dict[str, dict[str, float]]]) -> str:
    """``step_fidelity_summary`` as a text table; cosines as 1 - cos, which tells 0.99999 from 0.999."""
    lines = [f"{'arm':<15} {'bucket':<7} {'1 - mean cos':>12} {'1 - min cos':>12} {'steps':>6} {'samples':>8}"]
    for arm, buckets in summary.items():
        for bucket, s in buckets.items():
            lines.append(f"{arm:<15} {bucket:<7} {1 - s['mean_cosine']:12.1e} {1 - s['min_cosine']:12.1e} "
                         f"{s['steps']:6d} {s['samples']:8d}")
    return "\n".join(lines)


def format_arm_plans(plans: dict[str, Any]) -> str:
    """What the backend planned for each compiled arm, bucket by bucket."""
    lines = []
    for arm, p in plans.items():
        lines.append(f"{arm}: {p['budget']} = {p['budget_bytes']} bytes (gc {p['gc_bytes']}, store-all "
                     f"{p['store_bytes']}), codecs {', '.join(p['codecs'])}, {p['variants']} compiled variant(s)")
        lines += [f"  {name}: " + ", ".join(f"{n} {k}" for k, n in b["options"].items())
                  + f"; {b['memory_bytes']} bytes, risk {b['risk']:.2e}" for name, b in p["buckets"].items()]
    return "\n".join(lines)


def format_training(summary: dict[str, Any]) -> str:
    """The training summary as a small text table."""
    lines = [f"{'arm':<15} {'start %':>8} {'final %':>8} {'s/step':>7}  final per seed"]
    for arm, s in summary["arms"].items():
        per_seed = " ".join(f"{v:.1f}" for v in s["final_score_pp_per_seed"])
        lines.append(f"{arm:<15} {s['start_score_pp']:8.1f} {s['final_score_pp']:8.1f} "
                     f"{s['seconds_per_step']:7.3f}  {per_seed}")
    for arm, d in summary["paired_differences"].items():
        verdict = "within" if d["interval_within_target"] else "not within"
        lines.append(f"{arm} - {d['minus']}: {d['mean']:+.2f} pp, 95% CI [{d['low']:+.2f}, "
                     f"{d['high']:+.2f}] over {d['n']} seeds ({verdict} +-{summary['target_pp']} pp); "
                     f"rollouts shared for {d['shared_rollout_steps']} steps")
    return "\n".join(lines)


def format_plans(plans: dict[str, Any]) -> str:
    """Which budgets were feasible, what the plans chose per bucket, the control's memory."""
    lines = [f"risk budget {plans['risk_budget']:.3g} ({plans['risk_budget_source']})"]
    for role, p in (("planned", plans["planned"]), ("tight", plans["tight"]),
                    *(("probe", p) for p in plans.get("probes", ()))):
        state = "feasible" if p["feasible"] else "infeasible -> smallest feasible"
        lines.append(f"{role}: {p['requested']} {state}: {p['budget_bytes']} bytes "
                     f"({p['budget_x_gc']:.3f}x-gc; gc {p['gc_bytes']}, store-all {p['store_bytes']})")
        if role == "probe":
            continue
        by_plan: dict[str, list[str]] = {}
        for name, b in p["buckets"].items():
            by_plan.setdefault(", ".join(f"{c} {k}" for k, c in b["options"].items()), []).append(name)
        lines += [f"  {'/'.join(names)}: {options}" for options, names in by_plan.items()]
    tight = plans["tight"]["budget_bytes"]
    lines.append(f"control blind-int8 predicted memory {plans['control_memory_bytes']} bytes "
                 f"({plans['control_memory_bytes'] / tight:.3f}x the tight budget)")
    if "blind_memory_bytes" in plans:
        lines.append(f"control hilore-blind (same memory and error budget, one plan for every bucket) "
                     f"predicted memory {plans['blind_memory_bytes']} bytes; trained arm {plans['trained']}'s buckets "
                     f"{'differ' if plans['buckets_differ'] else 'are identical'}; predicted whole-update "
                     "error " + ", ".join(f"{n} {e:.2e}" for n, e in plans["predicted_error"].items()))
    return "\n".join(lines)


def format_fidelity(rows: list[dict[str, Any]]) -> str:
    """Fidelity rows as a text table."""
    lines = [f"{'arm':<15} {'budget':<10} {'bucket':<6} {'rel L2':>10} {'cosine':>10}  options"]
    for r in rows:
        options = ", ".join(f"{n} {k}" for k, n in r["options"].items())
        lines.append(f"{r['arm']:<15} {r['budget']:<10} {r['bucket']:<6} {r['rel_l2']:10.3e} "
                     f"{r['cosine']:10.7f}  {options}")
    return "\n".join(lines)


def plot_curves(summary: dict[str, Any], path: str | Path) -> Path | None:
    """Reward and score curves per arm as a PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, s in summary["arms"].items():
        left.plot(range(1, len(s["reward_curve"]) + 1), s["reward_curve"], label=arm, linewidth=1)
        right.plot(s["score_steps"], s["score_curve_pp"], marker="o", label=arm)
    left.set(xlabel="step", ylabel="mean training reward", title="reward (mean over seeds)")
    right.set(xlabel="step", ylabel="greedy score (%)", title="held-out score (mean over seeds)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
