"""Growth benchmark: tools/grow_checkpoint.py on a 1-5B checkpoint vs `cp -r` of the same files.

    .venv/bin/python -m benchmarks.grow --workdir /tmp/grow_bench [--data-parallel 8] [--factor 2] [--config CFG]

The source is configs/1-5B.yml as this machine would train it (bf16, ZeRO stage 1 over --data-parallel ranks,
DeepSpeed's pipeline engine with one stage), synthesised by synthetic_checkpoint.py (22 GB). Then, each in a
fresh process, with wall time, peak resident memory (ru_maxrss: including the pages of memory-mapped files
it touched, which the kernel can drop at any time) and peak anonymous memory (RssAnon, sampled every 0.1 s:
what the process itself holds): `cp -r` of the source, the tool growing it --factor times (every slot count)
in the same layout, `cp -r` again. Needs free disk for the source plus the larger of its copy and the grown
checkpoint (about (1 + 0.85·factor) × 22 GB); everything is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from megatron.config import load_config  # no torch: this process's memory stays small
from megatron.model.spec import layer_token_count, slot_keys

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "1-5B.yml"
# GPT-NeoX-20B's tokenizer (50,277 ids) padded to a multiple of 128; CPU training runs bf16, not fp16.
ON_CPU = {"padded_vocab_size": 50304, "fp16": {"enabled": False}, "bf16": {"enabled": True}}
ITERATION = 1000
GIB = 2**30


def _anonymous_bytes(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def measure(command: list[str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS and peak anonymous memory (GiB) of `command` in a fresh process."""
    start = time.perf_counter()
    pid = os.posix_spawn(command[0], command, os.environ)
    peak_anonymous = 0
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        peak_anonymous = max(peak_anonymous, _anonymous_bytes(pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(command)} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss * 1024 / GIB, peak_anonymous / GIB


def parameters(config, slots: dict[str, int]) -> int:
    """The model's parameter count with these slot counts (embedding and Pattentions; norms are negligible)."""
    per_layer = 2 * config.hidden_size * layer_token_count(slots)
    return config.padded_vocab_size * config.hidden_size + config.num_layers * per_layer


def size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def timed_between_copies(name: str, command: list[str], output: Path, copy_command: list[str],
                         copy: Path) -> list[tuple]:
    """`cp -r` of the source, `command` (writing `output`), `cp -r` again, each in a fresh process and its output
    removed after: rows of (name, seconds, written GiB, peak RSS, peak anonymous)."""
    rows = []
    for label, argv, destination in (("cp -r", copy_command, copy), (name, command, output),
                                     ("cp -r", copy_command, copy)):
        seconds, peak, anonymous = measure(argv)
        rows.append((label, seconds, size(destination) / GIB, peak, anonymous))
        print(f"{label}: {seconds:.1f} s", flush=True)
        shutil.rmtree(destination)
    return rows


def print_rows(rows: list[tuple]) -> float:
    """timed_between_copies' rows as a table; returns the mean of the two copies' seconds."""
    print("| operation | seconds | written (GiB) | peak RSS (GiB) | peak anonymous (GiB) |")
    print("| --- | --- | --- | --- | --- |")
    for name, seconds, written, peak, anonymous in rows:
        print(f"| {name} | {seconds:.1f} | {written:.1f} | {peak:.2f} | {anonymous:.2f} |")
    return (rows[0][1] + rows[2][1]) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True, help="a new directory on the disk to measure")
    parser.add_argument("--data-parallel", type=int, default=8, help="data-parallel ranks of the source")
    parser.add_argument("--factor", type=int, default=2, help="growth factor of every slot count")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the model (default: configs/1-5B.yml)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True)
    try:
        run(args)
    finally:
        shutil.rmtree(args.workdir)


def run(args: argparse.Namespace) -> None:
    work = args.workdir.resolve()
    source_values = {**ON_CPU, "num_gpus": args.data_parallel}
    (work / "source.yml").write_text(yaml.safe_dump(source_values), encoding="utf-8")
    config = load_config([args.config, work / "source.yml"], world_size=args.data_parallel)
    grown_slots = {key: getattr(config, key) * args.factor for key in slot_keys()}
    (work / "target.yml").write_text(yaml.safe_dump({**source_values, **grown_slots}), encoding="utf-8")
    source, copy, grown = work / "source", work / "copy", work / "grown"
    # bf16 weights + fp32 masters + 2 moments in the source; fp32 weights + 2 moments written by the tool
    source_bytes = 14 * parameters(config, {key: getattr(config, key) for key in slot_keys()})
    needed = source_bytes + max(source_bytes, 12 * parameters(config, grown_slots)) + 5 * GIB
    if shutil.disk_usage(work).free < needed:
        raise SystemExit(f"{work}: {shutil.disk_usage(work).free / GIB:.0f} GiB free, the benchmark needs "
                         f"{needed / GIB:.0f} GiB (the source, its copy or the grown checkpoint, 5 GiB to spare)")
    python = sys.executable
    seconds, _, _ = measure([python, str(REPO / "benchmarks" / "synthetic_checkpoint.py"), "--config",
                             str(args.config), str(work / "source.yml"), "--data-parallel", str(args.data_parallel),
                             "--iteration", str(ITERATION), "--save", str(source)])
    print(f"synthesised {size(source) / GIB:.1f} GiB in {seconds:.0f} s", flush=True)

    copy_command = [shutil.which("cp"), "-r", str(source), str(copy)]
    grow_command = [python, str(REPO / "tools" / "grow_checkpoint.py"), "--load", str(source), "--save", str(grown),
                    "--config", str(args.config), str(work / "target.yml")]
    rows = timed_between_copies("grow", grow_command, grown, copy_command, copy)

    print(f"\nsource: {args.config.name}, {config.num_layers} layers, hidden {config.hidden_size}, slots "
          f"{'/'.join(str(getattr(config, key)) for key in slot_keys())}, bf16, ZeRO-1 over {args.data_parallel} "
          f"ranks, {size(source) / GIB:.1f} GiB; grown x{args.factor} (slots "
          f"{'/'.join(map(str, grown_slots.values()))}) in the same layout\n")
    copy_seconds = print_rows(rows)
    print(f"\ngrow / cp -r = {rows[1][1]:.1f} s / {copy_seconds:.1f} s (mean of both copies) = "
          f"{rows[1][1] / copy_seconds:.2f} (target <= 3)")


if __name__ == "__main__":
    main()
