"""Model-parallel utilities: process groups and this rank's place in them."""

from megatron.mpu.initialize import (
    ParallelLayout,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_layout,
    get_pipe_parallel_group,
    get_tensor_parallel_group,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__all__ = [
    "ParallelLayout",
    "destroy_model_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_layout",
    "get_pipe_parallel_group",
    "get_tensor_parallel_group",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]
