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
    grown: Curve  # (b), its first point the grown checkpoint before any training
    large: Curve  # (c)

    @property
    def target(self) -> float:
        return self.large.final_loss

    @property
    def grown_fraction(self) -> float | None:
        """Compute (b) needs to reach (c)'s final loss, as a fraction of (c)'s compute; None if it never does."""
        reached = compute_to_reach(self.grown, self.target)
        return None if reached is None else reached / self.large.total_compute

    @property
    def growth_jump(self) -> float:
        """Validation loss of the grown model before training minus S's last: 0 if growth preserves the function."""
        return self.grown.loss[0] - self.small.final_loss

    def table(self) -> str:
        """Markdown: one row per run, then the growth check."""
        c_compute = self.large.total_compute
        rows = ["| run | final valid loss | training compute | compute to reach (c)'s final loss "
                f"{self.target:.4f} | as a fraction of (c)'s compute |", "| --- | --- | --- | --- | --- |"]
        for curve in (self.small, self.grown, self.large):
            reached = compute_to_reach(curve, self.target)
            if reached is None:
                reach, fraction = f"not reached (ends {curve.final_loss - self.target:+.4f} above)", "—"
            else:
                reach, fraction = _flops(reached), f"{reached / c_compute:.3f}"
            rows.append(f"| {curve.label} | {curve.final_loss:.4f} | {_flops(curve.total_compute)} | {reach} | "
                        f"{fraction} |")
        rows.append("")
        rows.append(f"Growth check: S's last validation loss {self.small.final_loss:.6f}, the grown model's before "
                    f"training {self.grown.loss[0]:.6f} (difference {self.growth_jump:+.2e}).")
        return "\n".join(rows)

    def ratio_line(self) -> str:
        fraction = self.grown_fraction
        if fraction is None:
            gap = self.grown.final_loss - self.target
            return (f"(b) did not reach (c)'s final loss {self.target:.4f}: it ended {gap:+.4f} above, after "
                    f"{self.grown.total_compute / self.large.total_compute:.3f} of (c)'s compute")
        return f"compute ratio (b to reach (c)'s final loss / (c)): {fraction:.3f}"


def _flops(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP"
