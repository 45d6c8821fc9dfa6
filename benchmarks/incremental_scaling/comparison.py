"""The study's arithmetic: where a curve reaches a loss, its loss at a given compute, and what three seeds say.

Evaluations are discrete, so a crossing is interpolated linearly in compute between the last evaluation above the
target and the first at or below it; a curve that starts at or below the target crosses at its first point, one
that never gets there has no crossing. A difference between two runs is taken seed by seed (the runs of one seed
share the initialisation seed and the data order) and **exceeds the spread** when its mean over the seeds is more
than twice its standard deviation: with three seeds, a paired t of 3.5 or more.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.incremental_scaling.curves import Curve

SPREAD_FACTOR = 2.0


def compute_to_reach(curve: Curve, target: float) -> float | None:
    """Cumulative compute at which `curve` first reaches `target` (interpolated), or None if it never does."""
    for i, loss in enumerate(curve.loss):
        if loss > target:
            continue
        if i == 0:
            return curve.compute[0]
        above_loss, above_compute = curve.loss[i - 1], curve.compute[i - 1]
        fraction = (above_loss - target) / (above_loss - loss)
        return above_compute + fraction * (curve.compute[i] - above_compute)
    return None


def loss_at(curve: Curve, compute: float) -> float:
    """`curve`'s loss at `compute`, interpolated linearly between the evaluations around it; ValueError outside."""
    if not curve.compute[0] <= compute <= curve.total_compute:
        raise ValueError(f"{curve.label}: compute {compute:.4g} is outside its evaluations "
                         f"({curve.compute[0]:.4g} to {curve.total_compute:.4g})")
    for i in range(1, len(curve.compute)):
        if curve.compute[i] >= compute:
            span = curve.compute[i] - curve.compute[i - 1]
            share = (compute - curve.compute[i - 1]) / span if span else 1.0
            return curve.loss[i - 1] + share * (curve.loss[i] - curve.loss[i - 1])
    return curve.loss[0]


@dataclass(frozen=True)
class Spread:
    """One quantity over the seeds: its values, mean and (sample) standard deviation."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    def text(self, digits: int = 3) -> str:
        """'0.512 ± 0.021' (one seed: the value alone)."""
        return f"{self.mean:.{digits}f}" + ("" if self.sd is None else f" ± {self.sd:.{digits}f}")

    def exceeds_spread(self) -> bool | None:
        """For seed-paired differences: is the mean further from 0 than SPREAD_FACTOR standard deviations? None
        with one seed (no spread to compare with)."""
        return None if self.sd is None else abs(self.mean) > SPREAD_FACTOR * self.sd


def spread(values: Sequence[float]) -> Spread:
    return Spread(tuple(float(value) for value in values))


def differences(first: Sequence[float], second: Sequence[float]) -> Spread:
    """first - second, seed by seed."""
    if len(first) != len(second):
        raise ValueError(f"{len(first)} values against {len(second)}: a difference is taken seed by seed")
    return spread([a - b for a, b in zip(first, second)])


@dataclass(frozen=True)
class Reach:
    """Where one run reaches its seed's reference's final loss, over the seeds."""

    label: str
    fractions: list[float | None]  # of the reference's compute; None: never reached
    final: Spread
    compute: float  # the run's training compute over the reference's (the same for every seed)

    @property
    def reached(self) -> Spread | None:
        values = [value for value in self.fractions if value is not None]
        return spread(values) if values else None

    @property
    def saving(self) -> Spread | None:
        """1 - the fraction, over the seeds where the run got there."""
        reached = self.reached
        return None if reached is None else spread([1 - value for value in reached.values])

    def count(self) -> str:
        return f"{sum(value is not None for value in self.fractions)} of {len(self.fractions)} seeds"

    def text(self) -> str:
        reached = self.reached
        if reached is None:
            return "not reached"
        return f"{reached.text()}" + ("" if None not in self.fractions else f" ({self.count()})")


def tflop_text(value: float) -> str:
    return f"{value / 1e12:.3f} TFLOP"
