"""The study's answer: how much compute each run needs to reach the from-scratch large model's final loss.

Evaluations are discrete, so the crossing is interpolated linearly in compute between the last evaluation
above the target and the first at or below it. A curve that starts at or below the target crosses at its
first point; one that never gets there has no crossing, and the table reports how far it stayed above.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.incremental_scaling.curves import Curve


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


@dataclass(frozen=True)
class Comparison:
    """`runs` (the progressive path, the control) against `reference`, the largest model from scratch, whose
    final validation loss is the bar."""

    reference: Curve
    runs: tuple[Curve, ...]

    @property
    def target(self) -> float:
        return self.reference.final_loss

    def fraction(self, curve: Curve) -> float | None:
        """Compute `curve` needs to reach the reference's final loss, as a fraction of the reference's compute;
        None if it never does."""
        reached = compute_to_reach(curve, self.target)
        return None if reached is None else reached / self.reference.total_compute

    def table(self) -> str:
        """Markdown: one row per run, the reference last."""
        rows = ["| run | final valid loss | training compute | compute to reach the reference's final loss "
                f"{self.target:.4f} | as a fraction of the reference's compute |", "| --- | --- | --- | --- | --- |"]
        for curve in (*self.runs, self.reference):
            reached = compute_to_reach(curve, self.target)
            if reached is None:
                reach, fraction = f"not reached (ends {curve.final_loss - self.target:+.4f} above)", "—"
            else:
                reach, fraction = tflop_text(reached), f"{reached / self.reference.total_compute:.3f}"
            rows.append(f"| {curve.label} | {curve.final_loss:.4f} | {tflop_text(curve.total_compute)} | {reach} | "
                        f"{fraction} |")
        return "\n".join(rows)

    def ratio_line(self) -> str:
        """Each run's compute to reach the reference's final loss over the reference's, or how far above it ended."""
        parts = []
        for curve in self.runs:
            fraction = self.fraction(curve)
            parts.append(f"{curve.label} {fraction:.3f}" if fraction is not None else
                         f"{curve.label} not reached ({curve.final_loss - self.target:+.4f} above after "
                         f"{curve.total_compute / self.reference.total_compute:.3f} of its compute)")
        return (f"compute ratio (to reach {self.reference.label}'s final loss {self.target:.4f}, over its "
                "compute): " + ", ".join(parts))


def tflop_text(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP"
