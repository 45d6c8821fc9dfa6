"""Autograd-aware communication between replicated computation and the tensor-parallel "region".

Inside the region each rank computes something different (its block of parameter tokens, heads or
vocabulary); outside it, every rank of the tensor-parallel group computes the same thing. A tensor's
gradient is therefore *partial* (one share per rank, to be summed) when it flows back out of region
computation, and *replicated* when it flows back from replicated computation. That decides each pair:

    function                      forward          backward         the output feeds
    copy_to_region                identity         all-reduce       rank-specific computation
    reduce_from_region            all-reduce       identity         replicated computation
    all_reduce_to_region          all-reduce       all-reduce       rank-specific computation
    scatter_to_region(dim)        keep own block   all-gather       rank-specific computation
    gather_from_region(dim)       all-gather       keep own block   replicated computation
    reduce_scatter_to_region(dim) reduce-scatter   all-gather       rank-specific computation
    all_gather_to_region(dim)     all-gather       reduce-scatter   rank-specific computation

Blocks along `dim` are contiguous and in tensor-rank order. With one tensor-parallel rank every function
returns its input. `all_reduce_max` is the one statistic that needs no gradient (a softmax shift).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.mpu import collectives
from megatron.mpu.initialize import get_tensor_parallel_rank, get_tensor_parallel_world_size


def _own_block(x: Tensor, dim: int) -> Tensor:
    world = get_tensor_parallel_world_size()
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} cannot be split evenly over {world} ranks")
    return x.chunk(world, dim=dim)[get_tensor_parallel_rank()].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return collectives.all_reduce(grad)


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return collectives.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class _AllReduceToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return collectives.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return collectives.all_reduce(grad)


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        return _own_block(x, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return collectives.all_gather(grad, ctx.dim), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        return collectives.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _own_block(grad, ctx.dim), None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        return collectives.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return collectives.all_gather(grad, ctx.dim), None


class _AllGatherToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int) -> Tensor:
        ctx.dim = dim
        return collectives.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return collectives.reduce_scatter(grad, ctx.dim), None


def _single_rank() -> bool:
    return get_tensor_parallel_world_size() == 1


def copy_to_region(x: Tensor) -> Tensor:
    """A replicated tensor entering rank-specific computation (e.g. the input of a split Pattention)."""
    return x if _single_rank() else _CopyToRegion.apply(x)


def reduce_from_region(x: Tensor) -> Tensor:
    """Sum of per-rank partial results, consumed by replicated computation (e.g. a layer's output)."""
    return x if _single_rank() else _ReduceFromRegion.apply(x)


def all_reduce_to_region(x: Tensor) -> Tensor:
    """Sum of per-rank partial statistics, consumed by rank-specific computation (Pattention's row sums)."""
    return x if _single_rank() else _AllReduceToRegion.apply(x)


def scatter_to_region(x: Tensor, dim: int) -> Tensor:
    """This rank's block along `dim` of a replicated tensor."""
    return x if _single_rank() else _ScatterToRegion.apply(x, dim)


def gather_from_region(x: Tensor, dim: int) -> Tensor:
    """Every rank's block concatenated along `dim`, consumed by replicated computation (e.g. full logits)."""
    return x if _single_rank() else _GatherFromRegion.apply(x, dim)


def reduce_scatter_to_region(x: Tensor, dim: int) -> Tensor:
    """This rank's block along `dim` of the sum of per-rank partial results (e.g. its heads of Q, K, V)."""
    return x if _single_rank() else _ReduceScatterToRegion.apply(x, dim)


def all_gather_to_region(x: Tensor, dim: int) -> Tensor:
    """Every rank's block concatenated along `dim`, consumed by rank-specific computation (e.g. all heads'
    context entering a split Pattention)."""
    return x if _single_rank() else _AllGatherToRegion.apply(x, dim)


def all_reduce_max(x: Tensor) -> Tensor:
    """Elementwise maximum over the tensor-parallel ranks, without gradient."""
    return x if _single_rank() else collectives.all_reduce(x.detach(), op=dist.ReduceOp.MAX)


def all_reduce_sum(x: Tensor) -> Tensor:
    """Elementwise sum over the tensor-parallel ranks, outside autograd: for statistics combined inside a
    hand-written forward/backward (the fused Pattention's row sums and their gradient's row reductions)."""
    return x if _single_rank() else collectives.all_reduce(x.detach())
