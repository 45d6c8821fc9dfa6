"""What a training run continues from a grown checkpoint: the growth record it carries, the tokens it freezes.

The record is the one of the checkpoint the run resumes from (`load`); when `load` has no checkpoint and
`pretrain_partial_init` grows a smaller one at the start instead, it is made from that checkpoint's
config.json slot counts. With `freeze_old_param_tokens` every Pattention's first grown_from[slot key] tokens
stay fixed (model/frozen_tokens.py), and only the tokens growth appended learn; embeddings and norms train
as usual.

A frozen run's optimizer holds state for the trainable rows only, so its checkpoints record what was frozen
(checkpoint/growth_record.py). A checkpoint the grow tool wrote keeps its optimizer state per whole parameter
(formats/deepspeed/portable.py): it fits any freeze, and the rows a frozen run trains keep their fp32 masters, Adam's
moments and step (formats/deepspeed/engine_state.py), as with pretrain_partial_init. When a DeepSpeed checkpoint's
optimizer state was saved with another freeze, only its weights are loaded: Adam's moments restart at zero,
and where the run keeps fp32 master weights (bf16) they restart from the loaded bf16 weights, losing what the
masters held beyond bf16.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megatron.checkpoint.growth_record import FORMAT, old_token_count, read_growth_record
from megatron.checkpoint.work_split import is_rank_0
from megatron.config import ConfigError
from megatron.formats.deepspeed.files import tag_directory
from megatron.formats.deepspeed.portable import is_portable
from megatron.model.frozen_tokens import freeze_leading_tokens
from megatron.model.pattention import Pattention
from megatron.model.spec import pattention_of_module, slot_keys

PRECISION_DTYPES = {"fp32": torch.float32, "bfloat16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunGrowth:
    """`record`: the growth record the run continues (None: never grown). `frozen`: the leading tokens per
    slot key that stay fixed (None: all train). `optimizer_state_fits`: the optimizer state of the checkpoint
    resumed from `load`, if any, gives the state of the tokens this run trains (it was saved with the same freeze,
    or in the grow tool's portable form)."""

    record: dict | None = None
    frozen: dict[str, int] | None = None
    optimizer_state_fits: bool = True

    def grown_here(self, norms: dict[str, int]) -> RunGrowth:
        """This run's growth when it grew its start in memory (pretrain_partial_init) at iteration 0, with the n of
        √n the grown model holds (where norm_token_count_ramp_iters starts)."""
        if self.record is None:
            return self
        return dataclasses.replace(self, record={**self.record, "norm_token_count": norms, "iteration": 0})

    def record_to_save(self) -> dict | None:
        """The record for this run's checkpoints: the one it continues, with this run's freeze."""
        if self.record is None:
            return None
        record = {key: value for key, value in self.record.items() if key != "frozen"}
        return {**record, "frozen": self.frozen} if self.frozen else record


def _partial_init_record(source: str | None) -> dict | None:
    """A record for a run that grows `source` (pretrain_partial_init) in memory: its saved slot counts."""
    tag_dir = tag_directory(Path(source)) if source and Path(source).is_dir() else None
    if tag_dir is None or not (tag_dir / "config.json").is_file():
        return None
    saved = json.loads((tag_dir / "config.json").read_text(encoding="utf-8"))
    return {"format": FORMAT, "grown_from": {key: saved[key] for key in slot_keys()}}


def _frozen_counts(cfg, record: dict, where: str) -> dict[str, int]:
    frozen = {key: old_token_count(record, key) for key in slot_keys()}
    larger = [f"{key} {frozen[key]} > {getattr(cfg, key)}" for key in slot_keys() if frozen[key] > getattr(cfg, key)]
    if larger:
        raise ConfigError(f"freeze_old_param_tokens: the growth record of {where} counts more tokens before "
                          f"growth than this model has ({', '.join(larger)}); set the slot counts of the grown "
                          "checkpoint's config.json")
    if all(frozen[key] == getattr(cfg, key) for key in slot_keys()):
        raise ConfigError(f"freeze_old_param_tokens: nothing would train: {where} was grown from "
                          f"{frozen}, which is every token this model has; grow the checkpoint first "
                          "(tools/grow_checkpoint.py) or set freeze_old_param_tokens: false")
    return frozen


def run_growth(cfg, tag: str | None) -> RunGrowth:
    """The growth this run continues, resuming checkpoint `tag` of `cfg.load` (None: none, a fresh start or
    pretrain_partial_init); ConfigError when freeze_old_param_tokens cannot apply."""
    load = Path(cfg.load) if cfg.load else None
    if tag is not None:
        record, where = read_growth_record(load / tag), f"load = {load / tag}"
    else:
        source = cfg.pretrain_partial_init
        record, where = _partial_init_record(source), f"pretrain_partial_init = {source}"
    if not cfg.freeze_old_param_tokens:
        frozen = None
    elif record is None:
        raise ConfigError(
            "freeze_old_param_tokens needs a grown checkpoint in `load` (its growth.json, written by the grow "
            f"tool) or in `pretrain_partial_init`; load = {cfg.load!r} "
            f"({'resumes ' + tag + ', which was not grown' if tag else 'has no checkpoint'}), "
            f"pretrain_partial_init = {cfg.pretrain_partial_init!r}. Point one of them at a grown checkpoint, or "
            "set freeze_old_param_tokens: false")
    else:
        frozen = _frozen_counts(cfg, record, where)
    resumed_frozen = (record or {}).get("frozen")
    fits = tag is None or resumed_frozen == frozen or is_portable(load / tag)
    if not fits and is_rank_0():
        print(f"warning: {where} was saved with frozen tokens {resumed_frozen}, this run freezes {frozen}: "
              "loading its weights only; Adam's moments restart at zero", flush=True)
    return RunGrowth(record, frozen, fits)


def restart_fp32_masters(engine) -> None:
    """After loading a checkpoint's weights without its optimizer state: DeepSpeed's ZeRO optimizers then
    copy their fp32 master weights from the loaded ones, but its bf16/fp16 optimizers without ZeRO keep the
    masters they were built with, which their first step would write back over the loaded weights."""
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()


def _slot_key(module_name: str) -> str:
    spec = pattention_of_module(module_name)
    if spec is None:
        raise ValueError(f"Pattention {module_name!r} is not declared in megatron/model/spec.py")
    return spec.slot_key


def freeze_old_param_tokens(model: nn.Module, frozen: dict[str, int], precision: str) -> None:
    """Freeze each Pattention's first frozen[slot key] tokens in `model` (a TokenFormerModel or a pipeline
    stage), in the run's `precision` (cfg.precision), before its optimizer is built."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Pattention):
            freeze_leading_tokens(module, frozen[_slot_key(name)], PRECISION_DTYPES[precision])
