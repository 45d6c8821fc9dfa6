"""The commands of a plan's steps: exactly what a person would type, so that --dry-run shows them and a log
starts with them.

Training is `deepy.py train.py` with the plan's configs and the stage file; a grown stage's first training
launch scores the grown model before its first step (eval_at_start). Growth is
tools/grow_checkpoint.py from the previous stage's final checkpoint (named by its tag, never `latest`, so a
redone growth cannot pick up another checkpoint) into the stage's own checkpoints directory, with
--reset-iteration: the stage starts at iteration 0 with its own warmup and schedule, as the official
incremental-scaling configs do (the growth mode, its √n and optimizer choices and freezing come from the stage's
config, which the tool reads).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from megatron.config import Config
from megatron.progressive.plan import Plan, Stage

REPO = Path(__file__).resolve().parents[2]
DEEPY, TRAIN_SCRIPT = REPO / "deepy.py", REPO / "train.py"
GROW_TOOL = REPO / "tools" / "grow_checkpoint.py"


SCORE_FIRST = "eval_at_start=true"  # a grown stage's training launch scores the grown model before it trains


def train_command(plan: Plan, stage: Stage, *overrides: str) -> list[str]:
    return [sys.executable, str(DEEPY), str(TRAIN_SCRIPT), *map(str, plan.config_files(stage)), *overrides]


def source_tag(previous: Config) -> str:
    """The previous stage's final checkpoint: the one at its train_iters."""
    return f"global_step{previous.train_iters}"


def grow_command(plan: Plan, stage: Stage, previous: Config) -> list[str]:
    source = plan.previous(stage)
    command = [sys.executable, str(GROW_TOOL), "--load", str(plan.checkpoints(source)), "--tag", source_tag(previous),
               "--save", str(plan.checkpoints(stage)), "--config", *map(str, plan.config_files(stage)),
               "--reset-iteration"]
    return command


def shown(command: list[str]) -> str:
    """A command as a person would type it from here: paths under the current directory made relative."""
    here = Path.cwd()
    return shlex.join(os.path.relpath(part, here) if part.startswith(f"{here}{os.sep}") else part for part in command)
