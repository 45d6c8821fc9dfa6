"""The study's figure, after the paper's Figure 2: validation loss against cumulative training compute.

The grown runs start where S's compute ends (their first point is the grown checkpoint before training), so
the horizontal distance between (b) or (b') and (c) at (c)'s final loss is the compute growth saved or cost. The
left panel shows whole runs; the right one zooms in from the growth point on, where the answer is read.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from benchmarks.incremental_scaling.comparison import Comparison, compute_to_reach  # noqa: E402

COLORS = {"small": ("tab:blue", "o"), "grown": ("tab:red", "s"), "official": ("tab:purple", "D"),
          "large": ("tab:green", "^")}


def _draw(axes: Axes, comparison: Comparison) -> None:
    curves = {"small": comparison.small, "grown": comparison.grown, "official": comparison.official,
              "large": comparison.large}
    for key, curve in curves.items():
        color, marker = COLORS[key]
        axes.plot([c / 1e12 for c in curve.compute], curve.loss, color=color, marker=marker, markersize=2.5,
                  linewidth=1.2, label=curve.label)
    axes.axhline(comparison.target, color="gray", linestyle="--", linewidth=1,
                 label=f"(c)'s final loss {comparison.target:.3f}")
    axes.axvline(comparison.grown.compute[0] / 1e12, color="tab:red", linestyle=":", linewidth=1,
                 label="growth (S's total compute)")
    for name, curve in (("(b)", comparison.grown), ("(b')", comparison.official)):
        reached = compute_to_reach(curve, comparison.target)
        if reached is not None:
            axes.plot([reached / 1e12], [comparison.target], marker="*", color="black", markersize=11,
                      linestyle="none", label=f"{name} reaches it at {comparison.fraction(curve):.2f} of (c)'s compute")
    axes.set_xlabel("cumulative training compute (TFLOP)")
    axes.grid(alpha=0.3)


def plot_comparison(comparison: Comparison, path: Path) -> None:
    """Write the four curves, (c)'s final loss and where (b) and (b') reach it, as a PNG."""
    figure, (whole, zoom) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120)
    _draw(whole, comparison)
    whole.set_ylabel("validation loss")
    whole.set_title("Progressive scaling vs training from scratch")
    whole.legend(fontsize=7)
    _draw(zoom, comparison)
    growth = comparison.grown.compute[0]
    end = max(comparison.grown.total_compute, comparison.official.total_compute, comparison.large.total_compute)
    zoom.set_xlim(growth / 1e12 * 0.9, end / 1e12 * 1.02)
    lowest = min(min(c.loss) for c in (comparison.small, *comparison.grown_runs, comparison.large))
    zoom.set_ylim(lowest - 0.05, max(max(c.loss) for c in comparison.grown_runs) + 0.15)
    zoom.set_title("from the growth point on")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
