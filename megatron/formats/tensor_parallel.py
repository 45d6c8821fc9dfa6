"""Which state-dict entries tensor parallelism splits, and along which dimension: from that, t per-rank
state dicts merge into the whole model's and the whole model's splits into t.

Every Pattention's split dimension (its parameter tokens) is the spec's (megatron/model/spec.py); the other
modules declare theirs (`mpu.mark_split`: embedding and output rows), read by building the model on the meta
device, which allocates nothing. Rank r holds block r of
t equal contiguous blocks; everything else (final norm, position embeddings, the Pattention token counts)
is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from megatron.cli import InputError
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.spec import pattention_entry
from megatron.mpu import is_split


def split_dimensions(args: TokenFormerArgs) -> dict[str, int | None]:
    """Every state-dict name of the model -> the dimension it is split along, None if replicated."""
    model = TokenFormerModel(args, device="meta")
    dims: dict[str, int | None] = {name: None for name, _ in model.named_buffers()}
    for name, parameter in model.named_parameters():
        entry = pattention_entry(name)
        dims[name] = entry[0].split_dim if entry else parameter.partition_dim if is_split(parameter) else None
    return dims


def merge_shards(shards: Sequence[Mapping[str, Tensor]], dims: Mapping[str, int | None]) -> dict[str, Tensor]:
    """The whole model's state dict from the per-rank ones, in rank order."""
    merged = {}
    for name, dim in dims.items():
        blocks = [shard[name] for shard in shards]
        merged[name] = blocks[0] if dim is None else torch.cat(blocks, dim=dim)
    return merged


def split_state(state: Mapping[str, Tensor], dims: Mapping[str, int | None], ranks: int) -> list[dict[str, Tensor]]:
    """The per-rank state dicts of a whole model's, for `ranks` tensor-parallel ranks."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(ranks)]
    for name, dim in dims.items():
        if dim is not None and state[name].shape[dim] % ranks:
            raise InputError(f"{name} has {state[name].shape[dim]} rows, which do not split evenly over "
                             f"model_parallel_size={ranks} ranks; choose a model_parallel_size dividing it")
        for rank, shard in enumerate(shards):
            shard[name] = state[name] if dim is None else state[name].chunk(ranks, dim=dim)[rank].clone()
    return shards
