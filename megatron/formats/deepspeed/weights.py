"""The whole model's weights in a checkpoint of this framework, whatever TP/PP layout saved it: the
DeepSpeed format's reader of the canonical state (registry.py) for inference and the conversion tools.

A checkpoint directory is verified before it is read: the files read (config.json and the model files) must
match its manifest.json (size and SHA-256, as a resume checks them), hashed once per load and shared over the
ranks where a process group is started (every rank then calls read_state, as generate.py and eval.py do). A
damaged checkpoint is an error naming the files, never a silent fallback to an older one as a resume does: a
resumed run only repeats a few steps, but samples or scores of an older model would be reported as the ones
of the model asked for. The optimizer shards are not hashed: they are never opened here, hold about three
times the weights' bytes, and their damage does not change the model (the next resume reports it).
A checkpoint without a manifest (an import by convert_official_checkpoint.py, older versions) loads unverified.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from torch import Tensor

from megatron.checkpoint.commit import CHECKPOINT_TAG
from megatron.checkpoint.manifest import FileRecord, file_problems, read_manifest
from megatron.checkpoint.work_split import map_over_ranks, same_on_all_ranks
from megatron.config import Config
from megatron.formats.consolidated import CONFIG_NAME, choose_config
from megatron.formats.deepspeed.files import LAYER_FILE, MODEL_FILE, read_tensor_rank_states, tag_directory
from megatron.formats.deepspeed.reader import CheckpointUnreadable
from megatron.formats.tensor_parallel import merge_shards, split_dimensions
from megatron.model import TokenFormerArgs

NAME = "checkpoint"


def recognises(path: Path) -> bool:
    """A `save` directory with `latest`, or one `global_stepN` directory."""
    return path.is_dir() and tag_directory(path) is not None


def read(path: Path, config: Config | str | Path | None) -> tuple[dict[str, Tensor], Config]:
    """The whole model and its config, the files verified against the manifest first."""
    tag_dir = tag_directory(path)
    verify_checkpoint_files(tag_dir)
    cfg = choose_config(tag_dir / CONFIG_NAME, config, tag_dir)
    return _merged_weights(tag_dir, cfg), cfg


def _merged_weights(tag_dir: Path, config: Config) -> dict[str, Tensor]:
    shards = read_tensor_rank_states(tag_dir, config.num_layers)
    vocab = shards[0]["word_embeddings.weight"].shape[0] * len(shards)
    dims = split_dimensions(TokenFormerArgs.for_inference(config, vocab))
    missing = sorted(set(dims) - set(shards[0]))
    if missing:
        raise KeyError(f"{tag_dir} has no weights for {missing[:5]}: its config.json does not describe it")
    return merge_shards(shards, dims)


def _records_read(tag_dir: Path) -> list[FileRecord] | str | None:
    """The manifest's records of the files read_state reads (config.json, the model files); None without a
    manifest; the reason, as text, when the manifest is unreadable (every rank then raises alike)."""
    try:
        records = read_manifest(tag_dir)
    except ValueError as error:
        return str(error)
    if records is None:
        return None
    return [r for r in records if r.name == CONFIG_NAME or MODEL_FILE.match(r.name) or LAYER_FILE.match(r.name)]


def _other_checkpoints(tag_dir: Path) -> str:
    """The fix for a damaged `tag_dir`, naming the other checkpoints beside it, newest first."""
    others = sorted(((int(m.group(1)), p.name) for p in tag_dir.parent.iterdir()
                     if (m := CHECKPOINT_TAG.match(p.name)) and p.is_dir() and p != tag_dir), reverse=True)
    if not others:
        return "Restore the damaged files from a copy of the checkpoint"
    return (f"Restore the damaged files from a copy, or load another checkpoint: pass its directory, e.g. "
            f"load={tag_dir.parent / others[0][1]} (there are {', '.join(name for _, name in others)}; "
            "each is verified when loaded)")


def verify_checkpoint_files(tag_dir: Path) -> None:
    """Collective where a process group is started: CheckpointUnreadable naming every file read_state reads
    that does not match `tag_dir`'s manifest (missing, truncated, corrupted), and the fix."""
    records = same_on_all_ranks(_records_read(tag_dir))
    if records is None:
        return
    problems = [records] if isinstance(records, str) else map_over_ranks(partial(file_problems, tag_dir), records)
    if problems:
        raise CheckpointUnreadable(f"{tag_dir} is damaged: {'; '.join(problems)}. {_other_checkpoints(tag_dir)}")
