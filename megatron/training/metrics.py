"""Where training metrics go: the console, `log_dir/metrics.jsonl`, TensorBoard, wandb.

Only global rank 0 writes. metrics.jsonl has one JSON object per logged train
step and per evaluation, with at least `iteration`, `split` ("train"/"valid")
and `lm_loss`, so runs can be compared with a few lines of Python (or drawn with
tools/plot_metrics.py). TensorBoard gets a folder per run under tensorboard_dir.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any


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
