"""What deepy.py and tools/grow_checkpoint.py say of a growth before it happens, without refusing it.

- The growth mode, where a growth is to happen and neither the config nor the tool's flag chose one: the default
  did, and the modes grow different models (docs/growth.md), so a user who counted on the other one is told.
- norm_token_count_ramp_iters that cannot do what it says: a ramp that ends after train_iters (n of √n never
  reaches the token count), or one after a growth that already normalises by the token count (nothing to ramp).
- pretrain_partial_init_reset_optimizer: true beside growth_optimizer: carry in a run that grows nothing: harmless
  here, but the grow tool and pretrain_partial_init refuse the contradiction, so a later stage would.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from megatron.checkpoint.growth_record import GrowthRecordError, read_growth_record
from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import newest_usable_tag
from megatron.config import Config, ConfigError
from megatron.formats.consolidated import CONFIG_NAME, read_config
from megatron.formats.deepspeed.files import tag_directory
from megatron.growth.plan import OPTIMIZER_CONTRADICTION, GrowthPlan, plan_growth
from megatron.model.args import GROWTH_MODES
from megatron.model.spec import slot_keys

WHAT_MODES_DO = {"official": "new keys and values from the init and √n of the new token count, as the official code "
                             "grows (the grown model computes another function)",
                 "preserve": "zero new keys and the old √n (the grown model computes the same function)"}


def default_mode_note(plan: GrowthPlan, given: Collection[str]) -> str | None:
    """One line when `plan` grows in a growth mode no one chose (`given`: the keys the user set, growth_mode
    included where a flag gave it); None otherwise."""
    if not plan.grows or "growth_mode" in given:
        return None
    other = next(mode for mode in GROWTH_MODES if mode != plan.mode)
    return (f"growth_mode {plan.mode}, the default (no config file sets growth_mode): {WHAT_MODES_DO[plan.mode]}; "
            f"set growth_mode: {other} for {WHAT_MODES_DO[other].split(' (')[0]} (docs/growth.md)")


def _resumed_tag_dir(cfg: Config) -> Path | None:
    try:
        tag, _ = newest_usable_tag(cfg.load)
    except CheckpointRefused:
        return None  # preflight names it
    return None if tag is None else Path(cfg.load) / tag


def partial_init_plan(cfg: Config) -> GrowthPlan | None:
    """The growth pretrain_partial_init makes at the start of this run (none where `load` holds a checkpoint, which
    the run resumes instead); None also where its source cannot be read or planned (the run refuses it)."""
    if not cfg.pretrain_partial_init or _resumed_tag_dir(cfg) is not None:
        return None
    try:
        tag_dir = tag_directory(Path(cfg.pretrain_partial_init))
        return None if tag_dir is None else plan_growth(read_config(tag_dir / CONFIG_NAME), cfg)
    except (OSError, ValueError, ConfigError):
        return None


def _ramp_notes(cfg: Config, settled: bool, first: int) -> list[str]:
    """`settled`: the grown model already normalises by its token counts; `first`: the iteration the ramp starts."""
    length = cfg.norm_token_count_ramp_iters
    if settled:
        return [f"norm_token_count_ramp_iters {length} has nothing to ramp: the grown model already normalises by its "
                "token count (official growth, or growth_norm_token_count new); set it to 0, or grow with "
                "growth_norm_token_count: old (preserve's) to start from the source's n"]
    if first + length <= cfg.train_iters:
        return []
    return [f"norm_token_count_ramp_iters {length} ramps n of √n from iteration {first} to {first + length}, past "
            f"train_iters {cfg.train_iters}: n never reaches the token counts; set it to {cfg.train_iters - first} "
            "or fewer to reach them"]


def _ramp_start(cfg: Config, plan: GrowthPlan | None) -> tuple[bool, int] | None:
    """Whether the grown model already normalises by its token counts, and the iteration this run's ramp starts
    at; None where it has no ramp, or one preflight refuses."""
    if not cfg.norm_token_count_ramp_iters:
        return None
    if plan is not None:  # pretrain_partial_init grows at iteration 0
        return plan.grows and plan.norm == "new", 0
    tag_dir = _resumed_tag_dir(cfg) if cfg.load else None
    try:
        record = None if tag_dir is None else read_growth_record(tag_dir)
    except GrowthRecordError:
        return None
    if record is None or "norm_token_count" not in record or "iteration" not in record:
        return None
    settled = all(record["norm_token_count"].get(key) == getattr(cfg, key) for key in slot_keys())
    return settled, record["iteration"]


def launch_notes(cfg: Config, given: Collection[str]) -> list[str]:
    """What deepy.py says of the growth a training run makes or continues (`given`: the keys its config files and
    overrides set)."""
    plan = partial_init_plan(cfg)
    notes = [note for note in [default_mode_note(plan, given) if plan else None] if note]
    start = _ramp_start(cfg, plan)
    if start is not None:
        notes += _ramp_notes(cfg, *start)
    if (cfg.pretrain_partial_init_reset_optimizer and cfg.growth_optimizer == "carry"
            and not cfg.pretrain_partial_init):
        notes.append(f"{OPTIMIZER_CONTRADICTION}. No effect in this run, which grows nothing (no "
                     "pretrain_partial_init); tools/grow_checkpoint.py and pretrain_partial_init refuse this config")
    return notes
