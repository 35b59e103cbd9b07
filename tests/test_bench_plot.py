"""The step bench's PNG: labels of methods that land on nearly one point stay readable."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")


def test_labels_of_nearly_coinciding_points_stack_a_line_apart():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hilore_compiler.bench.report import _label_offsets

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # HiLoRe, its blind plan and uniform int8 at the ceiling; GC and store-all apart.
    points = [(206.7, 1648.0), (205.3, 1626.0), (207.1, 1613.0), (188.0, 1362.0), (412.9, 1619.0)]
    labels = ["HiLoRe", "HiLoRe blind", "uniform int8", "GC", "store-all"]
    ax.plot(*zip(*points), "o")
    ax.autoscale_view()
    offsets = _label_offsets(ax, points, labels)
    scale = fig.dpi / 72
    baselines = [ax.transData.transform(p)[1] + dy * scale for p, (_, dy) in zip(points, offsets)]
    cluster = sorted(baselines[:3], reverse=True)
    assert all(a - b >= 12 * scale - 0.5 for a, b in zip(cluster, cluster[1:]))  # a 10 pt line apart
    assert offsets[0] == pytest.approx((5.0, 5.0))  # the highest keeps its place
    assert offsets[3] == pytest.approx((5.0, 5.0)) and offsets[4] == pytest.approx((5.0, 5.0))  # nothing near
    plt.close(fig)
