"""``hilore show PLAN --plot memory.png``: the predicted memory over the step.

One line per distinct bucket plan, beside GC and store-all, from the plan's
``timeline`` (``solver.timeline``): forward rising layer by layer, the loss,
then backward layer by layer; the ceiling (the plan's budget) and, for a
roofline plan, the card's memory less the training state
(``solver.devicefit``) as horizontal lines. The numbers are the plan file's,
so each line peaks at its predicted ``memory_bytes``.
"""

from __future__ import annotations

from ..planfile import TIMELINE_GC, TIMELINE_STORE_ALL, Plan
from ..solver.budget import format_bytes
from ..solver.devicefit import plan_device, training_state

GIB = 2**30


def drawn_series(plan: Plan) -> dict[str, tuple[int, ...]]:
    """The lines to draw, by label: GC, store-all, then each distinct bucket plan
    (buckets that share decisions are one line, ``b0, b1, b2``)."""
    if plan.timeline is None:
        raise ValueError("this plan has no memory timeline (it was made before plans recorded one): "
                         "make it again with hilore plan")
    shared: dict[tuple, list[str]] = {}
    for b in plan.buckets:
        if not b.skip and b.bucket.name in plan.timeline.bytes:
            shared.setdefault(b.decisions, []).append(b.bucket.name)
    series = {"GC": plan.timeline.bytes[TIMELINE_GC], "store-all": plan.timeline.bytes[TIMELINE_STORE_ALL]}
    for names in shared.values():
        series[f"HiLoRe {', '.join(names)}"] = plan.timeline.bytes[names[0]]
    return series


def ceilings(plan: Plan) -> dict[str, int]:
    """The horizontal lines, by label: the budget, and the card's room for the step."""
    lines = {f"budget {plan.budget} ({format_bytes(plan.budget_bytes)})": plan.budget_bytes}
    device, state = plan_device(plan), training_state(plan)
    if device is not None:
        card = f"{device.label} {format_bytes(device.memory_bytes)}"
        if state is None:
            lines[f"{card} (training state not recorded)"] = device.memory_bytes
        else:
            lines[f"{card} less training state {format_bytes(state.total_bytes)}"] = (
                device.memory_bytes - state.total_bytes)
    return lines


def draw_memory(plan: Plan, path: str) -> None:
    """Draw the plan's predicted memory over the step to ``path`` (a PNG)."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'hilore-compiler[plot]'") from e
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    phases = plan.timeline.phases if plan.timeline else ()
    series = drawn_series(plan)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = {"GC": dict(linestyle="--", color="gray"), "store-all": dict(linestyle=":", color="black")}
    for label, values in series.items():
        ax.plot(range(len(values)), [v / GIB for v in values], label=label, marker=".",
                **styles.get(label, {}))
    for (label, value), color in zip(ceilings(plan).items(), ("tab:red", "tab:purple")):
        ax.axhline(value / GIB, color=color, linewidth=1, label=label)
    loss = phases.index("loss") if "loss" in phases else None
    if loss is not None:
        ax.axvline(loss, color="lightgray", linewidth=0.8)
        ax.set_xticks([0, loss, len(phases) - 1], ["forward", "loss", "end of backward"])
    ax.set_xlabel("step: forward layer by layer, the loss, backward layer by layer")
    ax.set_ylabel("predicted GiB above weights + optimizer state")
    ax.set_title(f"{plan.model}\nbatch {plan.batch}, seq_len {plan.seq_len}, costs {plan.cost_source}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
