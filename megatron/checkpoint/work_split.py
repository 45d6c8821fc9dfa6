"""Share independent jobs (hashing checkpoint files) over all ranks and collect every rank's results.

Each rank takes every world_size-th item, so reading a checkpoint costs each rank
about 1/world_size of it. Without a started process group it is one process doing
everything, which lets single-process tools use the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

Item = TypeVar("Item")


def _rank_and_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def same_on_all_ranks(value: Any) -> Any:
    """Rank 0's `value` on every rank (e.g. a directory listing, which shared file systems may show late)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def map_over_ranks(function: Callable[[Item], list[Any]], items: Sequence[Item]) -> list[Any]:
    """`function(item)` for every item, each item on one rank; the concatenated results, on every rank."""
    rank, world = _rank_and_world()
    mine = [result for item in items[rank::world] for result in function(item)]
    if world == 1:
        return mine
    gathered: list[list[Any]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    return [result for results in gathered for result in results]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_rank_0() -> bool:
    return _rank_and_world()[0] == 0
