"""Process groups for data × pipeline × tensor parallelism.

Rank layout (Megatron / GPT-NeoX order, tensor innermost):

    rank = pipe_rank * (data_size * tensor_size) + data_rank * tensor_size + tensor_rank

so the ranks of one tensor-parallel group are adjacent (the same node on a
cluster, where the bandwidth is), data-parallel peers are `tensor_size` apart
and pipeline stages are the outermost blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three parallel dimensions and this rank's coordinates."""

    world_size: int
    tensor_size: int
    pipe_size: int

    @property
    def data_size(self) -> int:
        return self.world_size // (self.tensor_size * self.pipe_size)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipe_rank, data_rank, tensor_rank) of a global rank."""
        tensor_rank = rank % self.tensor_size
        data_rank = (rank // self.tensor_size) % self.data_size
        pipe_rank = rank // (self.tensor_size * self.data_size)
        return pipe_rank, data_rank, tensor_rank

    def rank_of(self, pipe_rank: int, data_rank: int, tensor_rank: int) -> int:
        return (pipe_rank * self.data_size + data_rank) * self.tensor_size + tensor_rank

    def data_parallel_ranks(self, rank: int) -> list[int]:
        pipe_rank, _, tensor_rank = self.coordinates(rank)
        return [self.rank_of(pipe_rank, d, tensor_rank) for d in range(self.data_size)]

    def tensor_parallel_ranks(self, rank: int) -> list[int]:
        pipe_rank, data_rank, _ = self.coordinates(rank)
        return [self.rank_of(pipe_rank, data_rank, t) for t in range(self.tensor_size)]

    def pipe_parallel_ranks(self, rank: int) -> list[int]:
        _, data_rank, tensor_rank = self.coordinates(rank)
        return [self.rank_of(p, data_rank, tensor_rank) for p in range(self.pipe_size)]


_LAYOUT: ParallelLayout | None = None
_GROUPS: dict[str, dist.ProcessGroup] = {}


def initialize_model_parallel(tensor_size: int = 1, pipe_size: int = 1) -> ParallelLayout:
    """Create every data/tensor/pipeline group; call once after init_process_group."""
    global _LAYOUT
    world = dist.get_world_size()
    if world % (tensor_size * pipe_size):
        raise ValueError(
            f"model_parallel_size ({tensor_size}) x pipe_parallel_size ({pipe_size}) "
            f"must divide the number of processes ({world})"
        )
    layout = ParallelLayout(world, tensor_size, pipe_size)
    rank = dist.get_rank()
    # new_group is collective: every rank creates every group, in the same order.
    for kind, ranks_of in (
        ("data", layout.data_parallel_ranks),
        ("tensor", layout.tensor_parallel_ranks),
        ("pipe", layout.pipe_parallel_ranks),
    ):
        seen: set[tuple[int, ...]] = set()
        for r in range(world):
            ranks = tuple(ranks_of(r))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks))
            if rank in ranks:
                _GROUPS[kind] = group
    _LAYOUT = layout
    return layout


def model_parallel_is_initialized() -> bool:
    return _LAYOUT is not None


def get_layout() -> ParallelLayout:
    if _LAYOUT is None:
        raise RuntimeError("initialize_model_parallel() has not been called")
    return _LAYOUT


def get_data_parallel_group() -> dist.ProcessGroup:
    get_layout()
    return _GROUPS["data"]


def get_tensor_parallel_group() -> dist.ProcessGroup:
    get_layout()
    return _GROUPS["tensor"]


def get_pipe_parallel_group() -> dist.ProcessGroup:
    get_layout()
    return _GROUPS["pipe"]


def get_data_parallel_rank() -> int:
    return get_layout().coordinates(dist.get_rank())[1]


def get_data_parallel_world_size() -> int:
    return get_layout().data_size


def get_data_parallel_group_ranks() -> list[int]:
    return get_layout().data_parallel_ranks(dist.get_rank())


def get_tensor_parallel_world_size() -> int:
    """Ranks splitting one model replica's tensors; 1 before `initialize_model_parallel`, so a model
    built outside a distributed run is a whole single-rank model."""
    return _LAYOUT.tensor_size if _LAYOUT is not None else 1


def get_tensor_parallel_rank() -> int:
    """This rank's place in its tensor-parallel group; 0 before `initialize_model_parallel`."""
    return _LAYOUT.coordinates(dist.get_rank())[2] if _LAYOUT is not None else 0


# The names DeepSpeed's `mpu` protocol asks for (deepspeed.initialize(mpu=megatron.mpu)): it sums
# gradient norms over the model-parallel group and names checkpoint files mp_rank_XX by its rank.
# With one pipeline stage the model-parallel group is the tensor-parallel group.
get_model_parallel_group = get_tensor_model_parallel_group = get_tensor_parallel_group
get_model_parallel_rank = get_tensor_model_parallel_rank = get_tensor_parallel_rank
get_model_parallel_world_size = get_tensor_model_parallel_world_size = get_tensor_parallel_world_size


def destroy_model_parallel() -> None:
    """Forget the groups (tests create several layouts in one process)."""
    global _LAYOUT
    _LAYOUT = None
    _GROUPS.clear()
