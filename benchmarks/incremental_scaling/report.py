"""The study's outputs from its runs' files: curves.json, table.md (with the set-up behind the numbers) and
scaling.png. The set-up lists tokens per parameter, the quantity that decides whether growth can pay off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.incremental_scaling.comparison import Comparison
from benchmarks.incremental_scaling.curves import (
    Curve,
    flops_per_step,
    saved_config,
    validation_curve,
    validation_points,
)
from benchmarks.incremental_scaling.plot import plot_comparison
from megatron.config import Config
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.parameter_count import count_parameters_by_component

LABELS = {"small": "(a) S from scratch", "grown": "(b) S grown to L, preserve",
          "official": "(b') S grown to L, official", "large": "(c) L from scratch"}
RUNS = {"small": ("small", "a_small"), "grown": ("grown_trained", "b_grown"),
        "official": ("official_trained", "b_official"), "large": ("large", "c_large")}  # checkpoints, results


def build_comparison(results: Path, checkpoints: Callable[[str], Path]) -> tuple[Comparison, dict[str, Config]]:
    """The four curves; each grown run's starts with the grown checkpoint's score, at S's total compute."""
    configs = {key: saved_config(checkpoints(checkpoint)) for key, (checkpoint, _) in RUNS.items()}

    def curve(key: str, start: float = 0.0) -> Curve:
        log_dir = results / RUNS[key][1]
        points = validation_points(log_dir / "metrics.jsonl")
        if start and points[0][0] != 0:
            raise ValueError(f"{log_dir}: no evaluation of the grown checkpoint at iteration 0")
        return validation_curve(LABELS[key], points, configs[key], start)

    small = curve("small")
    comparison = Comparison(small, curve("grown", small.total_compute), curve("official", small.total_compute),
                            curve("large"))
    return comparison, configs


def runs(comparison: Comparison) -> dict[str, Curve]:
    return {"small": comparison.small, "grown": comparison.grown, "official": comparison.official,
            "large": comparison.large}


def setup_table(comparison: Comparison, configs: dict[str, Config]) -> str:
    """Per run: model size, FLOPs per token, steps and tokens trained, tokens per parameter."""
    rows = ["| run | parameters (of which Pattention) | training FLOPs/token | steps | tokens | tokens/parameter |",
            "| --- | --- | --- | --- | --- | --- |"]
    caption = "Steps and tokens of each run itself: (b)'s and (b')'s after growth (before it, they are (a))."
    for key, curve in runs(comparison).items():
        cfg = configs[key]
        args = TokenFormerArgs.from_config(cfg)
        counts = count_parameters_by_component(TokenFormerModel(args, device="meta"))
        steps = curve.iterations[-1]
        tokens = steps * cfg.train_batch_size * cfg.seq_length
        rows.append(f"| {curve.label} | {counts['total_params'] / 1e6:.2f}M "
                    f"({(counts['attention'] + counts['ffn']) / 1e6:.2f}M) | "
                    f"{flops_per_token(args, cfg.checkpoint_activations) / 1e6:.1f}M | {steps} | {tokens:,} | "
                    f"{tokens / counts['total_params']:.2f} |")
    return "\n".join([*rows, "", caption])


def write_report(results: Path, checkpoints: Callable[[str], Path], header: list[str]) -> str:
    """Write curves.json, table.md and scaling.png into `results`; returns the table text and its last line,
    the compute ratio."""
    comparison, configs = build_comparison(results, checkpoints)
    curves = {key: {**curve.to_dict(), "flops_per_step": flops_per_step(configs[key])}
              for key, curve in runs(comparison).items()}
    (results / "curves.json").write_text(json.dumps(curves, indent=1) + "\n", encoding="utf-8")
    plot_comparison(comparison, results / "scaling.png")
    text = "\n\n".join(["\n".join(header), setup_table(comparison, configs), comparison.table(),
                        comparison.ratio_line()])
    (results / "table.md").write_text(text + "\n", encoding="utf-8")
    return text
