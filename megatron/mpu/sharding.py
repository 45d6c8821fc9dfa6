"""Which parameters are split over the tensor-parallel ranks, and which block of the full tensor is ours.

A split parameter holds block r (contiguous, equal sizes) along `partition_dim` of the full tensor on
tensor rank r, and carries `tensor_model_parallel = True`: DeepSpeed reads that attribute to count each
block once in the gradient norm (replicated parameters count on tensor rank 0 only). Initialisation
draws the full tensor and keeps this rank's block, so every layout starts from the same model.
"""

from __future__ import annotations

from torch import Tensor, nn

from megatron.mpu.initialize import get_tensor_parallel_rank, get_tensor_parallel_world_size


def split_size(total: int, what: str) -> int:
    """`total` divided evenly over the tensor-parallel ranks; `what` names the quantity in the error."""
    world = get_tensor_parallel_world_size()
    if total % world:
        raise ValueError(f"{what} = {total} cannot be split evenly over model_parallel_size = {world} ranks; "
                         "choose sizes divisible by model_parallel_size")
    return total // world


def block_start(local_size: int) -> int:
    """Index in the full dimension where this rank's block of `local_size` entries starts."""
    return get_tensor_parallel_rank() * local_size


def mark_split(parameter: nn.Parameter, dim: int) -> None:
    """Declare `parameter` to be this rank's block along `dim` of a tensor split over the ranks."""
    parameter.tensor_model_parallel = True
    parameter.partition_dim = dim


def is_split(parameter: Tensor) -> bool:
    return getattr(parameter, "tensor_model_parallel", False)


def full_shape(parameter: Tensor) -> tuple[int, ...]:
    """Shape of the whole tensor this parameter is a block of (its own shape if replicated)."""
    shape = list(parameter.shape)
    if is_split(parameter):
        shape[parameter.partition_dim] *= get_tensor_parallel_world_size()
    return tuple(shape)


def local_block(full: Tensor, parameter: Tensor) -> Tensor:
    """This rank's block of `full`, shaped like `parameter` (all of `full` if replicated)."""
    if not is_split(parameter):
        return full
    dim = parameter.partition_dim
    size = parameter.shape[dim]
    return full.narrow(dim, block_start(size), size)
