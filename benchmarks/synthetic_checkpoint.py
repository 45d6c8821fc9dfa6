"""A checkpoint of any model size in the layout our Trainer writes, without training: the growth benchmark's
source (a 1-5B model cannot be trained on a 24 GB CPU machine).

The layout is the 1-5B config's: DeepSpeed 0.19's pipeline engine with one stage (pipe_parallel_size 1),
model_parallel_size 1, ZeRO stage 1 over `data_parallel_size` ranks, bf16 with fp32 master weights:

    layer_II-model_00-model_states.pt   bf16 weights of pipeline layer II (model/pipeline.py's numbering)
    mp_rank_00_model_states.pt          the engine's metadata, iteration, consumed samples
    bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt
                                        data-parallel rank R's slice of each parameter group, flattened as
                                        ZeRO does (parameters in the optimizer's order, padded to a multiple
                                        of 2 × ranks, cut in equal parts): fp32 masters, Adam moments, the
                                        parameter -> slice map
    rng_state_R.pt, config.json, manifest.json, latest   as checkpoint/save.py writes them

tests/test_synthetic_checkpoint.py checks that a tiny synthetic checkpoint has the structure of one the
Trainer writes and that the Trainer resumes from it. Weights are random (N(0, 0.02), per parameter name);
the bf16 weights are the fp32 masters rounded, as after a real step.
"""

from __future__ import annotations

import argparse
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
from torch import Tensor, nn

from megatron import mpu
from megatron.checkpoint.commit import LATEST
from megatron.checkpoint.engine_optimizer import OPTIMIZER_PARAMETER_NAMES
from megatron.checkpoint.manifest import record_file, write_durably, write_manifest
from megatron.checkpoint.rng_state import capture_rng_state
from megatron.checkpoint.save import checkpoint_tag
from megatron.config import Config, load_config
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.pipeline import pipeline_place
from megatron.training.optimizer import build_optimizer, deepspeed_config

# DeepSpeed ZeRO pads each flat parameter group to a multiple of this times the data-parallel size.
NCCL_START_ALIGNMENT_FACTOR = 2


TIED = "tied_modules.embed."


def pipeline_name(model_name: str, num_layers: int) -> str:
    """The PipelineModule's name of a TokenFormerModel entry (inverse of pipeline_parameter_model_name)."""
    layer, key = pipeline_place(model_name, num_layers)
    return TIED + key if layer == 0 else f"{layer}.{key}"


def master_weight(model_name: str, shape: torch.Size) -> Tensor:
    seed = int.from_bytes(hashlib.sha256(model_name.encode()).digest()[:7], "little")
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


@dataclass
class FlatGroup:
    """One optimizer parameter group as ZeRO flattens and partitions it over the data-parallel ranks."""

    names: list[str]           # pipeline names, in flat order
    model_names: list[str]
    shapes: list[torch.Size]
    ranks: int

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    @property
    def partition_size(self) -> int:
        alignment = NCCL_START_ALIGNMENT_FACTOR * self.ranks
        return -(-self.numel // alignment) * alignment // self.ranks

    def padding(self, rank: int) -> int:
        start, size = rank * self.partition_size, self.partition_size
        return size if self.numel <= start else max(start + size - self.numel, 0)

    def fragments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """(parameter index, start in the parameter, start in the partition, length) of each parameter
        slice in `rank`'s partition."""
        low, high = rank * self.partition_size, (rank + 1) * self.partition_size
        pieces, offset = [], 0
        for index, shape in enumerate(self.shapes):
            start, end = max(offset, low), min(offset + shape.numel(), high)
            if start < end:
                pieces.append((index, start - offset, start - low, end - start))
            offset += shape.numel()
        return pieces


class _OneOfEach(nn.Module):
    """A matrix and a vector: build_optimizer's two parameter groups, for their hyper-parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.matrix, self.vector = nn.Parameter(torch.zeros(1, 1)), nn.Parameter(torch.zeros(1))


def _optimizer_groups(config: Config, entries: dict[str, torch.Size], ranks: int) -> list[FlatGroup]:
    """build_optimizer's groups (matrices decayed, vectors not), parameters sorted by pipeline name."""
    names = sorted((pipeline_name(name, config.num_layers), name) for name in entries)
    matrices = [(p, m) for p, m in names if len(entries[m]) >= 2]
    vectors = [(p, m) for p, m in names if len(entries[m]) < 2]
    return [FlatGroup([p for p, _ in group], [m for _, m in group], [entries[m] for _, m in group], ranks)
            for group in (matrices, vectors) if group]


def _optimizer_file(config: Config, groups: list[FlatGroup], rank: int, step: int) -> dict:
    masters, states, mappings = [], {}, []
    for index, group in enumerate(groups):
        flat = torch.zeros(group.partition_size)
        mapping = OrderedDict()
        for param, in_param, in_partition, length in group.fragments(rank):
            weight = master_weight(group.model_names[param], group.shapes[param]).view(-1)
            flat[in_partition:in_partition + length] = weight[in_param:in_param + length]
            mapping[group.names[param]] = fragment_address(numel=length, start=in_partition)
        masters.append(flat[:group.partition_size - group.padding(rank)].clone())
        states[index] = {"step": torch.tensor(float(step)), "exp_avg": flat * 1e-3, "exp_avg_sq": flat.square()}
        mappings.append(mapping)
    param_groups = build_optimizer(_OneOfEach(), config, "cpu").state_dict()["param_groups"][:len(groups)]
    return {
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(scale=1.0), "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": config.gradient_clipping,
            "base_optimizer_state": {"state": states, "param_groups": param_groups},
            "single_partition_of_fp32_groups": masters,
            "zero_stage": ZeroStageEnum.optimizer_states,
            "group_paddings": [group.padding(rank) for group in groups],
            "param_alignment_paddings": [[0] * len(group.names) for group in groups],
            "partition_count": [group.ranks for group in groups],
            "ds_version": deepspeed.__version__,
            "param_slice_mappings": mappings,
        },
        "ds_config": deepspeed_config(config),
        "ds_version": deepspeed.__version__,
    }


def _engine_file(config: Config, groups: list[FlatGroup], buffers: list[str], ranks: int, iteration: int) -> dict:
    return {
        "module": None, "buffer_names": buffers, "optimizer": None,
        "param_shapes": [OrderedDict(zip(group.names, group.shapes)) for group in groups],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0, "global_steps": iteration, "global_samples": iteration * config.train_batch_size,
        "dp_world_size": ranks, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": deepspeed_config(config), "ds_version": deepspeed.__version__,
        "iteration": iteration, "consumed_train_samples": iteration * config.train_batch_size,
        OPTIMIZER_PARAMETER_NAMES: None,  # ZeRO's partitioned state names itself
    }


def _check_layout(config: Config) -> int:
    if (config.pipe_parallel_size, config.model_parallel_size, config.precision) != (1, 1, "bfloat16") or (
            (config.zero_optimization or {}).get("stage") != 1 or config.world_size is None):
        raise ValueError("the synthetic checkpoint has the 1-5B config's layout: pipe_parallel_size 1, "
                         "model_parallel_size 1, bf16, zero_optimization stage 1, and a world size (the number "
                         f"of data-parallel ranks); got {config.pipe_parallel_size}, {config.model_parallel_size}, "
                         f"{config.precision}, {config.zero_optimization}, {config.world_size}")
    return config.world_size


def write_synthetic_checkpoint(config: Config, save_dir: Path, iteration: int) -> Path:
    """`save_dir`/global_step`iteration` of the model `config` describes (padded_vocab_size set), published
    with `latest`; one rank's memory holds one optimizer file at a time."""
    ranks = _check_layout(config)
    tag_dir = Path(save_dir) / checkpoint_tag(iteration)
    tag_dir.mkdir(parents=True)
    model = TokenFormerModel(TokenFormerArgs.from_config(config), device="meta")
    entries = {name: tensor.shape for name, tensor in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def value(name: str, shape: torch.Size) -> Tensor:  # a fresh model's n is its Pattention's token count
        if name in buffers:
            return torch.tensor(model.get_submodule(name.rpartition(".")[0]).key_param_tokens.shape[0])
        return master_weight(name, shape).bfloat16()

    entries_by_layer = groupby(model.state_dict().items(),
                               key=lambda item: pipeline_place(item[0], config.num_layers)[0])
    written = set()
    for index, items in entries_by_layer:
        state = {pipeline_place(name, config.num_layers)[1]: value(name, tensor.shape)
                 for name, tensor in items}
        torch.save(state, tag_dir / f"layer_{index:02d}-model_00-model_states.pt")
        written.add(index)
    if config.num_layers + 3 not in written:  # the final norm's file exists even when the norm has no weights
        torch.save({}, tag_dir / f"layer_{config.num_layers + 3:02d}-model_00-model_states.pt")
    groups = _optimizer_groups(config, entries, ranks)
    buffer_names = [pipeline_name(name, config.num_layers) for name in buffers]
    torch.save(_engine_file(config, groups, buffer_names, ranks, iteration), tag_dir / "mp_rank_00_model_states.pt")
    for rank in range(ranks):
        torch.save(_optimizer_file(config, groups, rank, iteration),
                   tag_dir / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    mpu.seed_model_parallel_rng(config.seed)
    for rank in range(ranks):
        torch.save(capture_rng_state(), tag_dir / f"rng_state_{rank}.pt")
    (tag_dir / "config.json").write_text(config.to_json(), encoding="utf-8")
    write_manifest(tag_dir, [record for path in sorted(tag_dir.iterdir())
                             for record in record_file(tag_dir, path.name)])
    write_durably(Path(save_dir) / LATEST, tag_dir.name)
    return tag_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", required=True, help="the run's YAML files (padded_vocab_size set)")
    parser.add_argument("--data-parallel", type=int, required=True, help="data-parallel ranks (the world size)")
    parser.add_argument("--iteration", type=int, required=True)
    parser.add_argument("--save", type=Path, required=True, help="a new directory")
    args = parser.parse_args()
    write_synthetic_checkpoint(load_config(args.config, world_size=args.data_parallel), args.save, args.iteration)


if __name__ == "__main__":
    main()
