"""Join the run's process group, bind this rank's device, build the parallel groups and seed; leave at the end.

The same start for train.py, generate.py and eval.py (RuntimeSettings says where they differ). Device-agnostic:
the backend comes from DeepSpeed's accelerator (NCCL on CUDA, gloo on CPU), so the same code runs on a GPU
cluster and on a CPU machine.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megatron import mpu
from megatron.config import Config, ConfigError
from megatron.runtime.environment import export_rank_environment
from megatron.runtime.hang_watch import record_collectives
from megatron.runtime.rendezvous import TIMEOUT, join_launch
from megatron.runtime.settings import RuntimeSettings


@dataclass(frozen=True)
class Placement:
    """Where this process runs: the parallel layout it joined and the device it computes on."""

    layout: mpu.ParallelLayout
    device: torch.device


def communication_backend(configured: str) -> str:
    """`configured` (distributed_backend) on CUDA; elsewhere the accelerator's own (gloo on CPU)."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda":
        return configured
    return accelerator.communication_backend_name()


def local_device_index(device_count: int) -> int:
    """This rank's device on its node: LOCAL_RANK (set by every launcher, export_rank_environment included), or
    the global rank in a caller's own process group without it, modulo the devices it sees."""
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        local = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "0")
    return int(local) % device_count


def bind_local_device() -> None:
    """Make this rank's device current; called before the process group starts, as GPT-NeoX does, so that NCCL's
    communicator and barriers use this rank's own device instead of guessing device 0."""
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_device_index(accelerator.device_count()))


def initialize_distributed(cfg: Config) -> Placement:
    """Join the process group (once: a caller's own group is used as it is), check the number of processes,
    build the parallel groups, seed."""
    settings = RuntimeSettings.from_config(cfg)
    backend = communication_backend(settings.distributed_backend)
    started_here = not dist.is_initialized()
    if started_here:
        export_rank_environment(cfg)
    bind_local_device()
    if started_here:
        record_collectives(backend, cfg.hang_timeout)
    if started_here and settings.launch_id:
        join_launch(settings.launch_id, backend)
    elif started_here:
        dist.init_process_group(backend, timeout=TIMEOUT)
    if not settings.inference:
        # Also when torch.distributed was up before (a caller's own group): DeepSpeed's collectives, which the
        # pipeline module uses before deepspeed.initialize, then wrap it.
        without_deepspeeds_inference_comm_op()
        deepspeed.init_distributed(dist_backend=backend, verbose=False)
    problem = settings.world_size_problem(dist.get_world_size())
    if problem:
        raise ConfigError(problem)
    layout = mpu.initialize_model_parallel(settings.model_parallel_size, settings.pipe_stages)
    set_seed(settings.seed)
    if settings.deterministic:
        use_deterministic_kernels()
    return Placement(layout, torch.device(get_accelerator().current_device_name()))


def without_deepspeeds_inference_comm_op() -> None:
    """DeepSpeed's collectives build a C++ op on a CPU (a compile before the first start of every environment, and
    a /dev/shm buffer per rank) that only its inference kernels' all-reduce uses (deepspeed/comm/torch.py); training's
    collectives are torch.distributed's. Marked unavailable, it is neither built nor mapped."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def set_seed(seed: int) -> None:
    """The same seed on every rank (replicated dropout draws the same masks), plus the per-tensor-rank
    stream for split activations (mpu/random.py)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
    mpu.seed_model_parallel_rng(seed)


def use_deterministic_kernels() -> None:
    """Only kernels that give the same bits every run: on CUDA the embedding's and attention's backward otherwise
    accumulate with atomics in whatever order threads arrive. cuBLAS needs a fixed workspace for the same; it reads
    the variable when its first handle is made, after this (no matmul has run yet)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def leave_process_group(finished: bool = True) -> None:
    """Destroy the process group; when every rank `finished`, only after a barrier, so that no rank shuts its
    connections while another is still in a collective. (After an error some ranks may not reach the barrier:
    the launcher stops the rest when the failed rank exits.)"""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
