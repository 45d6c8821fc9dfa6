"""`load_model`: a checkpoint or exported weights -> a TokenFormerModel for inference, without DeepSpeed.

    from megatron.inference import load_model
    model = load_model("demo_run/checkpoints")      # newest checkpoint, whatever TP/PP layout it was saved in
    logits = model(torch.tensor([[1, 2, 3]]))        # LongTensor [batch, seq] -> logits [batch, seq, vocab]

`path` may be
  - a checkpoint directory (`save`, whose `latest` names the tag) or one `global_stepN` directory in it;
  - an exported directory or file: `model.safetensors` / `pytorch_model.bin` (or a sharded `*.index.json`)
    with `config.json` beside it, or DeepSpeed's zero_to_fp32 output (pass `config=` for that one);
  - the official release's `pytorch_model.bin` (recognised by its keys, official_layout.py; pass `config=`).
The architecture comes from the `config.json` saved with the weights; `config` (a Config, or a YAML/JSON
file) is needed only where none was saved, and when both exist their architecture keys must agree.
Whatever layout the weights were saved in is consolidated into the whole model first. Called where
`mpu` is initialised (generate.py, eval.py under tensor parallelism), each rank then keeps its own block;
anywhere else (a notebook, a script) the model is whole and its logits cover the whole vocabulary.
Weights are cast to fp32.

A checkpoint directory is verified before it is read: the files read (config.json and the model files) must
match its manifest.json (size and SHA-256, as a resume checks them), hashed once per load and shared over the
ranks where a process group is started (every rank then calls load_state, as generate.py and eval.py do). A
damaged checkpoint is an error naming the files, never a silent fallback to an older one as a resume does: a
resumed run only repeats a few steps, but samples or scores of an older model would be reported as the ones
of the model asked for. The optimizer shards are not hashed: they are never opened here, hold about three
times the weights' bytes, and their damage does not change the model (the next resume reports it).
A checkpoint without a manifest (an import by convert_official_checkpoint.py, older versions) loads unverified.
"""

from __future__ import annotations

from functools import partial
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor

from megatron.checkpoint.commit import CHECKPOINT_TAG
from megatron.checkpoint.deepspeed_files import LAYER_FILE, MODEL_FILE, read_tensor_rank_states, tag_directory
from megatron.checkpoint.manifest import FileRecord, file_problems, read_manifest
from megatron.checkpoint.official_layout import from_official, is_official, official_key
from megatron.checkpoint.reader import CheckpointUnreadable
from megatron.checkpoint.tensor_parallel_layout import merge_shards, split_dimensions
from megatron.checkpoint.weight_files import (
    CONFIG_NAME,
    read_config,
    read_weights,
    weights_in_directory,
    weights_location_problem,
)
from megatron.checkpoint.work_split import map_over_ranks, same_on_all_ranks
from megatron.config import Config
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.args import ARCHITECTURE_KEYS
from megatron.mpu import full_shape, local_block


def _choose_config(saved: Path, given: Config | str | Path | None, weights: Path) -> Config:
    saved_config = read_config(saved) if saved.is_file() else None
    given_config = read_config(given) if isinstance(given, (str, Path)) else given
    if given_config is None and saved_config is None:
        raise FileNotFoundError(f"{weights} has no {CONFIG_NAME} beside it; pass config= (the run's YAML or the "
                                f"{CONFIG_NAME} of the checkpoint it came from)")
    if given_config is not None and saved_config is not None:
        different = [f"{key}: saved {getattr(saved_config, key)!r}, given {getattr(given_config, key)!r}"
                     for key in ARCHITECTURE_KEYS if getattr(saved_config, key) != getattr(given_config, key)]
        if different:
            raise ValueError(f"the config given does not describe the model saved in {weights} ({saved}): "
                             + "; ".join(different) + ". Fix those keys or leave config unset")
    return given_config if given_config is not None else saved_config


def _read_checkpoint(tag_dir: Path, config: Config) -> dict[str, Tensor]:
    shards = read_tensor_rank_states(tag_dir, config.num_layers)
    vocab = shards[0]["word_embeddings.weight"].shape[0] * len(shards)
    dims = split_dimensions(TokenFormerArgs.for_inference(config, vocab))
    missing = sorted(set(dims) - set(shards[0]))
    if missing:
        raise KeyError(f"{tag_dir} has no weights for {missing[:5]}: its config.json does not describe it")
    return merge_shards(shards, dims)


def _records_read(tag_dir: Path) -> list[FileRecord] | str | None:
    """The manifest's records of the files load_state reads (config.json, the model files); None without a
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
    """Collective where a process group is started: CheckpointUnreadable naming every file load_state reads
    that does not match `tag_dir`'s manifest (missing, truncated, corrupted), and the fix."""
    records = same_on_all_ranks(_records_read(tag_dir))
    if records is None:
        return
    problems = [records] if isinstance(records, str) else map_over_ranks(partial(file_problems, tag_dir), records)
    if problems:
        raise CheckpointUnreadable(f"{tag_dir} is damaged: {'; '.join(problems)}. {_other_checkpoints(tag_dir)}")


def load_state(path: str | Path, config: Config | str | Path | None = None) -> tuple[dict[str, Tensor], Config]:
    """The whole model's state dict (fp32 weights) saved at `path`, and the config describing it; a checkpoint
    directory's files are verified first (module docstring)."""
    path = Path(path)
    problem = weights_location_problem(path)
    if problem:
        raise FileNotFoundError(problem)
    tag_dir = tag_directory(path) if path.is_dir() else None
    if tag_dir is not None:
        verify_checkpoint_files(tag_dir)
        cfg = _choose_config(tag_dir / CONFIG_NAME, config, tag_dir)
        state = _read_checkpoint(tag_dir, cfg)
    else:
        weights = weights_in_directory(path) if path.is_dir() else path
        cfg = _choose_config(weights.parent / CONFIG_NAME, config, weights)
        state = read_weights(weights)
        if is_official(state):
            vocab = state[official_key("word_embeddings.weight", cfg.num_layers)].shape[0]
            state = from_official(state, TokenFormerArgs.for_inference(cfg, vocab))
    return {name: t.float() if t.is_floating_point() else t for name, t in state.items()}, cfg


def describe_weights(path: str | Path) -> str:
    """What `path` loads, for a person: the checkpoint directory and its iteration, or the weights file."""
    path = Path(path)
    tag_dir = tag_directory(path) if path.is_dir() else None
    if tag_dir is None:
        return str(path)
    step = tag_dir.name.removeprefix("global_step")
    return f"{tag_dir} (iteration {step})" if step.isdigit() else str(tag_dir)


def check_state_fits(state: dict[str, Tensor], config: Config, source: str | Path) -> None:
    """One error naming every missing, unexpected or misshapen entry if `state` is not the model `config`
    describes (with the vocabulary size of its embedding)."""
    if "word_embeddings.weight" not in state:
        raise KeyError(f"{source} has no word_embeddings.weight: it is not a TokenFormer state dict")
    args = TokenFormerArgs.for_inference(config, state["word_embeddings.weight"].shape[0])
    model = TokenFormerModel(args, device="meta")
    expected = {name: full_shape(tensor) for name, tensor in chain(model.named_parameters(), model.named_buffers())}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{name} {tuple(state[name].shape)} (config: {expected[name]})" for name in expected
             if name in state and tuple(state[name].shape) != expected[name]]
    if missing or unexpected or wrong:
        raise ValueError(f"the weights in {source} do not fit the model its config describes: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, shapes {wrong[:5]}; check the config's model keys")


def _own_block(whole: Tensor, like: Tensor) -> Tensor:
    """This rank's block of `whole`, copied when it is a part, so that the whole tensor can be freed."""
    block = local_block(whole, like)
    return block if block.shape == whole.shape else block.clone()


def build_model(state: dict[str, Tensor], config: Config, device: str | torch.device = "cpu",
                source: str | Path = "the state dict") -> TokenFormerModel:
    """A model in eval mode holding `state` (this rank's blocks of it under tensor parallelism)."""
    check_state_fits(state, config, source)
    args = TokenFormerArgs.for_inference(config, state["word_embeddings.weight"].shape[0])
    model = TokenFormerModel(args, device="meta")
    local = {name: _own_block(state[name], tensor)
             for name, tensor in chain(model.named_parameters(), model.named_buffers())}
    model.load_state_dict(local, assign=True)
    return model.to(device).eval()


def load_model(path: str | Path, config: Config | str | Path | None = None,
               device: str | torch.device = "cpu") -> TokenFormerModel:
    """The model saved at `path`, in eval mode on `device` (see the module docstring for what `path` may be)."""
    state, cfg = load_state(path, config)
    return build_model(state, cfg, device, path)
