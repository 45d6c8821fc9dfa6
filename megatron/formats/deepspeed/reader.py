"""Read a checkpoint's full training state, whatever layout wrote it, one TokenFormerModel entry at a time.

    source = open_checkpoint("runs/150M/checkpoints")        # `latest`, or tag="global_step300"
    for name in source.names():
        state = source.state(name)    # ParameterState: whole fp32 weight (the master where the run kept
                                      # one), Adam's moments (None without optimizer state); buffers as stored

Any checkpoint our Trainer writes (fp32/bf16/fp16, ZeRO stage 0/1/2, any tensor, pipeline and data-parallel
size; model_files.py, deepspeed_optimizer.py) or the grow tool writes (portable.py). Files are memory-mapped
and each call reads just the entry asked for, so memory stays near one parameter. A run that froze a
Pattention's leading tokens (freeze_old_param_tokens) optimized only the trailing rows: the frozen rows read
with zero moments (names.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from megatron.checkpoint.parameter_state import ParameterState, as_fp32
from megatron.checkpoint.selection import checkpoint_problems
from megatron.config import Config
from megatron.formats.deepspeed.files import CheckpointUnreadable, tag_directory
from megatron.formats.deepspeed.model_files import ModelFiles
from megatron.formats.deepspeed.names import tokenformer_name
from megatron.formats.deepspeed.optimizer_files import deepspeed_optimizer_state
from megatron.formats.deepspeed.portable import PortableMoments, is_portable
from megatron.formats.tensor_parallel import split_dimensions
from megatron.model import TokenFormerArgs, TokenFormerModel


def _with_trailing(flat: Tensor, base: Tensor, what: str, *, zeros: bool = False) -> Tensor:
    """fp32 `base` (or zeros of its shape) with its last flat.numel() values (its trailing rows) replaced by
    `flat`; `flat` itself, viewed in `base`'s shape, when it covers all of it (no copy: the caller only reads)."""
    if flat.numel() > base.numel():
        raise CheckpointUnreadable(f"{what}: the optimizer holds {flat.numel()} values for a block of "
                                   f"{base.numel()}; the checkpoint's files do not belong together")
    if flat.numel() == base.numel():
        return flat.view(base.shape)
    out = torch.zeros(base.shape) if zeros else base.to(torch.float32, copy=True)
    out.view(-1)[base.numel() - flat.numel():] = flat
    return out


class _DeepSpeedMoments:
    """DeepSpeed's optimizer state, addressed by TokenFormerModel name and tensor rank."""

    def __init__(self, tag_dir: Path, files: ModelFiles, config: Config) -> None:
        self._state = deepspeed_optimizer_state(tag_dir, files.headers)
        self.step = None if self._state is None else self._state.step
        self._where: dict[tuple[str, int], tuple[int, str]] = {}
        pipelined, tensor_ranks = config.pipe_parallel_size >= 1, config.model_parallel_size
        for mp_rank, module_name in sorted(self._state.names() if self._state else ()):
            key = (tokenformer_name(module_name, config.num_layers, pipelined), mp_rank % tensor_ranks)
            self._where.setdefault(key, (mp_rank, module_name))  # a tied weight: the first stage's copy

    def with_moments(self, name: str, tensor_rank: int, saved: Tensor) -> ParameterState:
        """The block's state from `saved` (its module weight as stored) and the optimizer's fp32 master and
        moments where it holds them; views of the files where they hold the block whole."""
        if (name, tensor_rank) not in self._where:
            return ParameterState(as_fp32(saved))
        flat = self._state.get(*self._where[(name, tensor_rank)])
        what = f"{name} of tensor rank {tensor_rank}"
        weight = as_fp32(saved) if flat.master is None else _with_trailing(flat.master, saved, what)
        if flat.exp_avg is None:
            return ParameterState(weight)
        return ParameterState(weight, _with_trailing(flat.exp_avg, saved, what, zeros=True),
                              _with_trailing(flat.exp_avg_sq, saved, what, zeros=True))


class SourceCheckpoint:
    """One checkpoint's training state (see the module docstring); `iteration`, `consumed_train_samples` and
    `optimizer_step` (Adam's step count, None without optimizer state) continue the run."""

    def __init__(self, tag_dir: Path, config: Config) -> None:
        self.tag_dir, self.config = Path(tag_dir), config
        self._files = ModelFiles(self.tag_dir, config.num_layers)
        if self._files.tensor_ranks != config.model_parallel_size:
            raise CheckpointUnreadable(f"{tag_dir} holds {self._files.tensor_ranks} tensor ranks' files but its "
                                       f"config.json says model_parallel_size={config.model_parallel_size}")
        if "word_embeddings.weight" not in self._files.names():
            raise CheckpointUnreadable(f"{tag_dir} has no word_embeddings.weight: it is not a TokenFormer checkpoint")
        vocab = self._files.block("word_embeddings.weight", 0).shape[0] * config.model_parallel_size
        args = TokenFormerArgs.for_inference(config, vocab)
        self._dims = split_dimensions(args)
        self._names = list(TokenFormerModel(args, device="meta").state_dict())
        missing = sorted(set(self._names) - self._files.names())
        if missing:
            raise CheckpointUnreadable(f"{tag_dir} has no weights for {missing[:5]}: its config.json does not "
                                       "describe it")
        header = self._files.headers[0]
        self.iteration, self.consumed_train_samples = header["iteration"], header["consumed_train_samples"]
        self._moments = (PortableMoments(self.tag_dir) if is_portable(self.tag_dir)
                         else _DeepSpeedMoments(self.tag_dir, self._files, config))
        self.optimizer_step: int | None = self._moments.step

    def names(self) -> list[str]:
        """Every TokenFormerModel state-dict entry (parameters and buffers), in the model's order."""
        return list(self._names)

    def block(self, name: str, tensor_rank: int) -> ParameterState:
        """Tensor rank `tensor_rank`'s block of entry `name`, as this checkpoint's layout splits it: read-only,
        often a view of a memory-mapped file (copy it to modify it or to save it on its own)."""
        return self._moments.with_moments(name, tensor_rank, self._files.block(name, tensor_rank))

    def state(self, name: str) -> ParameterState:
        """Entry `name`, whole: the tensor ranks' blocks joined (read-only, like `block`)."""
        dim = self._dims[name]
        if dim is None or self.config.model_parallel_size == 1:
            return self.block(name, 0)
        blocks = [self.block(name, rank) for rank in range(self.config.model_parallel_size)]
        weight = torch.cat([block.weight for block in blocks], dim=dim)
        if not any(block.has_moments for block in blocks):
            return ParameterState(weight)
        moments = [torch.cat([getattr(block, key) if block.has_moments else torch.zeros_like(block.weight)
                              for block in blocks], dim=dim) for key in ("exp_avg", "exp_avg_sq")]
        return ParameterState(weight, *moments)


def checkpoint_directory(path: Path, tag: str | None = None) -> Path:
    """The global_stepN directory `path` is, or holds (`tag`, else the one its `latest` names)."""
    if not path.is_dir():
        raise CheckpointUnreadable(f"{path} is not a directory: pass a checkpoint directory (with `latest`) or "
                                   "one of its global_stepN directories")
    if tag is not None:
        if not (path / tag).is_dir():
            tags = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
            raise CheckpointUnreadable(f"{path} has no checkpoint {tag!r} (it has {tags or 'none'}); pass one "
                                       "of those, or leave the tag out for the one `latest` names")
        return path / tag
    try:
        tag_dir = tag_directory(path)
    except FileNotFoundError as error:
        raise CheckpointUnreadable(f"{error}; pass the tag of an existing checkpoint") from None
    if tag_dir is None:
        raise CheckpointUnreadable(f"{path} holds neither a `latest` file nor a checkpoint's model files; pass "
                                   "the checkpoint directory (the run's `save`) or one of its global_stepN")
    return tag_dir


def read_checkpoint(tag_dir: Path) -> SourceCheckpoint:
    """The checkpoint in `tag_dir`, as its config.json describes it, without verifying its files."""
    config_file = Path(tag_dir) / "config.json"
    if not config_file.is_file():
        raise CheckpointUnreadable(f"{tag_dir} has no config.json, which says what model and layout it holds; "
                                   "copy it from the run that saved the checkpoint")
    return SourceCheckpoint(Path(tag_dir), Config.from_json(config_file.read_text(encoding="utf-8")))


def open_checkpoint(path: str | Path, tag: str | None = None) -> SourceCheckpoint:
    """The checkpoint `path` is (a global_stepN directory) or holds (its `latest`, or `tag`), after checking
    every file against its manifest; reading never modifies it."""
    tag_dir = checkpoint_directory(Path(path), tag)
    verify_checkpoint(tag_dir)
    return read_checkpoint(tag_dir)


def verify_checkpoint(tag_dir: Path) -> None:
    """Raise CheckpointUnreadable unless every file of `tag_dir` matches its manifest (which it reads whole:
    the grow tool runs this beside its own reading and writing)."""
    problems = checkpoint_problems(tag_dir)
    if problems:
        raise CheckpointUnreadable(f"{tag_dir} cannot be read: " + "; ".join(problems)
                                   + ". Restore the damaged files from a copy")
