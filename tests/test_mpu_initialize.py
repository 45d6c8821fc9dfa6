"""Process-group layout: tensor innermost, then data, then pipeline (Megatron order)."""

import pytest
import torch
import torch.distributed as dist

from megatron import mpu
from megatron.mpu import ParallelLayout
from tests.distributed import spawn

pytestmark = pytest.mark.slow


def test_rank_coordinates_follow_megatron_order():
    layout = ParallelLayout(world_size=8, tensor_size=2, pipe_size=2)
    assert layout.data_size == 2
    assert [layout.coordinates(r) for r in range(8)] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]
    assert layout.tensor_parallel_ranks(5) == [4, 5]
    assert layout.data_parallel_ranks(5) == [5, 7]
    assert layout.pipe_parallel_ranks(5) == [1, 5]
    for rank in range(8):
        assert layout.rank_of(*layout.coordinates(rank)) == rank


def _groups_body(rank, world_size, tensor_size, pipe_size):
    layout = mpu.initialize_model_parallel(tensor_size, pipe_size)
    # Summing the global ranks inside each group proves every rank is in the group it should be.
    for group, members in (
        (mpu.get_data_parallel_group(), layout.data_parallel_ranks(rank)),
        (mpu.get_tensor_parallel_group(), layout.tensor_parallel_ranks(rank)),
        (mpu.get_pipe_parallel_group(), layout.pipe_parallel_ranks(rank)),
    ):
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=group)
        assert value.item() == sum(members), (rank, members, value)
    assert mpu.get_data_parallel_rank() == layout.coordinates(rank)[1]
    assert mpu.get_data_parallel_world_size() == layout.data_size
    mpu.destroy_model_parallel()


@pytest.mark.parametrize("tensor_size,pipe_size", [(1, 1), (2, 1), (1, 2)])
def test_groups_contain_the_documented_ranks(tensor_size, pipe_size):
    spawn(_groups_body, 2, tensor_size, pipe_size)


def _indivisible_body(rank, world_size):
    with pytest.raises(ValueError, match="must divide the number of processes"):
        mpu.initialize_model_parallel(2, 1)


def test_sizes_that_do_not_divide_the_world_are_refused():
    spawn(_indivisible_body, 3)
