"""Reading and writing plain (consolidated) weight files: `pytorch_model.bin`/`.pt`, `.safetensors`, and the
sharded form with an `*.index.json` that DeepSpeed's zero_to_fp32 writes for large models.

Loading is safe for untrusted files: torch.load(weights_only=True), which unpickles tensors and plain
containers only, or safetensors, which holds no code at all. Each weights file may have its resolved
config beside it as `config.json` (the JSON `Config.to_json()` writes, also saved in every checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.config import Config, load_config

CONFIG_NAME = "config.json"
TORCH_WEIGHTS = "pytorch_model.bin"
SAFETENSORS_WEIGHTS = "model.safetensors"


def _read_one(path: Path) -> dict[str, Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict (a mapping of names to tensors); "
                         "pass a consolidated weights file, e.g. one written by tools/export_checkpoint.py")
    return dict(state)


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


def weights_in_directory(directory: Path) -> Path | None:
    """The weights file (or shard index) of an exported directory, None if it holds none."""
    for name in (SAFETENSORS_WEIGHTS, TORCH_WEIGHTS):
        for candidate in (directory / name, directory / f"{name}.index.json"):
            if candidate.is_file():
                return candidate
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
        from safetensors.torch import save_file

        target = directory / SAFETENSORS_WEIGHTS
        save_file(tensors, target, metadata={"format": "pt"})
    else:
        target = directory / TORCH_WEIGHTS
        torch.save(tensors, target)
    (directory / CONFIG_NAME).write_text(config.to_json(), encoding="utf-8")
    return target
