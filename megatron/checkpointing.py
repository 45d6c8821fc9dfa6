"""Save and resume training state in DeepSpeed's checkpoint layout.

A checkpoint is `SAVE/global_stepN/` written by `engine.save_checkpoint`
(model shards `mp_rank_XX_model_states.pt`, optimizer shards, and DeepSpeed's
`SAVE/latest` marker) plus what DeepSpeed does not know about:

- `client_state` inside the model file: iteration and consumed samples, so the
  data sampler and the LR schedule continue exactly;
- `rng_state_RANK.pt`: every rank's Python/NumPy/torch generators;
- `config.json`: the resolved config (and the text of the YAML files) the
  checkpoint was trained with.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

_TAG = re.compile(r"^global_step(\d+)$")


def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def should_save(cfg, iteration: int) -> bool:
    if not cfg.save:
        return False
    periodic = cfg.checkpoint_factor and iteration % cfg.checkpoint_factor == 0
    return bool(periodic or iteration in (cfg.extra_save_iters or ()) or iteration == cfg.train_iters)


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])


def save_checkpoint(engine, cfg, iteration: int, consumed_samples: int) -> Path:
    tag = checkpoint_tag(iteration)
    client_state = {"iteration": iteration, "consumed_train_samples": consumed_samples}
    engine.save_checkpoint(cfg.save, tag=tag, client_state=client_state)
    directory = Path(cfg.save) / tag
    rank = dist.get_rank()
    torch.save(_rng_state(), directory / f"rng_state_{rank}.pt")
    if rank == 0:
        (directory / "config.json").write_text(cfg.to_json(), encoding="utf-8")
    dist.barrier()
    if rank == 0 and cfg.keep_last_n_checkpoints:
        _delete_old_checkpoints(Path(cfg.save), cfg.keep_last_n_checkpoints)
    dist.barrier()
    return directory


def _delete_old_checkpoints(save_dir: Path, keep: int) -> None:
    steps = sorted(
        (int(m.group(1)), p) for p in save_dir.iterdir() if (m := _TAG.match(p.name)) and p.is_dir()
    )
    for _, path in steps[:-keep]:
        shutil.rmtree(path)


def latest_tag(load_dir: str | None) -> str | None:
    """The tag DeepSpeed's `latest` marker points at, or None for a fresh run."""
    if not load_dir:
        return None
    marker = Path(load_dir) / "latest"
    if not marker.is_file():
        return None
    return marker.read_text(encoding="utf-8").strip()


def load_checkpoint(engine, cfg, load_optimizer: bool = True) -> tuple[int, int]:
    """Restore the latest checkpoint in `cfg.load`; returns (iteration, consumed samples)."""
    tag = latest_tag(cfg.load)
    if tag is None:
        return 0, 0
    path, client_state = engine.load_checkpoint(
        cfg.load,
        tag=tag,
        load_optimizer_states=load_optimizer,
        load_lr_scheduler_states=False,
        load_module_strict=True,
    )
    if path is None:
        raise FileNotFoundError(
            f"load: {cfg.load}/latest names {tag!r} but DeepSpeed could not read that checkpoint"
        )
    rng_file = Path(cfg.load) / tag / f"rng_state_{dist.get_rank()}.pt"
    if rng_file.is_file():
        # Our own file, written by save_checkpoint above (NumPy state needs full unpickling).
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state["iteration"], client_state["consumed_train_samples"]
