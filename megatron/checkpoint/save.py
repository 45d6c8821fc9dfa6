"""Save training state in DeepSpeed's checkpoint layout (resumed by megatron/formats/deepspeed/resume.py).

A checkpoint is `SAVE/global_stepN/` written by `engine.save_checkpoint` in
DeepSpeed's layout (weights in `mp_rank_XX_model_states.pt`, one per
tensor-parallel rank XX, or, for a pipeline, one file per pipeline layer and
tensor rank, `layer_II-model_XX-model_states.pt`, numbered as in
megatron/model/pipeline.py; optimizer shards) plus what DeepSpeed does not
know about:

- `client_state` inside the model file: iteration and consumed samples, so the
  data sampler and the LR schedule continue exactly;
- `rng_state_RANK.pt`: every rank's Python/NumPy/torch generators and its
  tensor-parallel dropout stream;
- `config.json`: the resolved config (and the text of the YAML files) the
  checkpoint was trained with;
- `manifest.json`: every file's size and SHA-256.

It is written under a temporary name and published, with `SAVE/latest`, only
when complete (commit.py); a resume verifies it first and falls back
to the newest intact checkpoint (selection.py).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.checkpoint.commit import (
    commit,
    remove_interrupted_saves,
    reporting_write_failures,
    staging_directory,
)
from megatron.checkpoint.engine_optimizer import OPTIMIZER_PARAMETER_NAMES, optimizer_parameter_names
from megatron.checkpoint.growth_record import write_growth_record
from megatron.checkpoint.pruning import delete_old_checkpoints, set_aside_if_damaged
from megatron.checkpoint.rng_state import capture_rng_state


def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def should_save(cfg, iteration: int) -> bool:
    if not cfg.save:
        return False
    periodic = cfg.checkpoint_factor and iteration % cfg.checkpoint_factor == 0
    return bool(periodic or iteration in (cfg.extra_save_iters or ()) or iteration == cfg.train_iters)


def save_checkpoint(engine, cfg, iteration: int, consumed_samples: int, growth_record: dict | None = None,
                    lineage: Collection[int] = ()) -> Path:
    """Collective: write `global_stepN` under a temporary name, then publish it (commit.py).

    `growth_record`: the growth.json of a run continuing a grown model (growth_record.py), carried forward;
    `lineage`: the iterations whose checkpoints keep_last_n_checkpoints keeps (the models before growths)."""
    save_dir, tag = Path(cfg.save), checkpoint_tag(iteration)
    remove_interrupted_saves(save_dir)
    set_aside_if_damaged(save_dir, tag)
    client_state = {"iteration": iteration, "consumed_train_samples": consumed_samples,
                    OPTIMIZER_PARAMETER_NAMES: optimizer_parameter_names(engine)}
    staging = staging_directory(save_dir, tag)
    with reporting_write_failures(save_dir, tag):
        engine.save_checkpoint(cfg.save, tag=staging.name, client_state=client_state, save_latest=False)
        torch.save(capture_rng_state(), staging / f"rng_state_{dist.get_rank()}.pt")
        if dist.get_rank() == 0:
            (staging / "config.json").write_text(cfg.to_json(), encoding="utf-8")
            if growth_record is not None:
                write_growth_record(staging, growth_record)
        directory = commit(save_dir, tag)
    if cfg.keep_last_n_checkpoints:
        delete_old_checkpoints(save_dir, cfg.keep_last_n_checkpoints, newest=iteration, lineage=lineage)
    dist.barrier()
    return directory
