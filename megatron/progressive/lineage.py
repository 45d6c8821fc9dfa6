"""work_dir/NAME/lineage.json: what a stage was started from, so that a later run cannot continue it from other
settings without saying so.

The stage file (stage_file.py) pins a stage's own keys only; the shared config files are read afresh by every
launch, so an edit to them between two runs of the driver would change a started stage unnoticed. The lineage
pins the whole resolved config (less the directories the driver gives each stage), the growth mode and the
checkpoint the stage grew from, by name (`stage@tag`) and by content (`source_sha256`, the checkpoint's
content_digest: a predecessor retrained by hand under the same tag is another source). It is written before the
stage's first step, again before its growth (when the source exists), and compared before every step, and by
each step job of a SLURM chain, which re-reads the plan. Keys that say where and how a run runs, not what it
trains (launcher, logging, when to stop and how often to save), are recorded but not compared.

The grow tool pins the same digest inside the grown checkpoint (its growth record), so a source deleted once its
successor grew (to save space) changes nothing: the source is compared while it exists, and after that the
digest the stage's own checkpoints carry stands for it. A changed value the plan does not set itself is a changed
default of this version, and is named as one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megatron.checkpoint.commit import committed_tags
from megatron.checkpoint.growth_record import GrowthRecordError, read_growth_record
from megatron.checkpoint.manifest import content_digest
from megatron.config.loader import keys_set
from megatron.config.schema import SCHEMA
from megatron.progressive.commands import source_tag
from megatron.progressive.plan import DRIVER_KEYS, Plan, Stage
from megatron.progressive.stage_config import ResolvedStage

LINEAGE_FILE = "lineage.json"
UNPINNED_GROUPS = ("launcher", "logging", "inference")
UNPINNED_KEYS = {"world_size", "exit_interval", "exit_duration_in_mins", "exit_signal_handler", "exit_signals",
                 "adlr_autoresume", "checkpoint_factor", "extra_save_iters", "keep_last_n_checkpoints",
                 "checkpoint_validation_with_forward_pass"}


def lineage_path(plan: Plan, stage: Stage) -> Path:
    return plan.directory(stage) / LINEAGE_FILE


def _pinned(key: str) -> bool:
    return key not in UNPINNED_KEYS and (key not in SCHEMA or SCHEMA[key].group not in UNPINNED_GROUPS)


def _pinned_in_checkpoints(plan: Plan, stage: Stage) -> str | None:
    """The source digest the newest of the stage's checkpoints that has one carries in its growth record (online,
    of the job's checkpoints after the stage before's end, up to the stage's own)."""
    tags = [tag_dir for iteration, tag_dir in committed_tags(plan.checkpoints(stage))
            if not plan.online or iteration in plan.iterations(stage)]
    for tag_dir in tags:
        try:
            digest = (read_growth_record(tag_dir) or {}).get("source_sha256")
        except GrowthRecordError:
            continue
        if digest:
            return digest
    return None


def _source_sha256(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> str | None:
    """The content digest of the checkpoint `stage` grows from: the checkpoint's while it exists, else the one
    the stage's own checkpoints carry (the source deleted after the growth); None before either exists (or for
    the first stage)."""
    previous = plan.previous(stage)
    if previous is None:
        return None
    source = plan.checkpoints(previous) / source_tag(resolved[previous.index].config)
    try:
        return content_digest(source) if source.is_dir() else _pinned_in_checkpoints(plan, stage)
    except ValueError as error:
        raise plan.error(f"{previous.where()}: {error}; the stage grown from it cannot be pinned to it") from None


def superseded(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> bool:
    """Whether `stage` is done though its final checkpoint is gone: the stage after it grew from that checkpoint
    (the digest its lineage pinned is the one its own checkpoints carry), and the checkpoint was deleted since."""
    following = plan.stages[stage.index + 1] if stage.index + 1 < len(plan.stages) else None
    if following is None or (plan.checkpoints(stage) / source_tag(resolved[stage.index].config)).is_dir():
        return False
    pinned = (recorded_lineage(plan, following) or {}).get("source_sha256")
    return bool(pinned) and pinned == _pinned_in_checkpoints(plan, following)


def current_lineage(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> dict[str, Any]:
    """The stage's lineage as the plan, its config files and the source checkpoint give it now."""
    config = resolved[stage.index].config
    previous = plan.previous(stage)
    grown_from = f"{previous.name}@{source_tag(resolved[previous.index].config)}" if previous else None
    settings = {key: value for key, value in config.to_dict().items() if key not in DRIVER_KEYS}
    return {"grown_from": grown_from, "source_sha256": _source_sha256(plan, resolved, stage),
            "growth_mode": config.growth_mode if previous else None,
            "config": json.loads(json.dumps(settings, sort_keys=True))}


def recorded_lineage(plan: Plan, stage: Stage) -> dict[str, Any] | None:
    """The lineage written when the stage was started; None if there is none (a stage not started, or started
    by a driver that wrote none)."""
    path = lineage_path(plan, stage)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise plan.error(f"{stage.where()}: {path} cannot be read ({error}); remove it to pin the stage anew from "
                         "the plan as it is now") from None


def record_lineage(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> Path:
    path = lineage_path(plan, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, {"plan": str(plan.path), "stage": stage.name, "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
                  **current_lineage(plan, resolved, stage)})
    return path


def _write(path: Path, content: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")
    temporary.replace(path)


def pin_grown_sources(plan: Plan) -> list[Stage]:
    """Online: give the lineage of each stage the job grew into since it was pinned the digest of the checkpoint
    it grew from, as the grown checkpoints' growth record names it (a chain pins it just before the growth, which
    an online job makes inside itself). The stages pinned so."""
    pinned = []
    for stage in plan.stages[1:]:
        recorded = recorded_lineage(plan, stage)
        digest = _pinned_in_checkpoints(plan, stage) if recorded and not recorded.get("source_sha256") else None
        if digest:
            _write(lineage_path(plan, stage), {**recorded, "source_sha256": digest})
            pinned.append(stage)
    return pinned


def unpinned_reason(plan: Plan, stage: Stage) -> str | None:
    """Why a started stage's lineage does not pin it (no file, or its source by name only); None if it does."""
    recorded = recorded_lineage(plan, stage)
    if recorded is None:
        return f"it has no {lineage_path(plan, stage)} (started by an older driver, or the file deleted)"
    if plan.previous(stage) is not None and not recorded.get("source_sha256"):
        return (f"its {lineage_path(plan, stage)} names the checkpoint it grew from by tag only, not by content "
                "(written by an older driver)")
    return None


def lineage_changes(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, value now) for everything the stage's lineage pins that differs now; [] if none
    or nothing was recorded. A config key is named as config.KEY. The source's content is compared where both
    are known (a stage pinned before its source existed records none; a source deleted, with no digest in the
    stage's checkpoints, has none now)."""
    recorded = recorded_lineage(plan, stage)
    if recorded is None:
        return []
    now = current_lineage(plan, resolved, stage)
    compared = recorded.get("source_sha256") and now["source_sha256"]
    pinned = ("grown_from", "growth_mode", *(("source_sha256",) if compared else ()))
    changes = [(key, recorded.get(key), now[key]) for key in pinned if recorded.get(key) != now[key]]
    before, after = recorded.get("config", {}), now["config"]
    # Keys of both only: one the schema gained or lost since is no edit of the plan's.
    changes += [(f"config.{key}", before[key], after[key]) for key in sorted(before.keys() & after.keys())
                if _pinned(key) and before[key] != after[key]]
    return changes


def defaulted_keys(plan: Plan, stage: Stage) -> set[str]:
    """The config keys neither the plan's config files nor the stage set: the schema's defaults give them."""
    return set(SCHEMA) - keys_set(plan.configs) - set(stage.settings)


def describe_changes(changes: list[tuple[str, Any, Any]], defaulted: set[str] = frozenset()) -> str:
    """'config.weight_decay: recorded 0.1, now 0.01; grown_from: ...'; a key in `defaulted` (defaulted_keys) is
    said to be a changed default, with the setting that keeps the recorded value."""
    def described(key: str, before: Any, after: Any) -> str:
        name = key.removeprefix("config.")
        text = f"{key}: recorded {before!r}, now {after!r}"
        if name not in defaulted:
            return text
        return (f"{text} (no config file of the plan and not the stage sets {name}: its default changed since the "
                f"stage started; set {name}: {json.dumps(before)} in the plan to continue as started)")
    return "; ".join(described(*change) for change in changes)
