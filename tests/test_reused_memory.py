"""megatron/growth/reused_memory.py: a mapping serves a new tensor only once no tensor (nor a view of one)
refers to it, and a tensor saves as just itself."""

from __future__ import annotations

import io

import torch

from megatron.growth import reused_memory

SHAPE = (1024, 4096)  # 16 MiB: large enough to be pooled


def test_memory_is_reused_only_once_every_view_is_gone():
    with reused_memory.pooled():
        first = reused_memory.empty(SHAPE)
        first.fill_(1.0)
        address = first.data_ptr()
        view = first[10:20]
        del first
        second = reused_memory.empty(SHAPE)
        assert second.data_ptr() != address and bool((view == 1.0).all())
        del view
        third = reused_memory.empty(SHAPE)
        assert third.data_ptr() == address


def test_outside_a_pool_nothing_is_kept():
    """A training process (pretrain_partial_init grows in memory) keeps no idle mappings after growth."""
    with reused_memory.pooled():
        pooled = reused_memory.empty(SHAPE)
        assert reused_memory._mappings
    del pooled
    assert not reused_memory._mappings
    plain = reused_memory.empty(SHAPE)
    assert not reused_memory._mappings and plain.untyped_storage().nbytes() == plain.nbytes


def test_a_copy_owns_its_storage_and_saves_as_itself():
    source = torch.randn(SHAPE[0], SHAPE[1] + 3)[:, 3:]
    with reused_memory.pooled():
        copy = reused_memory.copy_of(source)
    assert torch.equal(copy, source) and copy.is_contiguous()
    assert copy.untyped_storage().nbytes() == copy.nbytes
    buffer = io.BytesIO()
    torch.save(copy, buffer)
    assert buffer.tell() < copy.nbytes + 4096
    assert torch.equal(torch.load(io.BytesIO(buffer.getvalue())), source)
