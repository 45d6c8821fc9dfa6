"""The study's outputs from its runs' files: curves.json, table.md and scaling.png.

table.md holds, in order: what the FLOPs formula predicted before anything ran (Pattention's share, what S1 and
S2 cost, so what the grown S3 must do for the path to save half), the set-up (sizes, tokens per parameter), the
result (compute to reach the large model's from-scratch loss) for the path in each growth mode, the growth
checks, and the attribution against the small model trained longer. Its last line is the compute ratio.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from benchmarks.incremental_scaling.comparison import Comparison, compute_to_reach, tflop_text
from benchmarks.incremental_scaling.curves import Curve, joined, saved_config, validation_curve, validation_points
from benchmarks.incremental_scaling.plot import plot_comparison
from benchmarks.incremental_scaling.runs import GROWTH_MODES, Run
from megatron.config import Config
from megatron.progressive.costs import StageCost, stage_cost


def run_curves(run: Run, labels: list[str]) -> tuple[list[Curve], list[Config]]:
    """Each stage's curve, offset by the compute of the stages before it, and the configs the stages saved."""
    curves, configs, start = [], [], 0.0
    for entry, label in zip(run.stages, labels):
        log_dir, stage = run.plan.logs(entry.stage), entry.stage
        points = validation_points(log_dir / "metrics.jsonl")
        if stage.index and points[0][0] != 0:
            raise ValueError(f"{log_dir}: no evaluation of the grown checkpoint at iteration 0")
        cfg = saved_config(run.plan.checkpoints(stage))
        curves.append(validation_curve(label, points, cfg, start))
        configs.append(cfg)
        start = curves[-1].total_compute
    return curves, configs


def stage_labels(run: Run) -> list[str]:
    names, mode = [entry.stage.name.upper() for entry in run.stages], GROWTH_MODES[run.key]
    return [names[0], *(f"{name} (grown from {before}, {mode})" for before, name in zip(names, names[1:]))]


class PathCurves(NamedTuple):
    """A progressive run's stages, their configs, and the whole path as one curve."""

    stages: list[Curve]
    configs: list[Config]
    path: Curve


def path_curves(run: Run) -> PathCurves:
    stages, configs = run_curves(run, stage_labels(run))
    label = " → ".join(curve.label.split()[0] for curve in stages) + f" (progressive, {GROWTH_MODES[run.key]})"
    return PathCurves(stages, configs, joined(label, stages))


def prediction(runs: dict[str, Run]) -> list[str]:
    """What megatron/model/flops.py says before anything runs."""
    stages = [stage_cost(entry.config) for entry in runs["progressive"].stages]
    names = [entry.stage.name.upper() for entry in runs["progressive"].stages]
    scratch = runs["scratch"].compute
    before_last = sum(cost.training_flops for cost in stages[:-1]) / scratch
    shares = ", ".join(f"{name} {cost.pattention_share:.0%}" for name, cost in zip(names, stages))
    per_token = ", ".join(f"{name} {cost.flops_per_token / stages[-1].flops_per_token:.2f}"
                          for name, cost in zip(names[:-1], stages[:-1]))
    lines = [f"Pattention's share of the forward FLOPs: {shares}. Training FLOPs per token relative to "
             f"{names[-1]}: {per_token}.",
             "Planned compute as a fraction of the large model from scratch: " + ", ".join(
                 f"{name} {cost.training_flops / scratch:.3f}" for name, cost in zip(names, stages))
             + f"; the path {runs['progressive'].compute / scratch:.3f} in all, the control the same."]
    if before_last < 0.5:
        lines.append(f"So the path saves 50% or more only if {names[-1]}, after growth, reaches the from-scratch "
                     f"model's final loss within {0.5 - before_last:.3f} of that model's compute "
                     f"({(0.5 - before_last) / (stages[-1].training_flops / scratch):.0%} of its own stage).")
    else:
        lines.append(f"{' and '.join(names[:-1])} alone cost {before_last:.3f} of it: this plan cannot save 50%.")
    return lines


def _setup_row(label: str, cost: StageCost, steps: int) -> str:
    tokens = steps * cost.tokens_per_step
    return (f"| {label} | {cost.parameters / 1e6:.2f}M ({cost.pattention_parameters / 1e6:.2f}M) | "
            f"{cost.pattention_share:.0%} | {cost.flops_per_token / 1e6:.1f}M | {steps} | {tokens:,} | "
            f"{tokens / cost.parameters:.3f} |")


def setup_table(curves: list[Curve], configs: list[Config]) -> str:
    rows = ["| run | parameters (of which Pattention) | Pattention share of FLOPs | training FLOPs/token | steps | "
            "tokens | tokens/parameter |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows += [_setup_row(curve.label, stage_cost(cfg), cfg.train_iters) for curve, cfg in zip(curves, configs)]
    return "\n".join([*rows, "", "Steps and tokens of each run itself (a grown stage's after growth)."])


def growth_checks(stages: list[Curve]) -> list[str]:
    return [f"Growth check, {after.label}: the stage before ended at validation loss {before.final_loss:.6f}, the "
            f"grown model scores {after.loss[0]:.6f} before training "
            f"(difference {after.loss[0] - before.final_loss:+.2e})." for before, after in zip(stages, stages[1:])]


def attribution(comparison: Comparison, stages: list[Curve], path: Curve, control: Curve) -> str:
    """How a path's result splits into what a small model trained longer gets anyway and what growing adds."""
    reached_path, reached_control = comparison.fraction(path), comparison.fraction(control)
    before_last = stages[-1].compute[0] / comparison.reference.total_compute
    if reached_path is None:
        return (f"{path.label} does not reach the target (the stages before the last cost {before_last:.3f} of the "
                "from-scratch compute).")
    reached = compute_to_reach(path, comparison.target)
    during = next(stage for stage in stages if reached <= stage.total_compute).label.split()[0]
    text = (f"{path.label} reaches the target during {during}, at {reached_path:.3f} of the from-scratch compute "
            f"(the stages before the last cost {before_last:.3f} of it)")
    if reached_control is None:
        return text + ("; the small model trained on as much compute never does, so the saving is growth's, not "
                       "a small model's.")
    if reached_control <= reached_path:
        return text + (f"; the small model trained longer gets there at {reached_control:.3f}, with no more compute: "
                       "at this budget the saving is a small model's, and growing adds nothing to it.")
    return text + (f"; the small model trained longer needs {reached_control:.3f}: growing saves "
                   f"{reached_control - reached_path:.3f} of the from-scratch compute beyond training it longer.")


def modes_line(preserve: Curve, official: Curve) -> str:
    """The two growth modes against each other: same stages, same compute, same first stage."""
    gap = official.final_loss - preserve.final_loss
    better = "preserve" if gap > 0 else "official" if gap < 0 else "neither"
    return (f"Growth modes at equal compute ({tflop_text(preserve.total_compute)} each, the same first stage): "
            f"preserve ends at {preserve.final_loss:.4f}, official at {official.final_loss:.4f} ({gap:+.4f}; lower: "
            f"{better}).")


def write_report(runs: dict[str, Run], results: Path, header: list[str]) -> str:
    """Write curves.json, table.md and scaling.png into `results`; returns the table text, whose last line is
    the compute ratio."""
    paths = {key: path_curves(runs[key]) for key in GROWTH_MODES}
    preserve, official = paths["progressive"], paths["official"]
    stages = preserve.stages
    (scratch,), (scratch_config,) = run_curves(runs["scratch"], [f"{stages[-1].label.split()[0]} from scratch"])
    (control,), (control_config,) = run_curves(runs["control"], [f"{stages[0].label} trained longer"])
    comparison = Comparison(scratch, (*(p.path for p in paths.values()), control))
    curves = {"paths": {GROWTH_MODES[key]: {"stages": [curve.to_dict() for curve in p.stages], "path": p.path.to_dict()}
                        for key, p in paths.items()},
              "scratch": scratch.to_dict(), "control": control.to_dict(), "target": comparison.target,
              "reached": {curve.label: compute_to_reach(curve, comparison.target) for curve in comparison.runs}}
    results.mkdir(parents=True, exist_ok=True)
    (results / "curves.json").write_text(json.dumps(curves, indent=1) + "\n", encoding="utf-8")
    plot_comparison(comparison, [p.stages for p in paths.values()], control, results / "scaling.png")
    # the official path's first stage is the preserve path's (a copy): listed once
    setup = setup_table([*stages, *official.stages[1:], scratch, control],
                        [*preserve.configs, *official.configs[1:], scratch_config, control_config])
    checks = [*growth_checks(stages), *growth_checks(official.stages)]
    text = "\n\n".join(["\n".join(header), "Prediction (megatron/model/flops.py, before the runs): "
                        + " ".join(prediction(runs)), setup, comparison.table(), "\n".join(checks),
                        *(attribution(comparison, p.stages, p.path, control) for p in paths.values()),
                        modes_line(preserve.path, official.path), comparison.ratio_line()])
    (results / "table.md").write_text(text + "\n", encoding="utf-8")
    return text
