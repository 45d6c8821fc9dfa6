"""Where training metrics go: the console, `log_dir/metrics.jsonl`, TensorBoard, wandb.

Only global rank 0 writes. metrics.jsonl has one JSON object per logged train
step and per evaluation, with at least `iteration`, `split` ("train"/"valid")
and `lm_loss`, so runs can be compared with a few lines of Python (or drawn with
tools/plot_metrics.py). A resumed run first drops a last line cut short by a kill, so that its first record
is not joined to it. TensorBoard gets a folder per run under tensorboard_dir.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any


def _drop_a_partial_last_line(path: Path) -> None:
    """Cut `path` back to its last complete line: a run killed while writing a record leaves part of it, and a
    record appended there would be joined to it, so that neither reads as JSON."""
    if not path.is_file():
        return
    with open(path, "rb+") as stream:
        size = stream.seek(0, os.SEEK_END)
        if size == 0:
            return
        stream.seek(max(0, size - 1))
        if stream.read(1) == b"\n":
            return
        keep = 0
        for start in range(size, 0, -65536):  # the last newline, read backwards a block at a time
            stream.seek(max(0, start - 65536))
            block = stream.read(start - max(0, start - 65536))
            if (found := block.rfind(b"\n")) >= 0:
                keep = max(0, start - 65536) + found + 1
                break
        stream.truncate(keep)
    print(f"{path}: dropped its last {size - keep} bytes, a record cut short when the run that wrote it was "
          "killed", flush=True)


class MetricsWriter:
    def __init__(self, cfg, rank: int):
        self.enabled = rank == 0
        self._jsonl = None
        self._tensorboard = None
        self._wandb = None
        if not self.enabled:
            return
        if cfg.log_dir:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
            self.path = Path(cfg.log_dir) / "metrics.jsonl"
            _drop_a_partial_last_line(self.path)
            self._jsonl = open(self.path, "a", encoding="utf-8")
        if cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            # A folder per run (start time and host), as TensorBoard expects: one folder's events are one curve.
            run = f"{time.strftime('%Y%m%d-%H%M%S')}_{socket.gethostname()}"
            self.tensorboard_run = Path(cfg.tensorboard_dir) / run
            self._tensorboard = SummaryWriter(log_dir=str(self.tensorboard_run))
        if cfg.use_wandb:
            import wandb

            # WANDB_MODE=offline writes the run locally, for clusters without network.
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                group=cfg.wandb_group,
                entity=cfg.wandb_team,
                dir=cfg.log_dir,
                config=cfg.to_dict(),
                mode=os.environ.get("WANDB_MODE"),
            )

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        split, step = record["split"], record["iteration"]
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(f"{split}/{key}", value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log({f"{split}/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
