"""The processes of generate.py and eval.py: one model replica, split over model_parallel_size ranks.

Every rank runs the same requests in the same order (the tensor-parallel collectives need that); tensor
rank 0 decides each sampled token and reads interactive input, and global rank 0 writes the outputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron import mpu
from megatron.config import Config, ConfigError


def initialize_inference(cfg: Config) -> torch.device:
    """Join the process group (when not joined yet), build the tensor-parallel group, seed; returns the device.

    torch.distributed is started directly: inference needs none of DeepSpeed's communication layer."""
    from deepspeed.accelerator import get_accelerator

    from megatron.launch import export_rank_environment
    from megatron.launch.process_group import bind_local_device, communication_backend, set_seed
    from megatron.launch.rendezvous import join_launch

    if not dist.is_initialized():
        export_rank_environment(cfg)
        bind_local_device()
        if cfg.launch_id:
            join_launch(cfg.launch_id, communication_backend(cfg))
        else:
            dist.init_process_group(backend=communication_backend(cfg))
    else:
        bind_local_device()
    world = dist.get_world_size()
    if world != cfg.model_parallel_size:
        raise ConfigError(f"{cfg.user_script or 'inference'} runs one model replica split over model_parallel_size="
                          f"{cfg.model_parallel_size} processes, but {world} started: set num_gpus="
                          f"{cfg.model_parallel_size} (pipeline stages are merged when the checkpoint is loaded)")
    mpu.initialize_model_parallel(cfg.model_parallel_size, 1)
    set_seed(cfg.seed)
    return torch.device(get_accelerator().current_device_name())


def is_output_rank() -> bool:
    """The process that prints and writes files: global rank 0, or the only process."""
    return not dist.is_initialized() or dist.get_rank() == 0


def same_on_tensor_ranks(tokens: Tensor) -> Tensor:
    """Tensor rank 0's `tokens` on every rank of the tensor-parallel group."""
    if mpu.get_tensor_parallel_world_size() == 1:
        return tokens
    first = mpu.get_layout().tensor_parallel_ranks(dist.get_rank())[0]
    dist.broadcast(tokens, src=first, group=mpu.get_tensor_parallel_group())
    return tokens


def from_output_rank(value: object) -> object:
    """Global rank 0's `value` (any picklable object) on every rank, e.g. a line typed interactively."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
