"""Re-shard on resume benchmark: what deepy.py does before launching a resume on another layout (a lost half of the
allocation: ZeRO-1 over --data-parallel ranks resumed on --resume-on) vs `cp -r` of the same checkpoint.

    .venv/bin/python -m benchmarks.reshard --workdir /tmp/reshard_bench [--config configs/1-5B.yml] \\
        [--data-parallel 8] [--resume-on 4]

The source is --config (the size; default configs/1-5B.yml, 22 GB) as this machine would train it, synthesised
as benchmarks/grow.py synthesises it (bf16, ZeRO stage 1, the pipeline engine with one stage). Then, each in a
fresh process: `cp -r` of the checkpoint, the re-shard (megatron/growth/reshard_on_resume.py, as deepy.py calls
it, into the save directory beside the original), `cp -r` again; wall time, peak RSS and peak anonymous memory
(benchmarks/grow.py's `measure`). Needs free disk for the source and its copy (about 2 × the source, with 5 GiB to
spare); everything is deleted at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from benchmarks.grow import (CONFIG, GIB, ITERATION, ON_CPU, measure, parameters, print_rows, size,
                             timed_between_copies)
from megatron.config import load_config  # no torch: this process's memory stays small
from megatron.model.spec import slot_keys

REPO = Path(__file__).resolve().parents[1]


def resume_config(config_files: list[Path], save: Path, processes: int):
    return load_config(config_files, [f"load={save}", f"save={save}", f"num_gpus={processes}",
                                      "user_script=train.py"], world_size=processes)


def reshard_in_this_process(config_files: list[Path], save: Path, processes: int) -> None:
    """The measured command: deepy.py's re-shard before launch."""
    from megatron.launch.preflight import reshard_before_launch

    print(reshard_before_launch(resume_config(config_files, save, processes), processes), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a new directory on the disk to measure")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the model (default: configs/1-5B.yml)")
    parser.add_argument("--data-parallel", type=int, default=8, help="data-parallel ranks of the source")
    parser.add_argument("--resume-on", type=int, default=4, help="data-parallel ranks of the resumed run")
    parser.add_argument("--reshard-only", nargs="+", type=Path, help=argparse.SUPPRESS)  # SAVE CONFIG...: measured
    args = parser.parse_args()
    if args.reshard_only:
        reshard_in_this_process(args.reshard_only[1:], args.reshard_only[0], args.resume_on)
        return
    args.workdir.mkdir(parents=True)
    try:
        run(args)
    finally:
        shutil.rmtree(args.workdir)


def run(args: argparse.Namespace) -> None:
    work = args.workdir.resolve()
    (work / "source.yml").write_text(yaml.safe_dump({**ON_CPU, "num_gpus": args.data_parallel}), encoding="utf-8")
    configs = [args.config.resolve(), work / "source.yml"]
    config = load_config(configs, world_size=args.data_parallel)
    source_bytes = 14 * parameters(config, {key: getattr(config, key) for key in slot_keys()})
    needed = 2 * source_bytes + 5 * GIB
    if shutil.disk_usage(work).free < needed:
        raise SystemExit(f"{work}: {shutil.disk_usage(work).free / GIB:.0f} GiB free, the benchmark needs "
                         f"{needed / GIB:.0f} GiB (the source, its copy or its re-shard, 5 GiB to spare)")
    save, copy = work / "save", work / "copy"
    python = sys.executable
    seconds, _, _ = measure([python, str(REPO / "benchmarks" / "synthetic_checkpoint.py"), "--config",
                             *map(str, configs), "--data-parallel", str(args.data_parallel),
                             "--iteration", str(ITERATION), "--save", str(save)])
    source = save / f"global_step{ITERATION}"
    print(f"synthesised {size(source) / GIB:.1f} GiB in {seconds:.0f} s", flush=True)

    copy_command = [shutil.which("cp"), "-r", str(source), str(copy)]
    reshard_command = [python, "-m", "benchmarks.reshard", "--workdir", str(work), "--resume-on",
                       str(args.resume_on), "--reshard-only", str(save), *map(str, configs)]
    resharded = save / f"global_step{ITERATION}-tp1pp1dp{args.resume_on}"
    rows = timed_between_copies("re-shard", reshard_command, resharded, copy_command, copy)

    print(f"\nsource: {args.config.name}, {config.num_layers} layers, hidden {config.hidden_size}, bf16, ZeRO-1 over "
          f"{args.data_parallel} ranks, {size(source) / GIB:.1f} GiB; re-sharded for {args.resume_on} ranks\n")
    copy_seconds = print_rows(rows)
    print(f"\nre-shard / cp -r = {rows[1][1]:.1f} s / {copy_seconds:.1f} s (mean of both copies) = "
          f"{rows[1][1] / copy_seconds:.2f}")


if __name__ == "__main__":
    main()
