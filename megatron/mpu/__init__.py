"""Model-parallel utilities: process groups, communication mappings, split layers and random streams.

The module itself is the `mpu` object handed to deepspeed.initialize (it exposes DeepSpeed's
get_model_parallel_* / get_data_parallel_* protocol).
"""

from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.initialize import (
    ParallelLayout,
    destroy_model_parallel,
    get_data_parallel_group,
    get_data_parallel_group_ranks,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_layout,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_pipe_parallel_group,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tensor_parallel_group,
    get_tensor_parallel_rank,
    get_tensor_parallel_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from megatron.mpu.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    vocab_parallel_logits,
)
from megatron.mpu.mappings import (
    all_gather_to_region,
    all_reduce_max,
    all_reduce_sum,
    all_reduce_to_region,
    copy_to_region,
    gather_from_region,
    reduce_from_region,
    reduce_scatter_to_region,
    scatter_to_region,
)
from megatron.mpu.random import (
    checkpoint,
    checkpoint_context_fn,
    get_rng_tracker,
    seed_model_parallel_rng,
    split_region_rng,
)
from megatron.mpu.sharding import full_shape, is_split, local_block, mark_split, split_size
from megatron.mpu.topology import pipeline_topology

__all__ = [
    "ParallelLayout",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "all_gather_to_region",
    "all_reduce_max",
    "all_reduce_sum",
    "all_reduce_to_region",
    "checkpoint",
    "checkpoint_context_fn",
    "copy_to_region",
    "destroy_model_parallel",
    "full_shape",
    "gather_from_region",
    "get_data_parallel_group",
    "get_data_parallel_group_ranks",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_layout",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_pipe_parallel_group",
    "get_rng_tracker",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensor_parallel_group",
    "get_tensor_parallel_rank",
    "get_tensor_parallel_world_size",
    "initialize_model_parallel",
    "is_split",
    "local_block",
    "mark_split",
    "model_parallel_is_initialized",
    "pipeline_topology",
    "reduce_from_region",
    "reduce_scatter_to_region",
    "scatter_to_region",
    "seed_model_parallel_rng",
    "split_region_rng",
    "split_size",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logits",
]
