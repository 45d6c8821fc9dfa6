"""Does growing save compute against training the large model from scratch? The growth study (issues 19, 28),
run by the framework's own driver.

    .venv/bin/python -m benchmarks.incremental_scaling.run_study            # the study (about 40 min on 2 cores)
    .venv/bin/python -m benchmarks.incremental_scaling.run_study --quick    # every run ~20x shorter: a few minutes
        [--data-path PREFIX --vocab-file FILE] [--work-dir DIR] [--plan PLAN] [--scratch-iters N]
        [--scale F] [--seeds N ...] [--fresh]

For each seed, six runs, each a plan for tools/progressive_scaling.py's driver (runs.py): the progressive path
S1 -> S2 -> S3 (configs/plan.yml: each stage 2x the parameter tokens of the one before) in growth mode preserve,
the same path in growth mode official, the same stages without growth (the restarts alone), S3 from scratch (the
reference), S1 trained longer (the control) and the dense Transformer of S3's size from scratch. All share
configs/common.yml and the corpus: by default data_prep/markov_corpus.py's (built first if missing, in a second),
a task whose optimum needs capacity. Before anything trains, every run's config is checked and the FLOPs
formula's prediction printed; then the runs, then WORK_DIR/results/: curves.json, table.md, scaling.png. The last
line printed is the verdict: the compute each path needs to reach the reference's final loss, with its spread
over the seeds, or "not capacity-bound: no verdict". The driver continues runs an earlier invocation left
unfinished; --fresh starts over.
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

MARKOV_CORPUS = REPO / "data" / "markov"
QUICK_SCALE = 0.05
QUICK_SETTINGS = {"eval_interval": 4, "eval_iters": 2, "log_interval": 4}
MAX_EPOCH_SHARE = 0.9  # every run must read its batches from the first epoch, the same order for all


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"every run {1 / QUICK_SCALE:.0f}x shorter, evaluated every "
                        f"{QUICK_SETTINGS['eval_interval']} steps: checks the study works, in a few minutes (its "
                        "numbers mean nothing)")
    parser.add_argument("--plan", type=Path, default=TEMPLATE,
                        help="the progressive path's plan; its first stage is the control's model, its last the "
                        "from-scratch reference's (default: configs/plan.yml, S1 -> S2 -> S3)")
    parser.add_argument("--scratch-iters", type=int, default=SCRATCH_ITERS,
                        help="steps of the last stage's model trained from scratch (default: %(default)s)")
    parser.add_argument("--scale", type=float, help="multiply every run's steps by this (default 1, --quick 0.05)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="one set of runs per seed (default: %(default)s)")
    parser.add_argument("--data-path", type=Path, help="corpus PREFIX of PREFIX.bin/.idx (default: the order-2 "
                        "Markov corpus, built by data_prep/markov_corpus.py if missing)")
    parser.add_argument("--vocab-file", type=Path, help="the corpus's tokenizer file")
    parser.add_argument("--work-dir", type=Path, help="plans, runs and results/ go here (default: "
                        "work_dirs/scaling_study, with --quick work_dirs/scaling_study_quick)")
    parser.add_argument("--fresh", action="store_true", help="remove the work dir's earlier runs first")
    args = parser.parse_args(argv)
    if (args.data_path is None) != (args.vocab_file is None):
        parser.error("--data-path and --vocab-file go together: the corpus and the tokenizer it was made with")
    args.scale = args.scale or (QUICK_SCALE if args.quick else 1.0)
    args.work_dir = (args.work_dir or REPO / "work_dirs" / ("scaling_study_quick" if args.quick else "scaling_study"))
    args.work_dir = args.work_dir.resolve()
    return args


def corpus(args: argparse.Namespace) -> tuple[Path, Path]:
    """(PREFIX, tokenizer) of the study's corpus; the order-2 Markov corpus is built when missing."""
    if args.data_path is not None:
        return args.data_path.resolve(), args.vocab_file.resolve()
    prefix, vocab = MARKOV_CORPUS / "markov_text_document", MARKOV_CORPUS / "tokenizer.json"
    if not (prefix.with_suffix(".idx").is_file() and vocab.is_file()):
        print(f"building the corpus: data_prep/markov_corpus.py --out {MARKOV_CORPUS}", flush=True)
        subprocess.run([sys.executable, str(REPO / "data_prep" / "markov_corpus.py"), "--out", str(MARKOV_CORPUS)],
                       cwd=REPO, check=True)
    return prefix, vocab


def write_shared(args: argparse.Namespace, prefix: Path, vocab: Path) -> Path:
    """study.yml, merged after configs/common.yml in every run: the corpus, a free port, --quick's evaluations."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = {"data_path": str(prefix), "vocab_file": str(vocab), "master_port": port,
                **(QUICK_SETTINGS if args.quick else {})}
    path = args.work_dir / "study.yml"
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
    """The corpus, and its source's entropy rate when data_prep/markov_corpus.py made it."""
    source = prefix.parent / "markov_source.json"
    if not source.is_file():
        return f"Corpus: {prefix}."
    facts = json.loads(source.read_text(encoding="utf-8"))
    return (f"Corpus: {prefix}, an order-2 Markov source over {facts['vocab']} tokens (seed {facts['seed']}): "
            f"entropy rate {facts['entropy_rate_nats']:.4f} nats per token (the loss of a model holding the whole "
            f"table, before the documents' first tokens), ln {facts['vocab']} = {facts['uniform_nats']:.4f} (one "
            "holding none of it).")


def header(argv: list[str], seconds: dict[str, float], total: float, load: tuple[float, float],
           prefix: Path) -> list[str]:
    steps = ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
    return [f"Command ({time.strftime('%Y-%m-%d')}): `{' '.join(['.venv/bin/python', *argv])}`",
            f"Runtime {total / 60:.1f} min ({steps}, all seeds); load average (1 min) {load[0]:.1f} at start, "
            f"{load[1]:.1f} at the end, on {os.cpu_count()} cores.", corpus_line(prefix)]


def prepare(args: argparse.Namespace) -> tuple[dict[int, dict[str, Run]], Path]:
    """Every seed's runs, their plans written and checked, as one ConfigError before any training; and the
    corpus's prefix."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("matplotlib is not installed: .venv/bin/pip install -r requirements/requirements-bench.txt")
    if len(set(args.seeds)) != len(args.seeds):
        raise ConfigError(f"--seeds {' '.join(map(str, args.seeds))}: a seed given twice would be counted twice")
    if args.fresh:
        for directory in [*args.work_dir.glob("seed*"), args.work_dir / "results"]:
            shutil.rmtree(directory, ignore_errors=True)
    prefix, vocab = corpus(args)
    shared = write_shared(args, prefix, vocab)
    studies = {seed: write_runs(args.work_dir / f"seed{seed}", shared, args.scale, seed, args.plan,
                                args.scratch_iters) for seed in args.seeds}
    for runs in studies.values():
        check_one_epoch(runs, prefix)
    return studies, prefix


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        studies, prefix = prepare(args)
    except (ConfigError, OSError, subprocess.CalledProcessError) as error:
        print(f"run_study.py: error: {error}", file=sys.stderr)
        return 2
    from benchmarks.incremental_scaling.report import prediction, write_report  # needs matplotlib, checked above

    print("prediction: " + "\n            ".join(prediction(next(iter(studies.values())))), flush=True)
    start, load_before, seconds = time.perf_counter(), os.getloadavg()[0], {}
    try:
        for seed, runs in studies.items():
            for key, run in runs.items():
                began = time.perf_counter()
                print(f"--- seed {seed}, {key}: {run.plan.path}", flush=True)
                if key in SHARING_FIRST_STAGE and share_first_stage(runs["progressive"], run):
                    print(f"its first stage: a copy of {runs['progressive'].plan.work_dir}'s", flush=True)
                run_plan(run.plan, run.stages, echo=False)
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - began
    except (StepFailed, ConfigError) as error:
        print(f"run_study.py: {error}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"run_study.py: {stop}", file=sys.stderr)
        return 128 + stop.number
    command = ["-m", "benchmarks.incremental_scaling.run_study", *argv]
    results = args.work_dir / "results"
    text = write_report(studies, results, header(command, seconds, time.perf_counter() - start,
                                              (load_before, os.getloadavg()[0]), prefix))
    print(f"\n{text}\n\nresults: {results}", flush=True)
    print(text.splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
