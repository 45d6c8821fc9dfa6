"""Start torch.distributed through DeepSpeed and create the parallel groups.

Device-agnostic: the backend comes from DeepSpeed's accelerator (NCCL on CUDA,
gloo on CPU), so the same entry point runs on a GPU cluster and on this laptop-
class CPU machine.
"""

from __future__ import annotations

import random
import sys

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.config import ConfigError
from megatron.launch import export_rank_environment


def communication_backend(cfg) -> str:
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        return cfg.distributed_backend
    return accelerator.communication_backend_name()


def initialize_distributed(cfg) -> mpu.ParallelLayout:
    """init_process_group (once), check the world size, build the groups, seed."""
    if not dist.is_initialized():
        export_rank_environment(cfg)
    # Also when torch.distributed is already up (a caller's own group): DeepSpeed's collectives, which the
    # pipeline module uses before deepspeed.initialize, then wrap it.
    deepspeed.init_distributed(dist_backend=communication_backend(cfg), verbose=False)
    world = dist.get_world_size()
    if cfg.world_size is not None and cfg.world_size != world:
        raise ConfigError(
            f"the config was resolved for {cfg.world_size} processes but {world} started; "
            "launch through deepy.py, or set num_gpus to the number of processes"
        )
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(dist.get_rank() % accelerator.device_count())
    layout = mpu.initialize_model_parallel(cfg.model_parallel_size, max(1, cfg.pipe_parallel_size))
    set_seed(cfg.seed)
    return layout


def set_seed(seed: int) -> None:
    """The same seed on every rank (replicated dropout draws the same masks), plus the per-tensor-rank
    stream for split activations (mpu/random.py)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
    mpu.seed_model_parallel_rng(seed)


def said_once(error: Exception) -> int:
    """Print `error`, which every rank raised alike (a ConfigError), on rank 0 only: one message, not one
    traceback per rank. The exit code for it."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"config error: {error}", file=sys.stderr, flush=True)
    return 2


def leave_process_group() -> None:
    """End a rank's work: leaving with the gloo group alive can abort the process at exit ("terminate called
    without an active exception") after the work is done, so the entry points (train.py, generate.py,
    eval.py) destroy it."""
    if dist.is_initialized():
        dist.destroy_process_group()
