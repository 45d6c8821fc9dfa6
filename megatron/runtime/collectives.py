"""Which rank speaks for the others, and the values every rank must hold alike.

Global rank 0 prints and writes files. In generate.py and eval.py every rank runs the same requests in the same
order (the tensor-parallel collectives need that); tensor rank 0 decides each sampled token, and global rank 0
reads interactive input.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from megatron import mpu


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
