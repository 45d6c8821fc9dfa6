"""Write a checkpoint in a target config's tensor/pipeline layout from whole TokenFormerModel entries, the
way our Trainer resumes it (portable_restore.py) and `megatron.inference.load_model` reads it:

    with CheckpointWriter(save, "global_step300", config, iteration=300, consumed_train_samples=76800,
                          optimizer_step=300, growth_record=None) as writer:
        for name in names:                      # every entry once, in any order
            writer.write(name, state)           # ParameterState, whole (fp32)
        tag_dir = writer.commit()

Each entry is cut into the config's model_parallel_size contiguous blocks (tensor_parallel_layout.py) and
written as DeepSpeed writes it: with pipe_parallel_size 0 into mp_rank_XX_model_states.pt ('module', plus
iteration and consumed samples), else into the per-layer files of model/pipeline.py's numbering beside one
weightless mp_rank file per stage and tensor rank. Weights are fp32 (the masters: DeepSpeed casts them on
load). Adam's moments go to portable.py's layout-independent files, written as they come. A layer's files are
written as soon as their entries are complete, on background threads (background_writer.py: a few files at
once), so memory stays near a few of the largest files (a pipeline layer; the whole model with
pipe_parallel_size 0). Everything is written under a temporary name and published with its manifest (each
file hashed as it is written, not read back) and `latest` by checkpoint/commit.py; leaving the `with` block
without commit() (an error, here or in a writing thread) deletes it.
Works without a process group.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from functools import partial
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import deepspeed
import torch
from deepspeed.pipe import LayerSpec
from torch import Tensor

from megatron.checkpoint.background_writer import BackgroundWriter
from megatron.checkpoint.commit import commit, staging_directory
from megatron.checkpoint.growth_record import write_growth_record
from megatron.checkpoint.parameter_state import ParameterState, as_fp32
from megatron.config import Config
from megatron.formats.deepspeed.portable import moments_directory, moments_file, save_moments, write_marker
from megatron.formats.tensor_parallel import split_dimensions, split_state
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.pipeline import layer_specs, pipeline_place
from megatron.mpu import full_shape

_ALL = -1  # the file group of a model without a pipeline: one file per tensor rank holding everything


def _owning(tensor: Tensor) -> Tensor:
    """`tensor` if it is all of its storage, contiguous, else a compact copy (what torch.save should write)."""
    whole = (tensor.is_contiguous() and tensor.storage_offset() == 0
             and tensor.untyped_storage().nbytes() == tensor.nbytes)
    return tensor if whole else tensor.clone(memory_format=torch.contiguous_format)


class CheckpointWriter:
    """See the module docstring."""

    def __init__(self, save_dir: str | Path, tag: str, config: Config, *, iteration: int, consumed_train_samples: int,
                 optimizer_step: int | None, growth_record: dict | None) -> None:
        counts = {"iteration": iteration, "consumed_train_samples": consumed_train_samples,
                  "optimizer_step": 0 if optimizer_step is None else optimizer_step}
        wrong = [f"{what}={value!r}" for what, value in counts.items()
                 if isinstance(value, bool) or not isinstance(value, int) or value < 0]
        if wrong:
            raise ValueError(f"CheckpointWriter: {', '.join(wrong)}; these counts are non-negative integers")
        if config.padded_vocab_size is None:
            raise ValueError("CheckpointWriter: the target config has no padded_vocab_size; set it to the "
                             "embedding's row count (the source checkpoint's, padded for the target layout)")
        self.save_dir, self.tag, self.config = Path(save_dir), tag, config
        self.iteration, self.consumed_train_samples = iteration, consumed_train_samples
        self.optimizer_step, self.growth_record = optimizer_step, growth_record
        args = TokenFormerArgs.for_inference(config, config.padded_vocab_size)
        model = TokenFormerModel(args, device="meta")
        self._shapes = {name: full_shape(t) for name, t in chain(model.named_parameters(), model.named_buffers())}
        self._dims = split_dimensions(args)
        self._ranks, self._pipelined = config.model_parallel_size, config.pipe_parallel_size >= 1
        if self._pipelined:
            self._places = {name: pipeline_place(name, config.num_layers) for name in self._shapes}
            # DeepSpeed saves a file for every layer that is a module; the tied output layer is a function of
            # layer 0's module.
            groups = [i for i, spec in enumerate(layer_specs(args))
                      if isinstance(spec, LayerSpec) and getattr(spec, "forward_fn", None) is None]
        else:
            self._places, groups = {name: (_ALL, name) for name in self._shapes}, [_ALL]
        self._remaining = {group: {n for n, (g, _) in self._places.items() if g == group} for group in groups}
        self._pending = {group: [{} for _ in range(self._ranks)] for group in groups}
        self._written: set[str] = set()
        self._staging: Path | None = None
        self._files: BackgroundWriter | None = None
        self._committed = False

    def __enter__(self) -> CheckpointWriter:
        self._staging = staging_directory(self.save_dir, self.tag)
        shutil.rmtree(self._staging, ignore_errors=True)  # left by a write that was killed
        self._staging.mkdir(parents=True)
        if self.optimizer_step is not None:
            for rank in range(self._ranks):
                moments_directory(self._staging, rank).mkdir(parents=True)
        self._files = BackgroundWriter(self._staging)
        return self

    def __exit__(self, *exception: object) -> None:
        if self._files is not None:
            self._files.__exit__(*exception)  # no thread writes into the directory deleted next
        if not self._committed and self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    def _check(self, name: str, state: ParameterState) -> None:
        if self._staging is None or self._committed:
            raise RuntimeError("CheckpointWriter.write: use it inside `with CheckpointWriter(...) as writer`, "
                               "before commit()")
        if name not in self._shapes:
            raise ValueError(f"{name} is not an entry of the model the target config describes")
        if name in self._written:
            raise ValueError(f"{name} was already written; write each entry once")
        shapes = [tuple(t.shape) for t in state.tensors()]
        if set(shapes) != {self._shapes[name]}:
            raise ValueError(f"{name}: shapes {shapes} given, the target model's is {self._shapes[name]} (whole, "
                             "as with model_parallel_size 1)")
        if state.has_moments and self.optimizer_step is None:
            raise ValueError(f"{name} has Adam moments but the writer has no optimizer_step: pass the source's "
                             "step, or drop the moments (ParameterState.without_moments) to reset the optimizer")

    def _blocks(self, name: str, tensor: Tensor) -> list[Tensor]:
        """The tensor ranks' blocks of `tensor`, each its own storage (a view would save all of its base: a
        source file, or the whole tensor). A tensor that is its storage is not copied."""
        tensor = as_fp32(tensor.detach())
        if self._dims[name] is None or self._ranks == 1:
            return [_owning(tensor)] * self._ranks
        return [shard[name] for shard in split_state({name: tensor}, {name: self._dims[name]}, self._ranks)]

    def write(self, name: str, state: ParameterState) -> None:
        """Entry `name`'s whole state; its file is written (in the background) once its last entry arrives.
        The tensors are written as they are then, uncopied where they are their storage: do not modify them."""
        self._check(name, state)
        group, key = self._places[name]
        for rank, block in enumerate(self._blocks(name, state.weight)):
            self._pending[group][rank][key] = block
        if state.has_moments:
            moments = zip(self._blocks(name, state.exp_avg), self._blocks(name, state.exp_avg_sq), strict=True)
            for rank, (exp_avg, exp_avg_sq) in enumerate(moments):
                self._submit(moments_file(self._staging, rank, name).relative_to(self._staging),
                             partial(save_moments, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq))
        self._written.add(name)
        self._remaining[group].discard(name)
        if not self._remaining[group]:
            self._flush(group)

    def _header(self, module: dict | None) -> dict:
        """An mp_rank file as DeepSpeed's engine.load_checkpoint reads it, with our client state."""
        files = self._ranks * (self.config.pipe_parallel_size if self._pipelined else 1)
        return {"module": module, "optimizer": None, "lr_scheduler": None, "data_sampler": None,
                "random_ltd": None, "global_steps": self.iteration, "global_samples": self.consumed_train_samples,
                "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": files, "ds_version": deepspeed.__version__,
                "iteration": self.iteration, "consumed_train_samples": self.consumed_train_samples}

    def _flush(self, group: int) -> None:
        for rank, entries in enumerate(self._pending.pop(group)):
            if group == _ALL:
                self._save(self._header(entries), f"mp_rank_{rank:02d}_model_states.pt")
            else:
                self._save(entries, f"layer_{group:02d}-model_{rank:02d}-model_states.pt")

    def _submit(self, name: Path | str, write: Callable[[BinaryIO], None]) -> None:
        """Write staging file `name` in the background, hashed as it is written: commit() need not read it."""
        self._files.submit(str(name), write)

    def _save(self, state: dict, name: str) -> None:
        self._submit(name, partial(torch.save, state))

    def commit(self) -> Path:
        """Write what remains, then publish the checkpoint (manifest, rename, `latest`); its directory."""
        missing = sorted(set(self._shapes) - self._written)
        if self._staging is None or missing:
            raise ValueError(f"CheckpointWriter.commit: entries {missing[:5]} (of {len(missing)}) were not "
                             "written; write every entry of the target model inside the `with` block first")
        for group in list(self._pending):  # layers without entries (a nonparametric final norm)
            self._flush(group)
        if self._pipelined:
            for rank in range(self._ranks * self.config.pipe_parallel_size):
                self._save(self._header(None), f"mp_rank_{rank:02d}_model_states.pt")
        (self._staging / "config.json").write_text(self.config.to_json(), encoding="utf-8")
        if self.growth_record is not None:
            write_growth_record(self._staging, self.growth_record)
        write_marker(self._staging, self.optimizer_step)
        directory = commit(self.save_dir, self.tag, self._files.records())
        self._committed = True
        return directory
