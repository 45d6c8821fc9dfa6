"""Does growing save compute against training the large model from scratch? The growth study,
run by the framework's own driver.

    .venv/bin/python -m benchmarks.incremental_scaling.run_study            # the study, both tasks
    .venv/bin/python -m benchmarks.incremental_scaling.run_study --quick    # a quick check of the whole
        [--task markov knowledge] [--data-path PREFIX --vocab-file FILE] [--work-dir DIR] [--plan PLAN]
        [--scratch-iters N] [--scale F] [--seeds N ...] [--fresh]

For each task and seed, a set of runs, each a plan for tools/progressive_scaling.py's driver (runs.py): the
progressive path S1 -> S2 -> S3 (configs/plan.yml: each stage 2x the parameter tokens of the one before) in
growth mode preserve, the same path in growth mode official, the ablation (the path with one factor of a mode
changed: runs.ABLATION), the same stages without growth (the restarts alone), S3 from scratch (the reference),
S1 trained longer (the control) and the dense Transformer of S3's size from scratch. All share configs/common.yml
and the task's corpus, built first if missing: markov (data_prep/markov_corpus.py) and knowledge
(data_prep/knowledge_corpus.py), two tasks whose optimum needs capacity; --data-path runs one other corpus.
Before anything trains, every run's config is checked and the FLOPs formula's prediction printed; then the runs,
then WORK_DIR/TASK/results/: curves.json, table.md, scaling.png. The last lines printed are each task's verdict:
the compute each path needs to reach the reference's final loss, with its spread over the seeds, or "not
capacity-bound: no verdict". The driver continues runs an earlier invocation left unfinished; --fresh starts over.
--quick: one seed, one process a run, every run 20x shorter, the plan's first two stages, the ablation on the first
task only, without the restarts and the dense Transformer: it checks that everything works (its numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks.incremental_scaling.runs import (
    SCRATCH_ITERS,
    SEEDS,
    SHARING_FIRST_STAGE,
    TEMPLATE,
    Run,
    share_first_stage,
    write_runs,
)
from megatron.config import ConfigError
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.progressive.commands import REPO
from megatron.progressive.local import run_plan
from megatron.progressive.processes import Interrupted, StepFailed

# task -> (its data_prep script, its dataset's name); built under data/TASK when missing
TASKS = {"markov": ("markov_corpus.py", "markov_text_document"),
         "knowledge": ("knowledge_corpus.py", "knowledge_text_document")}
CUSTOM_TASK = "corpus"  # the task name of --data-path's corpus
QUICK_SCALE = 0.05
QUICK_SEEDS = [1]
QUICK_SETTINGS = {"eval_interval": 4, "eval_iters": 2, "log_interval": 4, "num_gpus": 1}
MAX_EPOCH_SHARE = 0.9  # every run must read its batches from the first epoch, the same order for all


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"one seed, one process a run, every run {1 / QUICK_SCALE:.0f}x shorter and evaluated "
                        f"every {QUICK_SETTINGS['eval_interval']} steps, the plan's first two stages, the ablation on "
                        "the first task only, no restarts or dense runs: checks the study works in a few minutes "
                        "(its numbers mean nothing)")
    parser.add_argument("--task", nargs="+", choices=list(TASKS), default=list(TASKS),
                        help="the tasks (corpora) to run the study on (default: %(default)s)")
    parser.add_argument("--plan", type=Path, default=TEMPLATE,
                        help="the progressive path's plan; its first stage is the control's model, its last the "
                        "from-scratch reference's (default: configs/plan.yml, S1 -> S2 -> S3)")
    parser.add_argument("--scratch-iters", type=int, default=SCRATCH_ITERS,
                        help="steps of the last stage's model trained from scratch (default: %(default)s)")
    parser.add_argument("--scale", type=float, help="multiply every run's steps by this (default 1, --quick 0.05)")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help=f"one set of runs per seed (default: {' '.join(map(str, SEEDS))}; --quick "
                        f"{' '.join(map(str, QUICK_SEEDS))})")
    parser.add_argument("--data-path", type=Path, help="corpus PREFIX of PREFIX.bin/.idx: the study on this corpus "
                        f"alone (task name {CUSTOM_TASK!r}) instead of --task's")
    parser.add_argument("--vocab-file", type=Path, help="the corpus's tokenizer file")
    parser.add_argument("--work-dir", type=Path, help="plans, runs and results/ go here (default: "
                        "work_dirs/scaling_study, with --quick work_dirs/scaling_study_quick)")
    parser.add_argument("--fresh", action="store_true", help="remove the work dir's earlier runs first")
    args = parser.parse_args(argv)
    if (args.data_path is None) != (args.vocab_file is None):
        parser.error("--data-path and --vocab-file go together: the corpus and the tokenizer it was made with")
    args.scale = args.scale or (QUICK_SCALE if args.quick else 1.0)
    args.seeds = args.seeds or (QUICK_SEEDS if args.quick else list(SEEDS))
    args.tasks = [CUSTOM_TASK] if args.data_path is not None else list(dict.fromkeys(args.task))
    args.work_dir = (args.work_dir or REPO / "work_dirs" / ("scaling_study_quick" if args.quick else "scaling_study"))
    args.work_dir = args.work_dir.resolve()
    return args


def corpus(args: argparse.Namespace, task: str) -> tuple[Path, Path]:
    """(PREFIX, tokenizer) of a task's corpus, built by its data_prep script when missing."""
    if task == CUSTOM_TASK:
        return args.data_path.resolve(), args.vocab_file.resolve()
    script, name = TASKS[task]
    out = REPO / "data" / task
    prefix, vocab = out / name, out / "tokenizer.json"
    if not (prefix.with_suffix(".idx").is_file() and vocab.is_file()):
        print(f"building the corpus: data_prep/{script} --out {out}", flush=True)
        subprocess.run([sys.executable, str(REPO / "data_prep" / script), "--out", str(out)], cwd=REPO, check=True)
    return prefix, vocab


def write_shared(args: argparse.Namespace, work_dir: Path, prefix: Path, vocab: Path) -> Path:
    """study.yml, merged after configs/common.yml in every run: the corpus, a free port, --quick's evaluations."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = {"data_path": str(prefix), "vocab_file": str(vocab), "master_port": port,
                **(QUICK_SETTINGS if args.quick else {})}
    path = work_dir / "study.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return path


def check_one_epoch(runs: dict[str, Run], prefix: Path) -> None:
    """Runs needing different numbers of epochs shuffle the corpus differently: keep every run within one."""
    tokens = int(MMapIndexedDataset(str(prefix)).sizes.sum(dtype="int64"))
    for run in runs.values():
        for entry in run.stages:
            cfg = entry.config
            train_share = float(cfg.split.split(",")[0]) / sum(float(part) for part in cfg.split.split(","))
            epoch = tokens * train_share / cfg.seq_length
            needed = cfg.train_iters * cfg.train_batch_size
            if needed > MAX_EPOCH_SHARE * epoch:
                raise ConfigError(f"{run.plan.path}: stage {entry.stage.name!r} reads {needed:,} sequences, more "
                                  f"than {MAX_EPOCH_SHARE:.0%} of one epoch of {prefix}'s training split "
                                  f"(~{epoch:,.0f}), so the runs would not read the same batches: use a larger corpus "
                                  "or a smaller --scale")


def corpus_line(prefix: Path) -> str:
    """The corpus, and what its source says of the losses when a data_prep script of TASKS made it."""
    markov, knowledge = prefix.parent / "markov_source.json", prefix.parent / "knowledge_source.json"
    if markov.is_file():
        facts = json.loads(markov.read_text(encoding="utf-8"))
        return (f"Corpus: {prefix}, an order-2 Markov source over {facts['vocab']} tokens (seed {facts['seed']}): "
                f"entropy rate {facts['entropy_rate_nats']:.4f} nats per token (the loss of a model holding the "
                f"whole table, before the documents' first tokens), ln {facts['vocab']} = "
                f"{facts['uniform_nats']:.4f} (one holding none of it).")
    if knowledge.is_file():
        facts = json.loads(knowledge.read_text(encoding="utf-8"))
        return (f"Corpus: {prefix}, synthetic knowledge (data_prep/knowledge_corpus.py, seed {facts['seed']}): "
                f"{facts['people']:,} made-up people with {len(facts['attributes'])} attributes of "
                f"{facts['values_per_attribute']} values each ({facts['facts']:,} facts, {facts['fact_bits']:,.0f} "
                f"bits), stated in sentences from templates; at most {facts['floor_nats']:.4f} nats per token for a "
                f"model knowing every fact, {facts['no_facts_nats']:.4f} for one knowing none.")
    return f"Corpus: {prefix}."


def header(argv: list[str], seconds: dict[str, float], total: float, load: tuple[float, float],
           prefix: Path) -> list[str]:
    steps = ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
    return [f"Command ({time.strftime('%Y-%m-%d')}): `{' '.join(['.venv/bin/python', *argv])}`",
            f"Runtime {total / 60:.1f} min ({steps}, all seeds); load average (1 min) {load[0]:.1f} at start, "
            f"{load[1]:.1f} at the end, on {os.cpu_count()} cores.", corpus_line(prefix)]


def prepare(args: argparse.Namespace, task: str) -> tuple[dict[int, dict[str, Run]], Path]:
    """One task's runs for every seed, their plans written under WORK_DIR/TASK and checked (ConfigError), and the
    corpus's prefix."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("matplotlib is not installed: .venv/bin/pip install -r requirements/requirements-bench.txt")
    if len(set(args.seeds)) != len(args.seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, args.seeds))}: a seed given twice would be counted twice")
    work_dir = args.work_dir / task
    if args.fresh:
        for directory in [*work_dir.glob("seed*"), work_dir / "results"]:
            shutil.rmtree(directory, ignore_errors=True)
    prefix, vocab = corpus(args, task)
    shared = write_shared(args, work_dir, prefix, vocab)
    ablation = not args.quick or task == args.tasks[0]  # --quick: the ablation on the first task only
    studies = {seed: write_runs(work_dir / f"seed{seed}", shared, args.scale, seed, args.plan,
                                args.scratch_iters, args.quick, ablation) for seed in args.seeds}
    for runs in studies.values():
        check_one_epoch(runs, prefix)
    return studies, prefix


def run_task(args: argparse.Namespace, argv: list[str], task: str, studies: dict[int, dict[str, Run]],
             prefix: Path) -> str:
    """Every run of one task, then its report; returns its verdict line. StepFailed, ConfigError or
    Interrupted stop it."""
    from benchmarks.incremental_scaling.report import prediction, write_report  # needs matplotlib, checked first

    print(f"=== task {task}\nprediction: " + "\n            ".join(prediction(next(iter(studies.values())))),
          flush=True)
    start, load_before, seconds = time.perf_counter(), os.getloadavg()[0], {}
    for seed, runs in studies.items():
        for key, run in runs.items():
            began = time.perf_counter()
            print(f"--- {task}, seed {seed}, {key}: {run.plan.path}", flush=True)
            if key in SHARING_FIRST_STAGE and share_first_stage(runs["progressive"], run):
                print(f"its first stage: a copy of {runs['progressive'].plan.work_dir}'s", flush=True)
            run_plan(run.plan, run.stages, echo=False)
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - began
    command = ["-m", "benchmarks.incremental_scaling.run_study", *argv]
    results = args.work_dir / task / "results"
    text = write_report(studies, results, header(command, seconds, time.perf_counter() - start,
                                              (load_before, os.getloadavg()[0]), prefix))
    print(f"\n{text}\n\nresults: {results}", flush=True)
    return text.splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        prepared = {task: prepare(args, task) for task in args.tasks}
    except (ConfigError, OSError, subprocess.CalledProcessError) as error:
        print(f"run_study.py: error: {error}", file=sys.stderr)
        return 2
    verdicts = {}
    try:
        for task, (studies, prefix) in prepared.items():
            verdicts[task] = run_task(args, argv, task, studies, prefix)
    except (StepFailed, ConfigError) as error:
        print(f"run_study.py: {error}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"run_study.py: {stop}", file=sys.stderr)
        return 128 + stop.number
    for task, verdict in verdicts.items():
        print(f"{task}: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
