"""PretrainingSampler: ranks split each global batch, and a restart resumes at the exact next sample."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron.data.samplers import PretrainingSampler


def rank_batches(total, consumed, micro, world, drop_last=True):
    return [list(PretrainingSampler(total, consumed, micro, rank, world, drop_last)) for rank in range(world)]


@given(
    total=st.integers(1, 200),
    consumed_fraction=st.floats(0, 0.99),
    micro=st.integers(1, 8),
    world=st.integers(1, 5),
)
def test_ranks_share_each_global_batch_disjointly(total, consumed_fraction, micro, world):
    consumed = int(consumed_fraction * total)
    per_rank = rank_batches(total, consumed, micro, world)
    global_batch = micro * world
    assert len({len(batches) for batches in per_rank}) == 1
    for step, micro_batches in enumerate(zip(*per_rank)):
        start = consumed + step * global_batch
        assert all(len(b) == micro for b in micro_batches)
        assert sorted(i for b in micro_batches for i in b) == list(range(start, start + global_batch))
    assert len(per_rank[0]) == (total - consumed) // global_batch


@given(total=st.integers(20, 200), micro=st.integers(1, 4), world=st.integers(1, 4), stop_at=st.integers(0, 4))
def test_resume_reads_what_an_uninterrupted_run_reads(total, micro, world, stop_at):
    global_batch = micro * world
    uninterrupted = rank_batches(total, 0, micro, world)
    iteration = min(stop_at, len(uninterrupted[0]) - 1)
    resumed = rank_batches(total, iteration * global_batch, micro, world)
    for rank in range(world):
        assert resumed[rank] == uninterrupted[rank][iteration:]


def test_partial_last_batch_kept_when_not_dropping():
    per_rank = rank_batches(total=11, consumed=0, micro=2, world=2, drop_last=False)
    assert per_rank[0] == [[0, 1], [4, 5], [8, 9]]
    assert per_rank[1] == [[2, 3], [6, 7], [10]]
    short = rank_batches(total=9, consumed=0, micro=2, world=2, drop_last=False)
    assert short[1] == [[2, 3], [6, 7]]
    assert len(PretrainingSampler(9, 0, 2, 1, 2, drop_last=False)) == 2


def test_drives_a_dataloader():
    dataset = torch.arange(100) * 10
    sampler = PretrainingSampler(100, 24, micro_batch_size=4, data_parallel_rank=1, data_parallel_size=2)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    first = next(iter(loader))
    assert first.tolist() == [280, 290, 300, 310]
    assert len(loader) == 9


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 0, 1), "total_samples"),
        ((10, 10, 1, 0, 1), "consumed_samples 10"),
        ((10, 0, 0, 0, 1), "micro_batch_size"),
        ((10, 0, 1, 2, 2), "data_parallel_rank 2"),
    ],
)
def test_invalid_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        PretrainingSampler(*args)
