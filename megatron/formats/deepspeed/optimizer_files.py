"""Adam's state in a DeepSpeed checkpoint: per model-parallel rank and module parameter, the flat fp32 master
and moments (engine_optimizer.py says which optimizer keeps what).

    [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt    ZeRO stage 1/2, BF16_Optimizer: data-parallel rank D's
        partition of each parameter group of model-parallel rank XX: the flat fp32 masters
        ('single_partition_of_fp32_groups'), torch's state of the flat partitions ('base_optimizer_state', a
        list of per-group states with elastic_checkpoint), and where each parameter's fragment lies in the
        partition ('param_slice_mappings': module name -> (start, numel)). A parameter's fragments in
        data-parallel rank order are its flattened values; alignment padding lies outside every fragment.
    mp_rank_XX_model_states.pt 'optimizer'               ZeRO stage 0: torch's state_dict of the per-parameter
        optimizer ('optimizer_state_dict' beside the fp32 copies 'fp32_groups' for FP16_UnfusedOptimizer),
        numbered in the order of the names saved beside it (OPTIMIZER_PARAMETER_NAMES).

XX is DeepSpeed's model-parallel rank: stage · model_parallel_size + tensor rank under a pipeline, the
tensor rank without one. Files are memory-mapped; `get` gives one parameter's state, read-only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from megatron.checkpoint.engine_optimizer import OPTIMIZER_PARAMETER_NAMES
from megatron.checkpoint.safety import load_checkpoint_file
from megatron.cli import InputError

_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass(frozen=True)
class FlatState:
    """A parameter's optimizer state on one model-parallel rank, flattened; `master` None: the module's weight
    is the master; moments None: the optimizer has taken no step."""

    master: Tensor | None
    exp_avg: Tensor | None
    exp_avg_sq: Tensor | None


class PartitionedState:
    """ZeRO stage 1/2 and BF16_Optimizer shards, given in data-parallel rank order per model-parallel rank."""

    def __init__(self, shards: dict[int, list[Path]]) -> None:
        self._fragments: dict[tuple[int, str], list[tuple[dict, int, int, int]]] = {}
        self.step = None
        for mp_rank, paths in sorted(shards.items()):
            for path in paths:
                partition = load_checkpoint_file(path)["optimizer_state_dict"]
                for group, mapping in enumerate(partition["param_slice_mappings"]):
                    state = _group_state(partition, group)
                    if self.step is None and state:
                        self.step = int(state["step"])
                    for name, address in mapping.items():
                        self._fragments.setdefault((mp_rank, name), []).append(
                            (partition, group, address.start, address.numel))

    def names(self) -> list[tuple[int, str]]:
        """(model-parallel rank, module parameter name) of every parameter with state."""
        return list(self._fragments)

    def get(self, mp_rank: int, name: str) -> FlatState:
        """The parameter's fragments joined: its flat master and moments (views of the file where one data-parallel
        rank holds it all)."""
        fragments = self._fragments[(mp_rank, name)]
        masters = [partition["single_partition_of_fp32_groups"][group].narrow(0, start, numel)
                   for partition, group, start, numel in fragments]
        states = [_group_state(partition, group) for partition, group, _, _ in fragments]
        if not all(states):
            return FlatState(_joined(masters), None, None)
        moments = [_joined([state[key].narrow(0, start, numel) for state, (_, _, start, numel)
                            in zip(states, fragments)]) for key in ("exp_avg", "exp_avg_sq")]
        return FlatState(_joined(masters), *moments)


def _joined(fragments: list[Tensor]) -> Tensor:
    """One flat tensor of `fragments`: the only one itself, not a copy (torch.cat always copies)."""
    return fragments[0] if len(fragments) == 1 else torch.cat(fragments)


def _group_state(partition: dict, group: int) -> dict:
    """torch's state of parameter group `group`'s flat partition ({} before the first step)."""
    base = partition["base_optimizer_state"]
    if isinstance(base, list):  # elastic_checkpoint
        return base[group]
    return base["state"].get(base["param_groups"][group]["params"][0], {})


class PerParameterState:
    """ZeRO stage 0: the state inside the model files."""

    def __init__(self, headers: list[dict], where: Path) -> None:
        self._entries: dict[tuple[int, str], tuple[dict, Tensor | None]] = {}
        self.step = None
        for mp_rank, header in enumerate(headers):
            saved, names = header["optimizer"], header.get(OPTIMIZER_PARAMETER_NAMES)
            if names is None:
                raise InputError(f"{where}/mp_rank_{mp_rank:02d}_model_states.pt holds ZeRO stage 0 optimizer state "
                                 "without the parameter names it is numbered by (it was saved before checkpoints "
                                 "recorded them): resume it with this version for one checkpoint save, and use that")
            torch_state = saved.get("optimizer_state_dict", saved)
            copies = saved.get("fp32_groups") or [[None] * len(group) for group in names]
            for group, group_names, group_copies in zip(torch_state["param_groups"], names, copies, strict=True):
                for index, name, copy in zip(group["params"], group_names, group_copies, strict=True):
                    state = torch_state["state"].get(index, {})
                    if self.step is None and state:
                        self.step = int(state["step"])
                    self._entries[(mp_rank, name)] = (state, copy)

    def names(self) -> list[tuple[int, str]]:
        """(model-parallel rank, module parameter name) of every parameter the optimizer holds."""
        return list(self._entries)

    def get(self, mp_rank: int, name: str) -> FlatState:
        state, copy = self._entries[(mp_rank, name)]
        master = None if copy is None else copy.flatten()
        if not state:
            return FlatState(master, None, None)
        return FlatState(master, state["exp_avg"].flatten(), state["exp_avg_sq"].flatten())


def deepspeed_optimizer_state(tag_dir: Path, headers: list[dict]) -> PartitionedState | PerParameterState | None:
    """The optimizer state of a DeepSpeed checkpoint; None if it holds none."""
    shards: dict[int, dict[int, Path]] = {}
    for path in tag_dir.iterdir():
        if match := _SHARD.match(path.name):
            shards.setdefault(int(match[2]), {})[int(match[1])] = path
    if shards:
        for mp_rank, by_dp_rank in shards.items():
            if sorted(by_dp_rank) != list(range(len(by_dp_rank))):
                raise FileNotFoundError(f"{tag_dir}: optimizer shards of data-parallel ranks {sorted(by_dp_rank)} "
                                        f"for mp_rank {mp_rank:02d}, some are missing; copy every file of the "
                                        "checkpoint")
        return PartitionedState({mp: [paths[dp] for dp in sorted(paths)] for mp, paths in shards.items()})
    if any(header.get("optimizer") for header in headers):
        return PerParameterState(headers, tag_dir)
    return None
