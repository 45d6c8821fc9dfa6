"""The collectives of the tensor-parallel group, each logging its payload while `count_collectives` is on.

Every tensor-parallel byte the model moves goes through these three functions, so counting their calls
counts the traffic (tests check the per-layer figure of docs/tensor_parallel.md this way). They return
new tensors and leave their inputs untouched, which autograd functions need.

Bytes each rank sends for a payload of N elements (the full reduced/gathered tensor) with a ring of t
ranks, the algorithm NCCL and gloo use for large tensors:
    all-reduce 2·(t−1)/t·N,   reduce-scatter (t−1)/t·N,   all-gather (t−1)/t·N   (× bytes per element)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.mpu.initialize import get_tensor_parallel_group, get_tensor_parallel_world_size

_RING_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}


@dataclass(frozen=True)
class Collective:
    """One collective call: its kind, the payload's element count and bytes per element."""

    kind: str
    numel: int
    element_size: int

    def bytes_sent_per_rank(self, world_size: int) -> float:
        """What each of `world_size` ranks sends for this call with the ring algorithm."""
        return _RING_FACTOR[self.kind] * (world_size - 1) / world_size * self.numel * self.element_size


_log: list[Collective] | None = None


@contextmanager
def count_collectives() -> Iterator[list[Collective]]:
    """Log every tensor-parallel collective made inside the block into the yielded list."""
    global _log
    previous, _log = _log, []
    try:
        yield _log
    finally:
        _log = previous


def _record(kind: str, payload: Tensor) -> None:
    if _log is not None:
        _log.append(Collective(kind, payload.numel(), payload.element_size()))


def all_reduce(tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
    """Elementwise SUM (or `op`, e.g. MAX) of `tensor` over the tensor-parallel ranks."""
    result = tensor.contiguous().clone()
    _record("all_reduce", result)
    dist.all_reduce(result, op=op, group=get_tensor_parallel_group())
    return result


def all_gather(tensor: Tensor, dim: int) -> Tensor:
    """Every rank's `tensor` concatenated along `dim`, in tensor-rank order."""
    world = get_tensor_parallel_world_size()
    gathered = torch.empty((world, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    _record("all_gather", gathered)
    dist.all_gather_single(gathered.view(-1), tensor.contiguous().view(-1), group=get_tensor_parallel_group())
    return torch.cat(gathered.unbind(0), dim=dim)


def reduce_scatter(tensor: Tensor, dim: int) -> Tensor:
    """Block r (of t equal blocks along `dim`) of the sum of `tensor` over the ranks, on tensor rank r."""
    world = get_tensor_parallel_world_size()
    if tensor.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} cannot be split evenly over {world} ranks")
    blocks = torch.stack(tensor.chunk(world, dim=dim))
    _record("reduce_scatter", blocks)
    result = torch.empty(blocks.shape[1:], dtype=tensor.dtype, device=tensor.device)
    dist.reduce_scatter_single(result.view(-1), blocks.view(-1), group=get_tensor_parallel_group())
    return result
