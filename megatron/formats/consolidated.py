"""Reading and writing plain (consolidated) weight files: `pytorch_model.bin`/`.pt`, `.safetensors`, and the
sharded form with an `*.index.json` that DeepSpeed's zero_to_fp32 and Hugging Face write for large models.

Loading is safe for untrusted files: torch.load(weights_only=True), which unpickles tensors and plain
containers only, or safetensors, which holds no code at all; a file that cannot be read is one
CheckpointUnreadable naming it and why. Each weights file may have its resolved
config beside it as `config.json` (the JSON `Config.to_json()` writes, also saved in every checkpoint).
The weights files this framework writes (exports, Hugging Face directories) get a `manifest.json` beside them,
as a checkpoint has (megatron/checkpoint/manifest.py): a file it lists is read only if it still has the size
and SHA-256 recorded, since flipped bytes in a tensor would load without a word, or was rewritten after the
manifest (a fine-tune saved into the directory), which is said.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from megatron.checkpoint.manifest import MANIFEST, file_problems, read_manifest, record_file, write_manifest
from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.cli import InputError
from megatron.config import Config, load_config
from megatron.config.growth_schedule import counts_after_each
from megatron.config.schema import TOKEN_COUNT_KEYS
from megatron.formats.deepspeed.files import CheckpointUnreadable, reading_weights, tag_directory
from megatron.model.args import ARCHITECTURE_KEYS

CONFIG_NAME = "config.json"
# How a reader asks for the config that weights without one need: load_model's argument, the tools' option.
PASS_CONFIG = "pass config= (load_model) or --config (tools/*.py)"
TORCH_WEIGHTS = "pytorch_model.bin"
SAFETENSORS_WEIGHTS = "model.safetensors"


def record_weights(directory: Path, files: list[Path]) -> None:
    """`directory`/manifest.json, recording the size and SHA-256 of the weights `files` written into it."""
    write_manifest(directory, [record for file in files if file.suffix in (".safetensors", ".bin", ".pt")
                               for record in record_file(directory, file.name)])


def _verify(path: Path) -> None:
    """CheckpointUnreadable if the manifest beside `path` records it with another size or SHA-256 and the file is
    not newer than the manifest: it changed without being rewritten (bit rot, an edit in place that kept its
    time). A file newer than the manifest was rewritten by another tool (transformers' save_pretrained into the
    exported directory): the manifest is stale, so the file is read unverified, and said so."""
    try:
        records = {record.name: record for record in read_manifest(path.parent) or ()}
    except ValueError as error:
        raise CheckpointUnreadable(f"{error}; export the weights again") from None
    if path.name not in records:
        return
    problems = file_problems(path.parent, records[path.name])
    if not problems:
        return
    if path.stat().st_mtime_ns > (path.parent / MANIFEST).stat().st_mtime_ns:
        print(f"warning: {path} was written after {path.parent / MANIFEST} (by another tool, e.g. transformers' "
              "save_pretrained), so the manifest is stale: the file is read unverified", file=sys.stderr, flush=True)
        return
    raise CheckpointUnreadable(f"{path.parent}/{problems[0]}: it changed since {MANIFEST} was written without "
                               "being rewritten (it is not newer); export the weights again")


def _read_one(path: Path) -> dict[str, Tensor]:
    _verify(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        with reading_weights(path):
            return load_file(path)
    with reading_weights(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise InputError(f"{path} is not a state dict (a mapping of names to tensors); "
                         "pass a consolidated weights file, e.g. one written by tools/export_checkpoint.py")
    return dict(state)


def weight_names(path: Path) -> list[str]:
    """The entry names of a weights file or shard index, without reading tensor data where the format allows
    (safetensors' header, an index's weight_map, a memory-mapped torch zip file)."""
    if path.name.endswith(".index.json"):
        return list(json.loads(path.read_text(encoding="utf-8"))["weight_map"])
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with reading_weights(path), safe_open(path, "pt") as weights:
            return list(weights.keys())
    try:
        with reading_weights(path):
            return list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except CheckpointUnreadable:  # perhaps torch's legacy format, which cannot be memory-mapped: read whole
        return list(_read_one(path))


def weights_file(path: Path) -> Path | None:
    """The weights `path` is, or that the directory `path` holds; None if neither."""
    return weights_in_directory(path) if path.is_dir() else path if path.is_file() else None


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """The state dict in a weights file, or in the shards an `*.index.json` file lists (its `weight_map`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    if path.name.endswith(".index.json"):
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        state: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(_read_one(path.parent / shard))
        return state
    return _read_one(path)


def _whole(tensor: Tensor) -> Tensor:
    """`tensor` alone in its storage, contiguous, on the CPU: safetensors refuses tensors sharing memory."""
    tensor = tensor.detach().cpu()
    alone = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes
    return tensor if alone else tensor.clone(memory_format=torch.contiguous_format)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_safetensors(tensors: Mapping[str, Tensor], path: Path) -> None:
    """A .safetensors file with the mode any new file gets (safetensors writes a private 0600 temporary)."""
    from safetensors.torch import save_file

    save_file(dict(tensors), path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def write_safetensors_shards(state: Mapping[str, Tensor], directory: Path, max_shard_bytes: int) -> list[Path]:
    """`directory`/model.safetensors, or, when the tensors exceed `max_shard_bytes`, shards
    model-0000i-of-0000N.safetensors of at most that size (a larger tensor alone in one) listed by
    model.safetensors.index.json (`weight_map`, `metadata.total_size`), as Hugging Face writes them."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        tensor = _whole(tensor)
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_safetensors(shards[0], directory / SAFETENSORS_WEIGHTS)
        return [directory / SAFETENSORS_WEIGHTS]
    paths = [directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, path in zip(shards, paths):
        save_safetensors(shard, path)
    index = {"metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard.values())},
             "weight_map": {name: path.name for shard, path in zip(shards, paths) for name in shard}}
    index_path = directory / f"{SAFETENSORS_WEIGHTS}.index.json"
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*paths, index_path]


def weights_in_directory(directory: Path) -> Path | None:
    """The weights file (or shard index) of an exported directory, None if it holds none."""
    for name in (SAFETENSORS_WEIGHTS, TORCH_WEIGHTS):
        for candidate in (directory / name, directory / f"{name}.index.json"):
            if candidate.is_file():
                return candidate
    return None


def weights_location_problem(path: str | Path) -> str | None:
    """Why `path` cannot be loaded as a model (no such path; a directory holding neither a checkpoint nor exported
    weights; a `latest` naming a missing tag), checked by names alone; None if it can be tried."""
    path = Path(path)
    if not path.exists():
        return f"{path} does not exist: pass a checkpoint directory or an exported weights file"
    if path.is_dir():
        try:
            if tag_directory(path) is None and weights_in_directory(path) is None:
                return (f"{path} holds neither a checkpoint (latest, global_stepN/) nor exported weights "
                        "(model.safetensors, pytorch_model.bin)")
        except FileNotFoundError as error:
            return str(error)
    return None


def read_config(path: str | Path) -> Config:
    """A Config from a resolved-config JSON file (`config.json`) or from GPT-NeoX YAML (safe loader)."""
    path = Path(path)
    if path.suffix == ".json":
        return Config.from_json(path.read_text(encoding="utf-8"))
    return load_config([path])


def write_weights(state: Mapping[str, Tensor], config: Config, directory: str | Path, safetensors: bool) -> Path:
    """`directory`/model.safetensors (or pytorch_model.bin) and `directory`/config.json; returns the weights.

    `directory` must be new or empty (another export's files would be replaced, or left beside these).
    """
    directory = require_new_or_empty(directory, "the output directory")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    if safetensors:
        target = directory / SAFETENSORS_WEIGHTS
        save_safetensors(tensors, target)
    else:
        target = directory / TORCH_WEIGHTS
        torch.save(tensors, target)
    (directory / CONFIG_NAME).write_text(config.to_json(), encoding="utf-8")
    record_weights(directory, [target])
    return target


def _as_grown(given: Config, saved: Config) -> Config:
    """`given` at `saved`'s slot counts where `given`'s growth_schedule grows its model to them (the run's own
    config, read for a checkpoint saved after an online growth); else `given`."""
    stages = counts_after_each(given)
    counts = {key: getattr(saved, key) for key in TOKEN_COUNT_KEYS}
    if counts == stages[0] or counts not in stages:
        return given
    return Config.from_dict({**given.to_dict(), **counts, "growth_schedule": None})


def choose_config(saved: Path, given: Config | str | Path | None, weights: Path) -> Config:
    """The config of the weights `weights`: `saved` (their config.json) or `given`; both must then agree on
    the architecture (`given` at the slot counts its growth_schedule reached, where it has one)."""
    saved_config = read_config(saved) if saved.is_file() else None
    given_config = read_config(given) if isinstance(given, (str, Path)) else given
    if given_config is None and saved_config is None:
        raise FileNotFoundError(f"{weights} has no {CONFIG_NAME} beside it; {PASS_CONFIG} (the run's YAML or the "
                                f"{CONFIG_NAME} of the checkpoint it came from)")
    if given_config is not None and saved_config is not None:
        given_config = _as_grown(given_config, saved_config)
        different = [f"{key}: saved {getattr(saved_config, key)!r}, given {getattr(given_config, key)!r}"
                     for key in ARCHITECTURE_KEYS if getattr(saved_config, key) != getattr(given_config, key)]
        if different:
            raise InputError(f"the config given does not describe the model saved in {weights} ({saved}): "
                             + "; ".join(different) + ". Fix those keys or leave config unset")
    return given_config if given_config is not None else saved_config


NAME = "consolidated"


def recognises(path: Path) -> bool:
    """A weights file, or a directory holding one (model.safetensors, pytorch_model.bin, or a shard index), under
    this framework's names (`word_embeddings.weight`: the official release's and a Hugging Face export's differ)."""
    weights = weights_file(path)
    return weights is not None and "word_embeddings.weight" in weight_names(weights)


def read(path: Path, config: Config | str | Path | None) -> tuple[dict[str, Tensor], Config]:
    """The weights as saved, and the config: config.json beside them, or `config`."""
    weights = weights_file(path)
    return read_weights(weights), choose_config(weights.parent / CONFIG_NAME, config, weights)
