"""A resume on another data-parallel size keeps the checkpoint's global batch (docs/cluster.md, "When your
allocation changes"): train_iters, the learning-rate schedule and the data position (consumed samples) count
global batches, so the run continues as if its allocation had not changed.

gradient_accumulation_steps is recomputed so that train_batch_size stays the checkpoint's; where no whole number
of micro batches fits, the resume is refused with the sizes that would. A train_batch_size the config files or
overrides set themselves is honoured instead (changed_settings.py warns of the change).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import newest_usable_tag
from megatron.config import Config, ConfigError
from megatron.config.run_inputs import INFERENCE_SCRIPTS
from megatron.formats.deepspeed.compatibility import holds_weights_only


def _resumed_config(cfg: Config) -> tuple[Path, dict] | None:
    """The checkpoint a training run resumes and its config.json; None for a fresh start, an evaluation, weights
    alone, or a checkpoint the preflight refuses (it names why)."""
    if not cfg.load or cfg.eval_only or Path(cfg.user_script or "train.py").name in INFERENCE_SCRIPTS:
        return None
    try:
        tag, _ = newest_usable_tag(cfg.load)
    except CheckpointRefused:
        return None
    tag_dir = None if tag is None else Path(cfg.load) / tag
    if tag_dir is None or not (tag_dir / "config.json").is_file() or holds_weights_only(tag_dir):
        return None
    return tag_dir, json.loads((tag_dir / "config.json").read_text(encoding="utf-8"))


def _data_parallel(values: dict) -> int | None:
    world = values.get("world_size")
    if not isinstance(world, int):
        return None
    return world // (values.get("model_parallel_size", 1) * max(1, values.get("pipe_parallel_size", 0)))


def _divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def kept_batch_override(cfg: Config, given: Collection[str]) -> str | None:
    """The gradient_accumulation_steps override that keeps the resumed checkpoint's train_batch_size on this
    run's data-parallel size (and micro batch); None where it is kept already or the config sets
    train_batch_size (`given`: the keys the files and overrides set). Asked on every resume, not only where the
    data-parallel size changed: the run after one that changed it comes back with the config's
    gradient_accumulation_steps. ConfigError where no whole number fits, naming the sizes that would."""
    resumed = _resumed_config(cfg)
    if resumed is None or "train_batch_size" in given:
        return None
    tag_dir, saved = resumed
    batch, now = saved.get("train_batch_size"), _data_parallel(cfg.to_dict())
    if not isinstance(batch, int) or batch == cfg.train_batch_size:
        return None
    micro = cfg.train_micro_batch_size_per_gpu
    if batch % (micro * now) == 0:
        return f"gradient_accumulation_steps={batch // (micro * now)}"
    model = cfg.model_parallel_size * max(1, cfg.pipe_parallel_size)
    sizes = _divisors(batch // micro) if batch % micro == 0 else []
    micros = _divisors(batch // now) if batch % now == 0 else []
    raise ConfigError(
        f"load: {tag_dir} was trained with a global batch of {batch} sequences (train_batch_size), which {now} "
        f"data-parallel ranks of train_micro_batch_size_per_gpu {micro} cannot make in whole micro batches: "
        f"resume on a data-parallel size in {sizes} ({[d * model for d in sizes]} processes at TP × PP = {model})"
        f"{f', or set train_micro_batch_size_per_gpu to one of {micros}' if micros else ''}, or set "
        "train_batch_size to change the global batch")


def kept_batch_note(cfg: Config) -> str | None:
    """The line saying that gradient_accumulation_steps differs from the checkpoint's, which keeps its global
    batch; None where it does not."""
    resumed = _resumed_config(cfg)
    if resumed is None:
        return None
    tag_dir, saved = resumed
    before, now = _data_parallel(saved), _data_parallel(cfg.to_dict())
    accumulation = saved.get("gradient_accumulation_steps")
    if saved.get("train_batch_size") != cfg.train_batch_size or accumulation == cfg.gradient_accumulation_steps:
        return None
    return (f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} (saved {accumulation}): {tag_dir} was "
            f"trained on {before} data-parallel ranks, this run has {now}; its global batch of "
            f"{cfg.train_batch_size} sequences is kept")
