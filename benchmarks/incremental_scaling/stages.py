"""Running the study's steps as a user would: `deepy.py train.py` and `tools/grow_checkpoint.py`, each in its
own process from the repository root, its output kept in a log file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GROW_TOOL = REPO / "tools" / "grow_checkpoint.py"


class StageFailed(RuntimeError):
    """A step exited non-zero; the message ends with the tail of its log."""


def train_command(configs: list[Path], overrides: dict[str, object]) -> list[str]:
    """`deepy.py train.py CONFIGS key=value ...` (None values become YAML null)."""
    pairs = [f"{key}={'null' if value is None else value}" for key, value in overrides.items()]
    return [sys.executable, "deepy.py", "train.py", *map(str, configs), *pairs]


def grow_command(load: Path, save: Path, configs: list[Path], growth_mode: str) -> list[str]:
    """Grow `load`'s newest checkpoint into `save` with the target run's configs, starting a new stage
    (iteration 0: the grown run's own schedule)."""
    return [sys.executable, str(GROW_TOOL), "--load", str(load), "--save", str(save), "--config", *map(str, configs),
            "--growth-mode", growth_mode, "--reset-iteration"]


def run_stage(name: str, command: list[str], log_path: Path) -> float:
    """Run `command` from the repository root, its output into `log_path`; seconds taken."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {name} (log: {log_path})", flush=True)
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        result = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-30:])
        raise StageFailed(f"{name} exited {result.returncode} after {seconds:.0f} s; last lines of {log_path}:\n{tail}")
    print(f"    done in {seconds:.0f} s", flush=True)
    return seconds
