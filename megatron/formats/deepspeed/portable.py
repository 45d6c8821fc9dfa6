"""The layout-independent optimizer state of checkpoints the grow tool writes (writer.py), beside DeepSpeed's
model files in the target's tensor/pipeline layout (which hold the weights in fp32, i.e. the masters):

    global_stepN/training_state.json                     {"format": 1, "optimizer_step": 1200}
                                                         (null: no optimizer state, a fresh optimizer starts)
    global_stepN/optimizer_states/mp_rank_XX/NAME.pt     {"exp_avg": ..., "exp_avg_sq": ...}: Adam's moments
                                                         of tensor rank XX's block of TokenFormerModel entry
                                                         NAME, fp32; absent for entries with none

Nothing in it depends on the data-parallel size, the ZeRO stage or the precision, so a run with the
checkpoint's model_parallel_size and pipe_parallel_size loads it whatever those are (portable_restore.py). The
marker file tells these checkpoints from DeepSpeed's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from megatron.checkpoint.parameter_state import ParameterState, as_fp32
from megatron.checkpoint.safety import load_checkpoint_file
from megatron.cli import InputError

MARKER = "training_state.json"
FORMAT = 1
MOMENTS_DIRECTORY = "optimizer_states"


def is_portable(tag_dir: Path) -> bool:
    return (Path(tag_dir) / MARKER).is_file()


def moments_directory(tag_dir: Path, tensor_rank: int) -> Path:
    return Path(tag_dir) / MOMENTS_DIRECTORY / f"mp_rank_{tensor_rank:02d}"


def moments_file(tag_dir: Path, tensor_rank: int, name: str) -> Path:
    return moments_directory(tag_dir, tensor_rank) / f"{name}.pt"


def write_marker(tag_dir: Path, optimizer_step: int | None) -> None:
    (Path(tag_dir) / MARKER).write_text(json.dumps({"format": FORMAT, "optimizer_step": optimizer_step}) + "\n",
                                        encoding="utf-8")


def save_moments(file: Path | BinaryIO, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
    torch.save({"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, file)


class PortableMoments:
    """The moments of a checkpoint in this format, one block at a time."""

    def __init__(self, tag_dir: Path) -> None:
        path = Path(tag_dir) / MARKER
        try:
            marker = json.loads(path.read_text(encoding="utf-8"))
            step = marker["optimizer_step"]
            valid = marker["format"] == FORMAT and (step is None or (isinstance(step, int) and step >= 0))
        except (ValueError, KeyError, TypeError):
            valid = False
        if not valid:
            raise InputError(f"{path} is not a valid {MARKER} (expected {{'format': {FORMAT}, 'optimizer_step': "
                             "N or null}); restore the file the grow tool wrote")
        self.tag_dir, self.step = Path(tag_dir), step

    def with_moments(self, name: str, tensor_rank: int, saved: Tensor) -> ParameterState:
        """The block's state: `saved`, its fp32 weight (the master), with its moments (views of their file)."""
        path = moments_file(self.tag_dir, tensor_rank, name)
        if self.step is None or not path.is_file():
            return ParameterState(as_fp32(saved))
        moments = load_checkpoint_file(path)
        return ParameterState(as_fp32(saved), moments["exp_avg"], moments["exp_avg_sq"])
