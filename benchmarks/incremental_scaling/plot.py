"""The study's figure, after the paper's Figure 2: validation loss against cumulative training compute.

Each stage of a progressive path (one per growth mode, dash-dotted for official; they share the first stage)
starts where the compute of the stages before it ends (its first point is the grown checkpoint before training),
so the horizontal distance between a path and the large model from scratch at the latter's final loss is the
compute growth saved or cost; the control (the small model trained longer) shows what the same compute buys
without growing. The left panel shows whole runs; the right one zooms
in from the first growth on, where the answer is read.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from benchmarks.incremental_scaling.comparison import Comparison, compute_to_reach  # noqa: E402
from benchmarks.incremental_scaling.curves import Curve  # noqa: E402

PATH_STYLES = [[("tab:orange", "o"), ("tab:red", "s"), ("darkred", "D"), ("black", "v")],
               [("tab:orange", "o"), ("tab:purple", "s"), ("indigo", "D"), ("gray", "v")]]
REFERENCE_STYLE, CONTROL_STYLE = ("tab:green", "^"), ("tab:blue", "x")


def _line(axes: Axes, curve: Curve, style: tuple[str, str], **options: object) -> None:
    color, marker = style
    axes.plot([c / 1e12 for c in curve.compute], curve.loss, color=color, marker=marker, markersize=2.5,
              linewidth=1.2, label=curve.label, **options)


def _draw(axes: Axes, comparison: Comparison, paths: list[list[Curve]], control: Curve) -> None:
    for number, (stages, styles) in enumerate(zip(paths, PATH_STYLES)):
        for index, stage in enumerate(stages):
            if index == 0 and number:
                continue  # the first stage is shared: drawn once
            _line(axes, stage, styles[index % len(styles)], linestyle="-" if number == 0 else "-.")
            if index and number == 0:
                axes.axvline(stage.compute[0] / 1e12, color="gray", linestyle=":", linewidth=0.8)
    _line(axes, control, CONTROL_STYLE, linestyle="--")
    _line(axes, comparison.reference, REFERENCE_STYLE)
    axes.axhline(comparison.target, color="gray", linestyle="--", linewidth=1,
                 label=f"{comparison.reference.label}'s final loss {comparison.target:.3f}")
    for curve in comparison.runs:
        reached = compute_to_reach(curve, comparison.target)
        if reached is not None:
            axes.plot([reached / 1e12], [comparison.target], marker="*", color="black", markersize=11,
                      linestyle="none", label=f"{curve.label}: {comparison.fraction(curve):.2f} of its compute")
    axes.set_xlabel("cumulative training compute (TFLOP)")
    axes.grid(alpha=0.3)


def plot_comparison(comparison: Comparison, paths: list[list[Curve]], control: Curve, path: Path) -> None:
    """Write the paths' stages, the control, the reference, its final loss and the crossings as a PNG."""
    figure, (whole, zoom) = plt.subplots(1, 2, figsize=(13, 5), dpi=120)
    _draw(whole, comparison, paths, control)
    whole.set_ylabel("validation loss")
    whole.set_title("Progressive scaling vs training from scratch")
    whole.legend(fontsize=7)
    _draw(zoom, comparison, paths, control)
    stages = paths[0]
    growth = stages[1].compute[0] if len(stages) > 1 else stages[0].compute[0]
    curves = [*(stage for stages in paths for stage in stages), control, comparison.reference]
    end = max(curve.total_compute for curve in curves)
    zoom.set_xlim(growth / 1e12 * 0.9, end / 1e12 * 1.02)
    shown = [loss for curve in curves for c, loss in zip(curve.compute, curve.loss) if c >= growth * 0.9]
    zoom.set_ylim(min(shown) - 0.05, max(shown) + 0.05)
    zoom.set_title("from the first growth on")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
