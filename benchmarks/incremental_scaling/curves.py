"""Validation loss against cumulative training compute, read from a run's own outputs, and one seed's curves.

Compute is counted the way the training log counts it: FLOPs per token from megatron/model/flops.py (the
config a run saved with its checkpoint, so the count is of what actually ran) times the tokens of every
optimizer step up to the evaluation. Evaluation passes are not training compute and are not counted. A grown
stage's curve starts at the compute of the stages before it, with the grown checkpoint scored before training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.incremental_scaling.runs import Run
from megatron.config import Config
from megatron.progressive.costs import stage_cost


@dataclass(frozen=True)
class Curve:
    """One run's validation points, in order; `compute` is cumulative training FLOPs at each point."""

    label: str
    iterations: list[int]
    compute: list[float]
    loss: list[float]

    @property
    def final_loss(self) -> float:
        return self.loss[-1]

    @property
    def total_compute(self) -> float:
        return self.compute[-1]

    def to_dict(self) -> dict:
        return asdict(self)


def flops_per_step(cfg: Config) -> float:
    """Training FLOPs of one optimizer step: the shared per-token formula times the step's tokens."""
    return stage_cost(cfg).flops_per_step


def saved_config(checkpoint_dir: Path) -> Config:
    """The resolved config (vocabulary padding included) a run saved with its newest checkpoint."""
    tag = (checkpoint_dir / "latest").read_text(encoding="utf-8").strip()
    return Config.from_json((checkpoint_dir / tag / "config.json").read_text(encoding="utf-8"))


def validation_points(metrics_path: Path) -> list[tuple[int, float]]:
    """(iteration, lm_loss) of every validation record in a metrics.jsonl, by iteration."""
    records = [json.loads(line) for line in metrics_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    points = {record["iteration"]: record["lm_loss"] for record in records if record["split"] == "valid"}
    if not points:
        raise ValueError(f"{metrics_path} holds no validation record; the run evaluated nothing")
    return sorted(points.items())


def validation_curve(label: str, points: list[tuple[int, float]], cfg: Config, start_compute: float = 0.0) -> Curve:
    """A curve from (iteration, loss) points of a run with config `cfg`; `start_compute` is what was spent
    before its iteration 0 (for a grown model: its source model's training)."""
    step = flops_per_step(cfg)
    return Curve(label, [i for i, _ in points], [start_compute + i * step for i, _ in points],
                 [loss for _, loss in points])


def joined(label: str, parts: list[Curve]) -> Curve:
    """One curve through `parts` in order (a progressive path's stages, each already offset by the compute
    spent before it)."""
    return Curve(label, [i for part in parts for i in part.iterations], [c for part in parts for c in part.compute],
                 [loss for part in parts for loss in part.loss])


def run_curves(run: Run, labels: list[str]) -> tuple[list[Curve], list[Config]]:
    """Each stage's curve, offset by the compute of the stages before it, and the configs the stages saved."""
    curves, configs, start = [], [], 0.0
    for entry, label in zip(run.stages, labels, strict=True):
        log_dir, stage = run.plan.logs(entry.stage), entry.stage
        points = validation_points(log_dir / "metrics.jsonl")
        if stage.index and points[0][0] != 0:
            raise ValueError(f"{log_dir}: no evaluation of the grown checkpoint at iteration 0")
        cfg = saved_config(run.plan.checkpoints(stage))
        curves.append(validation_curve(label, points, cfg, start))
        configs.append(cfg)
        start = curves[-1].total_compute
    return curves, configs


@dataclass(frozen=True)
class PathCurves:
    """A path's stages, the configs they saved, and the whole path as one curve."""

    stages: list[Curve]
    configs: list[Config]
    path: Curve


@dataclass(frozen=True)
class SeedCurves:
    """One seed's curves: the three paths by run key, and the reference, control and dense runs."""

    seed: int
    paths: dict[str, PathCurves]
    singles: dict[str, Curve]
    single_configs: dict[str, Config]

    @property
    def reference(self) -> Curve:
        return self.singles["scratch"]

    def curve(self, key: str) -> Curve:
        return self.paths[key].path if key in self.paths else self.singles[key]
