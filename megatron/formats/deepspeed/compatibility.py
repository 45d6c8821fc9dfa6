"""Does the checkpoint a run resumes from fit the run? Asked before any process starts (deepy.py) and again by
each rank before DeepSpeed loads it, which would stop at the first size mismatch with its own message.

Four things must agree: the tensor/pipeline layout (config.json), the data-parallel size when the optimizer
state is ZeRO-partitioned (DeepSpeed cannot re-partition it), the shape of every tensor in the layout's
real weight files (pipeline layer files included) with the model the config describes, and every model key
(config.json's ARCHITECTURE_KEYS, of which Θ, τ, rotary and the norms change no shape). Every difference is
named at once, with the fix: another config, deepy.py's re-shard before launch (megatron/growth/reshard_on_resume.py,
which asks this module when a checkpoint needs one), or tools/grow_checkpoint.py, which re-shards into any layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from megatron.checkpoint.manifest import read_manifest
from megatron.checkpoint.safety import load_checkpoint_file
from megatron.formats.deepspeed.model_files import ModelFiles
from megatron.formats.deepspeed.portable import MARKER as PORTABLE_MARKER
from megatron.formats.tensor_parallel import split_dimensions
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.args import ARCHITECTURE_KEYS
from megatron.mpu import full_shape

ZERO_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
RESHARD = ("set reshard_on_resume: true (the default), which re-shards it beside the original, or re-shard it "
           "into this run's layout with tools/grow_checkpoint.py (the slot counts unchanged)")


def _saved_config(tag_dir: Path) -> dict:
    path = tag_dir / "config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def holds_weights_only(tag_dir: Path) -> bool:
    """A checkpoint of weights and no training state (tools/convert_from_hf.py and
    convert_official_checkpoint.py write these): no ZeRO shards, no portable optimizer state, no optimizer in
    its DeepSpeed headers. Nothing of it needs DeepSpeed's layout, so a run loads it into any layout, at
    iteration 0 (megatron/growth/partial_init.py)."""
    if (tag_dir / PORTABLE_MARKER).is_file() or saved_data_parallel_size(tag_dir):
        return False
    headers = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    return bool(headers) and all(load_checkpoint_file(path).get("optimizer") is None for path in headers)


def _checkpoint_file_names(tag_dir: Path) -> list[str]:
    """The files its manifest lists (a file copied in beside them is no part of it); every file where it has
    none or an unreadable one (the resume refuses or verifies that checkpoint on its own)."""
    try:
        records = read_manifest(tag_dir)
    except ValueError:
        records = None
    if records is None:
        return [path.name for path in tag_dir.iterdir()]
    return [record.name for record in records]


def saved_data_parallel_size(tag_dir: Path) -> int | None:
    """Over how many data-parallel ranks the checkpoint's ZeRO optimizer state is partitioned; None if it
    holds no ZeRO shards (ZeRO stage 0, or the grow tool's portable state, which fits any size). Its config.json
    says it (the saving run's world size over its model and pipeline sizes); one without world_size (an older
    checkpoint) by the data-parallel ranks of the shards its manifest lists."""
    shard_ranks = set()
    for name in _checkpoint_file_names(tag_dir):
        match = ZERO_SHARD.match(name)
        if match:
            shard_ranks.add(int(match.group(1)))
    if not shard_ranks:
        return None
    saved = _saved_config(tag_dir)
    if isinstance(saved.get("world_size"), int):
        model_ranks = saved.get("model_parallel_size", 1) * max(1, saved.get("pipe_parallel_size", 0))
        return saved["world_size"] // model_ranks
    return len(shard_ranks)


def layout_problems(tag_dir: Path, cfg, data_parallel_size: int | None = None) -> list[str]:
    """The tensor/pipeline layout of `tag_dir` against the run's, and, given the run's data-parallel size,
    ZeRO-partitioned optimizer state saved over another one."""
    saved, problems = _saved_config(tag_dir), []
    for key, default in (("model_parallel_size", 1), ("pipe_parallel_size", 0)):
        value = saved.get(key, default)
        if saved and value != getattr(cfg, key):
            problems.append(f"load: {tag_dir} was saved with {key}={value} but this run has {key}="
                            f"{getattr(cfg, key)}; resume with {key}={value}, or {RESHARD}")
    saved_ranks = saved_data_parallel_size(tag_dir) if data_parallel_size is not None else None
    if saved_ranks is not None and saved_ranks != data_parallel_size and not getattr(cfg, "eval_only", False):
        problems.append(
            f"load: {tag_dir} holds ZeRO optimizer state partitioned over {saved_ranks} data-parallel ranks but this "
            f"run has {data_parallel_size}, and DeepSpeed cannot re-partition it: resume on {saved_ranks} "
            f"data-parallel ranks, or {RESHARD}, whose output any data-parallel size loads")
    return problems


def architecture_problems(tag_dir: Path, cfg) -> list[str]:
    """The model keys this run sets otherwise than the checkpoint's config.json, in one message; [] if none.
    Asked after tensor_problems: Θ, τ, rotary, the norms keep every shape, so without this a run would resume the
    weights silently into another function."""
    saved = _saved_config(tag_dir)
    keys = [f"{key} (saved {saved[key]!r}, this run {getattr(cfg, key)!r})" for key in ARCHITECTURE_KEYS
            if key in saved and saved[key] != getattr(cfg, key)]
    if not keys:
        return []
    return [f"load: {tag_dir} was trained as another model: {'; '.join(keys)}. Its weights compute a different "
            "function under these values: set them as in its config.json (to grow the slot counts, use "
            "tools/grow_checkpoint.py)"]


def tensor_problems(tag_dir: Path, cfg, padded_vocab_size: int, saved_layout: bool = False) -> list[str]:
    """Every tensor of `tag_dir`'s weight files whose name or shape does not fit the model `cfg` describes
    (each tensor rank's block, as this run splits them, or as the checkpoint was split: `saved_layout`), in one
    message; [] if all fit."""
    args = TokenFormerArgs.for_inference(cfg, padded_vocab_size)
    model = TokenFormerModel(args, device="meta")
    ranks = _saved_config(tag_dir).get("model_parallel_size", 1) if saved_layout else cfg.model_parallel_size
    dims = split_dimensions(args)
    expected = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shape = list(full_shape(tensor))
        if dims[name] is not None:
            shape[dims[name]] //= ranks
        expected[name] = shape
    files = ModelFiles(tag_dir, cfg.num_layers)
    saved_names, lines = files.names(), []
    for name in sorted(expected.keys() | saved_names):
        if name not in saved_names:
            lines.append(f"{name}: in the model, not in the checkpoint")
        elif name not in expected:
            lines.append(f"{name}: in the checkpoint, not in the model")
        elif (saved := list(files.block(name, 0).shape)) != expected[name]:
            lines.append(f"{name}: checkpoint {saved}, this config {expected[name]}")
    if not lines:
        return []
    saved = _saved_config(tag_dir)
    keys = [f"{key} (saved {saved[key]!r}, this run {getattr(cfg, key)!r})" for key in ARCHITECTURE_KEYS
            if key in saved and saved[key] != getattr(cfg, key)]
    differing = f"its config.json differs in {'; '.join(keys)}. " if keys else ""
    return [f"load: {tag_dir} does not fit the model this config describes: {differing}{len(lines)} tensors "
            "differ (per tensor-parallel rank):\n  " + "\n  ".join(lines)
            + "\nResume with the checkpoint's config (its config.json), or point load at a checkpoint of this model"]
