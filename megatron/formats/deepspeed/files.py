"""This project's checkpoints (DeepSpeed's layout) as per-tensor-rank state dicts under TokenFormerModel's names.

    SAVE/latest                                    names the newest tag, e.g. global_step300
    SAVE/global_stepN/config.json                  the resolved config of the run
    SAVE/global_stepN/mp_rank_XX_model_states.pt   one pipeline stage: tensor rank XX's weights ('module')
    SAVE/global_stepN/layer_II-model_XX-model_states.pt
                                                   pipeline stages: layer II of pipeline.py's numbering,
                                                   tensor rank XX's block (the mp_rank files then hold
                                                   no weights)

Weights are read with torch.load(weights_only=True); a file that cannot be read so (a pickle referring to more
than tensors, a corrupted file) is one CheckpointUnreadable naming it and why (checkpoint/safety.py). The
optimizer shards (`*_optim_states.pt`) and rng_state files are never opened.

`write_checkpoint` writes the single-stage layout: what DeepSpeed's engine.load_checkpoint reads for the
weights, at iteration 0, without optimizer state (an inference checkpoint, e.g. converted official weights).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from megatron.checkpoint.commit import LATEST, is_tag_name, read_latest
from megatron.checkpoint.manifest import checkpoint_files, record_file, write_manifest
from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.checkpoint.safety import torch_file_problems
from megatron.cli import InputError
from megatron.config import Config
from megatron.model.pipeline import model_parameter_name

MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


class CheckpointUnreadable(InputError):
    """A source checkpoint that cannot be read: missing, incomplete, corrupted or not describing itself."""


def tag_directory(path: Path) -> Path | None:
    """The `global_stepN` directory `path` is or whose `latest` names; None if `path` is neither."""
    marker = path / LATEST
    if marker.is_file():
        try:
            tag = read_latest(path)
        except ValueError as error:
            raise FileNotFoundError(f"{error}; write the name of the checkpoint to load into it") from None
        if not is_tag_name(tag):
            raise FileNotFoundError(f"{marker} names {tag!r}, which is not a checkpoint directory inside {path} (such "
                                    "as global_step5); load that checkpoint by its own path if it is the one meant")
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise FileNotFoundError(f"{marker} names {tag_dir.name!r}, but {tag_dir} does not exist")
        return tag_dir
    if any(MODEL_FILE.match(p.name) or LAYER_FILE.match(p.name) for p in path.iterdir()):
        return path
    return None


@contextmanager
def reading_weights(path: Path) -> Iterator[None]:
    """A weights file that cannot be read becomes one CheckpointUnreadable naming it: a damaged safetensors file,
    a torch file that is corrupted, or whose pickle refers to more than tensors (checkpoint/safety.py's reason)."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        raise CheckpointUnreadable(f"{path} is not a readable safetensors file (truncated or corrupted): {error}; "
                                   "export the weights again") from None
    except (pickle.UnpicklingError, RuntimeError) as error:
        reasons = torch_file_problems(path) or [(str(error) or type(error).__name__).splitlines()[0]]
        raise CheckpointUnreadable(f"{path} cannot be read: {'; '.join(reasons)}") from None


def _load(path: Path) -> dict:
    with reading_weights(path):
        return torch.load(path, map_location="cpu", weights_only=True)


def files_by_rank(tag_dir: Path, pattern: re.Pattern) -> dict[tuple[int, ...], Path]:
    """`tag_dir`'s files matching MODEL_FILE or LAYER_FILE, by their numbers ((rank,) or (layer, rank))."""
    return {tuple(int(g) for g in m.groups()): p for p in tag_dir.iterdir() if (m := pattern.match(p.name))}


def check_ranks(tag_dir: Path, ranks: list[int]) -> int:
    """The tensor-parallel size the files' `ranks` show; FileNotFoundError when one is missing."""
    if sorted(set(ranks)) != list(range(len(set(ranks)))):
        raise FileNotFoundError(f"{tag_dir}: tensor ranks {sorted(set(ranks))} found, some are missing; "
                                "copy every mp_rank/layer file of the checkpoint")
    return len(set(ranks))


def read_tensor_rank_states(tag_dir: Path, num_layers: int) -> list[dict[str, Tensor]]:
    """One state dict per tensor-parallel rank, in rank order, under TokenFormerModel's names."""
    layer_files = files_by_rank(tag_dir, LAYER_FILE)
    if layer_files:
        ranks = check_ranks(tag_dir, [rank for _, rank in layer_files])
        states: list[dict[str, Tensor]] = [{} for _ in range(ranks)]
        for (layer, rank), path in sorted(layer_files.items()):
            for key, tensor in _load(path).items():
                states[rank][model_parameter_name(layer, key, num_layers)] = tensor
        return states
    model_files = files_by_rank(tag_dir, MODEL_FILE)
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} holds no mp_rank_XX_model_states.pt or layer_*-model_states.pt files")
    check_ranks(tag_dir, [rank for (rank,) in model_files])
    return [_load(model_files[(rank,)])["module"] for rank in range(len(model_files))]


def write_checkpoint(shards: list[Mapping[str, Tensor]], config: Config, save_dir: str | Path,
                     tag: str = "global_step0") -> Path:
    """`save_dir`/`tag`/mp_rank_XX_model_states.pt for each tensor rank, config.json, manifest.json (so that a
    run verifies the files), and `latest` (last).

    `save_dir` must be new or empty: writing into a run's directory would repoint its `latest` at these
    weights, and the run would resume from them.
    """
    import deepspeed

    save_dir = require_new_or_empty(save_dir)
    tag_dir = save_dir / tag
    tag_dir.mkdir(parents=True)
    for rank, shard in enumerate(shards):
        torch.save({
            "module": dict(shard),
            "optimizer": None, "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
            "global_steps": 0, "global_samples": 0, "skipped_steps": 0,
            "dp_world_size": 1, "mp_world_size": len(shards), "ds_version": deepspeed.__version__,
            "iteration": 0, "consumed_train_samples": 0,
        }, tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    (tag_dir / "config.json").write_text(config.to_json(), encoding="utf-8")
    write_manifest(tag_dir, [record for name in checkpoint_files(tag_dir) for record in record_file(tag_dir, name)])
    (save_dir / LATEST).write_text(tag, encoding="utf-8")
    return tag_dir
