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
    small: Curve  # (a)
    grown: Curve  # (b), growth_mode preserve; its first point the grown checkpoint before any training
    official: Curve  # (b'), growth_mode official, likewise
    large: Curve  # (c)

    @property
    def target(self) -> float:
        return self.large.final_loss

    @property
    def grown_runs(self) -> tuple[Curve, Curve]:
        return self.grown, self.official

    def fraction(self, curve: Curve) -> float | None:
        """Compute `curve` needs to reach (c)'s final loss, as a fraction of (c)'s compute; None if it never does."""
        reached = compute_to_reach(curve, self.target)
        return None if reached is None else reached / self.large.total_compute

    def growth_jump(self, curve: Curve) -> float:
        """A grown run's validation loss before training minus S's last: 0 if growth preserves the function."""
        return curve.loss[0] - self.small.final_loss

    def table(self) -> str:
        """Markdown: one row per run, then the growth check of each grown run."""
        rows = ["| run | final valid loss | training compute | compute to reach (c)'s final loss "
                f"{self.target:.4f} | as a fraction of (c)'s compute |", "| --- | --- | --- | --- | --- |"]
        for curve in (self.small, *self.grown_runs, self.large):
            reached = compute_to_reach(curve, self.target)
            if reached is None:
                reach, fraction = f"not reached (ends {curve.final_loss - self.target:+.4f} above)", "—"
            else:
                reach, fraction = _flops(reached), f"{reached / self.large.total_compute:.3f}"
            rows.append(f"| {curve.label} | {curve.final_loss:.4f} | {_flops(curve.total_compute)} | {reach} | "
                        f"{fraction} |")
        rows.append("")
        rows += [f"Growth check, {curve.label}: S's last validation loss {self.small.final_loss:.6f}, the grown "
                 f"model's before training {curve.loss[0]:.6f} (difference {self.growth_jump(curve):+.2e})."
                 for curve in self.grown_runs]
        return "\n".join(rows)

    def ratio_line(self) -> str:
        """Each grown run's compute to reach (c)'s final loss over (c)'s, or how far above it ended."""
        parts = []
        for name, curve in (("(b) preserve", self.grown), ("(b') official", self.official)):
            fraction = self.fraction(curve)
            parts.append(f"{name} {fraction:.3f}" if fraction is not None else
                         f"{name} not reached ({curve.final_loss - self.target:+.4f} above after "
                         f"{curve.total_compute / self.large.total_compute:.3f} of (c)'s compute)")
        return f"compute ratio (grown run to reach (c)'s final loss {self.target:.4f} / (c)): " + ", ".join(parts)


def _flops(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP"
