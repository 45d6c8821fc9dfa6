"""The study's figure, after the paper's Figure 2: validation loss against cumulative training compute.

Each run is drawn as its mean over the seeds (every seed evaluates at the same compute), with a band from the
lowest to the highest seed. A path's stages are one line; dotted vertical lines mark its growths. The dashed
horizontal line is the reference's mean final loss. The left panel shows whole runs, the right one zooms in
from the first growth on; the legend sits below both, off the curves.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training machine
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from benchmarks.incremental_scaling.curves import Curve, SeedCurves  # noqa: E402

STYLES = {"progressive": ("tab:red", "-"), "official": ("tab:purple", "-."), "restarts": ("tab:orange", ":"),
          "control": ("tab:blue", "--"), "dense": ("tab:brown", "-"), "scratch": ("tab:green", "-")}


def _mean_band(curves: list[Curve]) -> tuple[list[float], list[float], list[float], list[float]]:
    """compute (TFLOP), mean, lowest and highest loss at each evaluation; the seeds must share the evaluations."""
    grid = curves[0].compute
    if any(len(curve.compute) != len(grid) or any(abs(a - b) > 1e-6 * b for a, b in zip(curve.compute, grid))
           for curve in curves):
        raise ValueError(f"{curves[0].label}: the seeds evaluated at different compute; they cannot be averaged")
    columns = list(zip(*(curve.loss for curve in curves)))
    return ([c / 1e12 for c in grid], [sum(column) / len(column) for column in columns],
            [min(column) for column in columns], [max(column) for column in columns])


def _shown(seeds: list[SeedCurves]) -> list[str]:
    """The runs of STYLES the study ran (--quick leaves some out); the ablation's paths are in table.md only."""
    return [key for key in STYLES if key in seeds[0].paths or key in seeds[0].singles]


def _draw(axes: Axes, seeds: list[SeedCurves]) -> None:
    for key in _shown(seeds):
        color, style = STYLES[key]
        curves = [seed.curve(key) for seed in seeds]
        compute, mean, low, high = _mean_band(curves)
        axes.plot(compute, mean, color=color, linestyle=style, marker="o", markersize=2, linewidth=1.3,
                  label=curves[0].label)
        axes.fill_between(compute, low, high, color=color, alpha=0.18, linewidth=0)
    for stage in seeds[0].paths["progressive"].stages[1:]:
        axes.axvline(stage.compute[0] / 1e12, color="gray", linestyle=":", linewidth=0.8)
    target = sum(seed.reference.final_loss for seed in seeds) / len(seeds)
    axes.axhline(target, color="gray", linestyle="--", linewidth=0.9,
                 label=f"the reference's final loss, {target:.3f} (mean)")
    axes.set_xlabel("cumulative training compute (TFLOP)")
    axes.grid(alpha=0.3)


def plot_study(seeds: list[SeedCurves], path: Path) -> None:
    """Write the figure as a PNG."""
    figure, (whole, zoom) = plt.subplots(1, 2, figsize=(13, 6), dpi=110)
    _draw(whole, seeds)
    whole.set_ylabel("validation loss")
    whole.set_title(f"Growth vs training from scratch ({len(seeds)} seeds: mean, band = lowest to highest)")
    _draw(zoom, seeds)
    growth = seeds[0].paths["progressive"].stages[1].compute[0]
    curves = [seed.curve(key) for seed in seeds for key in _shown(seeds)]
    end = max(curve.total_compute for curve in curves)
    zoom.set_xlim(growth / 1e12 * 0.95, end / 1e12 * 1.02)
    shown = [loss for curve in curves for c, loss in zip(curve.compute, curve.loss) if c >= growth * 0.95]
    zoom.set_ylim(min(shown) - 0.03, max(shown) + 0.03)
    zoom.set_title("from the first growth on")
    handles, labels = whole.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path)
    plt.close(figure)
