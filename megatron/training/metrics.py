"""Where training metrics go: the console, `log_dir/metrics.jsonl`, TensorBoard, wandb.

Only global rank 0 writes. metrics.jsonl has one JSON object per logged train
step and per evaluation, with at least `iteration`, `split` ("train"/"valid")
and `lm_loss`, so runs can be compared with a few lines of Python (or drawn with
tools/plot_metrics.py). A resumed training run's file reads as one run: before appending, the run drops the
records an earlier attempt logged after the checkpoint it resumes (it logs those iterations again) and any
record cut short by a kill, rewriting the file atomically. An eval_only run may share the log_dir of a live
run, whose file it does not own: it only appends whole lines. deepy.py appends a "restart" record (no lm_loss)
for each restart (launch/restarts.py, host/metrics_file.py), at the iteration the restart resumes from, which the
resumed run keeps. A growth inside the run (growth_schedule) logs a "growth" record at its iteration; a run resuming
that iteration's checkpoint (the model before the growth) drops it and grows again.
TensorBoard gets a folder per run under tensorboard_dir.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from megatron.checkpoint.manifest import write_durably
from megatron.host.metrics_file import FILE_NAME, ends_a_line


def _record(line: bytes) -> dict | None:
    """The JSON object `line` holds; None for a line that holds none (a record cut short by a kill)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    return record if isinstance(record, dict) else None


def _settle(path: Path, resumed_at: int | None) -> None:
    """Make `path` read as one run before a training run appends to it: drop the records logged after
    `resumed_at` (the iteration this run starts from: its checkpoint's, 0 for a fresh start, which an attempt
    killed before its first save leaves behind; None to drop none) and lines cut short
    by a kill, keeping a last line that is whole JSON lacking only its newline. Rewritten atomically (a kill
    leaves the old file or the new), and only where something changes."""
    if not path.is_file():
        return
    *lines, tail = path.read_bytes().split(b"\n")
    if tail:
        lines.append(tail)
    kept, superseded, cut_bytes = [], 0, 0
    for line in lines:
        record = _record(line)
        if record is None:
            cut_bytes += len(line)
        elif resumed_at is not None and isinstance(record.get("iteration"), int) and (
                record["iteration"] > resumed_at
                or (record["iteration"] == resumed_at and record.get("split") == "growth")):
            superseded += 1  # a growth at the iteration resumed from comes after its checkpoint: it happens again
        else:
            kept.append(line.decode("utf-8"))
    if len(kept) == len(lines) and not tail:
        return
    write_durably(path, "".join(line + "\n" for line in kept))
    notes = []
    if superseded:
        notes.append(f"dropped {superseded} records of iterations after {resumed_at}, where this run starts: an "
                     "earlier attempt logged them, and this run logs them again")
    if cut_bytes:
        notes.append(f"dropped {cut_bytes} bytes of records cut short when the run that wrote them was killed")
    if notes:
        print(f"{path}: {'; '.join(notes)}", flush=True)


class MetricsWriter:
    def __init__(self, cfg, rank: int, resumed_at: int | None = None):
        """`resumed_at`: the iteration a training run starts from (its checkpoint's, or 0); None keeps every record."""
        self.enabled = rank == 0
        self._jsonl = None
        self._tensorboard = None
        self._wandb = None
        if not self.enabled:
            return
        if cfg.log_dir:
            Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
            self.path = Path(cfg.log_dir) / FILE_NAME
            if not cfg.eval_only:
                _settle(self.path, resumed_at)
            starts_a_line = ends_a_line(self.path)
            self._jsonl = open(self.path, "a", encoding="utf-8")
            if not starts_a_line:  # eval_only after a cut-short record: its own records stay whole
                self._jsonl.write("\n")
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
