"""work_dir/NAME/lineage.json: what a stage was started from, so that a later run cannot continue it from other
settings without saying so.

The stage file (stage_file.py) pins a stage's own keys only; the shared config files are read afresh by every
launch, so an edit to them between two runs of the driver would change a started stage unnoticed. The lineage
pins the whole resolved config (less the directories the driver gives each stage), the growth mode and the
checkpoint the stage grew from (`stage@tag`). It is written before the stage's first step and compared before
every step, and by each step job of a SLURM chain, which re-reads the plan. Keys that say where and how a run
runs, not what it trains (launcher, logging, when to stop and how often to save), are recorded but not compared.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

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


def current_lineage(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> dict[str, Any]:
    """The stage's lineage as the plan and its config files give it now."""
    config = resolved[stage.index].config
    previous = plan.previous(stage)
    grown_from = f"{previous.name}@{source_tag(resolved[previous.index].config)}" if previous else None
    settings = {key: value for key, value in config.to_dict().items() if key not in DRIVER_KEYS}
    return {"grown_from": grown_from, "growth_mode": config.growth_mode if previous else None,
            "config": json.loads(json.dumps(settings, sort_keys=True))}


def recorded_lineage(plan: Plan, stage: Stage) -> dict[str, Any] | None:
    """The lineage written when the stage was started; None if there is none (a stage not started, or started
    by a driver before lineages were written)."""
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
    content = {"plan": str(plan.path), "stage": stage.name, "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
               **current_lineage(plan, resolved, stage)}
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")
    temporary.replace(path)
    return path


def lineage_changes(plan: Plan, resolved: list[ResolvedStage], stage: Stage) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, value now) for everything the stage's lineage pins that differs now; [] if none
    or nothing was recorded. A config key is named as config.KEY."""
    recorded = recorded_lineage(plan, stage)
    if recorded is None:
        return []
    now = current_lineage(plan, resolved, stage)
    changes = [(key, recorded.get(key), now[key]) for key in ("grown_from", "growth_mode")
               if recorded.get(key) != now[key]]
    before, after = recorded.get("config", {}), now["config"]
    # Keys of both only: one the schema gained or lost since is no edit of the plan's.
    changes += [(f"config.{key}", before[key], after[key]) for key in sorted(before.keys() & after.keys())
                if _pinned(key) and before[key] != after[key]]
    return changes


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """'config.weight_decay: recorded 0.1, now 0.01; grown_from: ...'."""
    return "; ".join(f"{key}: recorded {before!r}, now {after!r}" for key, before, after in changes)
