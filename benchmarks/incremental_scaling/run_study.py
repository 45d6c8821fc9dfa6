"""Progressive scaling vs training from scratch, end to end with the framework's own tools (issue 11).

    .venv/bin/python -m benchmarks.incremental_scaling.run_study [--data-path PREFIX --vocab-file FILE]
        [--work-dir DIR] [--train-iters T] [--grown-iters N] [--eval-interval K]

(a) trains S from scratch (configs/small.yml); (b) grows S's last checkpoint to L (configs/large.yml, 4x the
parameter tokens) with tools/grow_checkpoint.py, keeping the function (growth_mode preserve), and trains it on
a fresh, shorter schedule (configs/grown.yml); (b') does the same growing as the official code does
(growth_mode official: fresh init of the new tokens, √n of the new count, a fresh optimizer); (c) trains L
from scratch with (a)'s schedule. All read the same batches in the same order and score the same
validation batches. Writes WORK_DIR/results/: each run's metrics.jsonl, curves.json (validation loss against
cumulative training FLOPs, megatron/model/flops.py), table.md and scaling.png; prints the table and, last, the
compute (b) and (b') need to reach (c)'s final validation loss as fractions of (c)'s. The study owns WORK_DIR's
checkpoints/ and results/ and replaces them on every run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.incremental_scaling.stages import GROW_TOOL, REPO, StageFailed, grow_command, run_stage, train_command
from megatron.config import ConfigError, check_run_inputs, load_config

CONFIGS = Path(__file__).resolve().parent / "configs"
COMMON, SMALL, LARGE, GROWN = (CONFIGS / f"{name}.yml" for name in ("common", "small", "large", "grown"))


@dataclass(frozen=True)
class Study:
    """Where everything goes. study.yml holds the command line's overrides for every run and the grow tool
    (which reads YAML files only); `grown_overrides` set (b)'s schedule length."""

    work_dir: Path
    grown_overrides: dict[str, int]

    @property
    def study_yml(self) -> Path:
        return self.work_dir / "study.yml"

    @property
    def results(self) -> Path:
        return self.work_dir / "results"

    def checkpoints(self, name: str) -> Path:
        return self.work_dir / "checkpoints" / name

    def configs(self, *files: Path) -> list[Path]:
        return [COMMON, *files, self.study_yml]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", type=Path, help="corpus PREFIX of PREFIX.bin/.idx (default: the demo corpus)")
    parser.add_argument("--vocab-file", type=Path, help="the corpus's tokenizer file (default: the demo tokenizer)")
    parser.add_argument("--work-dir", type=Path, default=REPO / "work_dirs" / "incremental_scaling",
                        help="checkpoints/ and results/ go here (default: %(default)s)")
    parser.add_argument("--train-iters", type=int, help="steps of (a) and (c) (default: configs/common.yml's)")
    parser.add_argument("--grown-iters", type=int, help="steps of (b) after growth (default: configs/grown.yml's)")
    parser.add_argument("--eval-interval", type=int, help="steps between evaluations (default: configs/common.yml's)")
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> Study:
    """Write study.yml from the command line; the Study reading it."""
    study = Study(args.work_dir.resolve(), {key: args.grown_iters for key in ("lr_decay_iters", "exit_interval")
                                            if args.grown_iters is not None})
    overrides = {"data_path": args.data_path and str(args.data_path.resolve()),
                 "vocab_file": args.vocab_file and str(args.vocab_file.resolve()),
                 "train_iters": args.train_iters, "eval_interval": args.eval_interval}
    study.work_dir.mkdir(parents=True, exist_ok=True)
    study.study_yml.write_text(yaml.safe_dump({k: v for k, v in overrides.items() if v is not None}), encoding="utf-8")
    return study


def check_inputs(study: Study) -> None:
    """Every problem a run or the growth would hit, as one ConfigError before any training starts."""
    from megatron.growth.plan import plan_growth

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("matplotlib is not installed: .venv/bin/pip install -r requirements/requirements-bench.txt")
    if not GROW_TOOL.is_file():
        raise ConfigError(f"{GROW_TOOL} does not exist: the study grows S with it")
    small, large = load_config(study.configs(SMALL)), load_config(study.configs(LARGE))
    for cfg in (small, large):
        check_run_inputs(cfg)
    grown = load_config(study.configs(LARGE, GROWN), [f"{k}={v}" for k, v in study.grown_overrides.items()])
    steps = grown.lr_decay_iters
    if grown.exit_interval != steps or not 0 < steps <= small.train_iters or steps % grown.eval_interval:
        raise ConfigError(f"(b)'s schedule (lr_decay_iters {steps}, exit_interval {grown.exit_interval}) must end "
                          f"where the run does, within train_iters {small.train_iters}, on a multiple of "
                          f"eval_interval {grown.eval_interval} (so its last step is evaluated)")
    plans = [plan_growth(small, large, mode=mode) for mode in ("preserve", "official")]
    print("growth: " + ", ".join(plans[0].summary()), flush=True)


def run(study: Study) -> dict[str, float]:
    """The study's steps in order; seconds each took."""
    for stale in (study.results, study.work_dir / "checkpoints"):
        shutil.rmtree(stale, ignore_errors=True)
    ckpt, large = study.checkpoints, study.configs(LARGE)

    def train(name: str, configs: list[Path], log_dir: str, **overrides: object) -> tuple[str, list[str]]:
        return name, train_command(configs, {**overrides, "log_dir": study.results / log_dir})

    steps = [train("a_small", study.configs(SMALL), "a_small", save=ckpt("small"), load=ckpt("small"))]
    for mode, grown, results in (("preserve", "grown", "b_grown"), ("official", "official", "b_official")):
        steps += [
            (f"grow_{mode}", grow_command(ckpt("small"), ckpt(grown), large, mode)),
            # the grown run's first point: the grown checkpoint scored before any training, at iteration 0
            train(f"{results}_growth_point", large, results, load=ckpt(grown), save=None, eval_only="true"),
            train(results, study.configs(LARGE, GROWN), results, load=ckpt(grown), save=ckpt(f"{grown}_trained"),
                  **study.grown_overrides),
        ]
    steps.append(train("c_large", large, "c_large", save=ckpt("large"), load=ckpt("large")))
    return {name: run_stage(name, command, study.results / "logs" / f"{name}.log") for name, command in steps}


def header(argv: list[str], seconds: dict[str, float], total: float, load: tuple[float, float]) -> list[str]:
    steps = ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
    return [f"Command ({time.strftime('%Y-%m-%d')}): `{' '.join(['.venv/bin/python', *argv])}`",
            f"Runtime {total / 60:.1f} min ({steps}); load average (1 min) {load[0]:.1f} at start, "
            f"{load[1]:.1f} at the end, on {os.cpu_count()} cores."]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        study = prepare(args)
        check_inputs(study)
    except (ConfigError, OSError) as error:
        print(f"run_study.py: error: {error}", file=sys.stderr)
        return 2
    from benchmarks.incremental_scaling.report import write_report  # needs matplotlib, checked above

    start, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        seconds = run(study)
    except StageFailed as error:
        print(f"run_study.py: {error}", file=sys.stderr)
        return 1
    command = ["-m", "benchmarks.incremental_scaling.run_study", *argv]
    text = write_report(study.results, study.checkpoints,
                        header(command, seconds, time.perf_counter() - start, (load_before, os.getloadavg()[0])))
    print(f"\n{text}\n\nresults: {study.results}", flush=True)
    print(text.splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
