"""work_dir/NAME/stage.yml: a stage's own keys as a config file, merged after the plan's configs (online, one
file for the whole job: work_dir/job/job.yml).

Both deepy.py and tools/grow_checkpoint.py take config files, so the driver writes each stage's keys (and the
directories it gives the stage) into one. A stage that has started keeps the keys it started with: if the
plan now says otherwise, the driver refuses rather than resume a run under settings it was not begun with.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from megatron.progressive.plan import DRIVER_KEYS, Plan, Stage
from megatron.progressive.progress import has_checkpoints
from megatron.progressive.stage_config import ResolvedStage, job_settings

HEADER = "# Written by tools/progressive_scaling.py from {plan}, stage {name}; edit the plan, not this file.\n"
JOB_HEADER = ("# Written by tools/progressive_scaling.py --online from {plan}: every stage as one job, growing at each "
              "stage's end; edit the plan, not this file.\n")


def _own_keys(settings: dict) -> dict:
    return {key: value for key, value in settings.items() if key not in DRIVER_KEYS}


def _changed_keys(path: Path, settings: dict) -> list[str]:
    try:
        written = _own_keys(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (OSError, yaml.YAMLError):
        return ["(the file cannot be read)"]
    wanted = _own_keys(settings)
    return sorted(key for key in set(written) | set(wanted) if written.get(key) != wanted.get(key))


def check_started_stages_unchanged(plan: Plan) -> None:
    """PlanError if a stage that has checkpoints was started with other keys than the plan gives it now."""
    for stage in plan.stages:
        path = plan.stage_file(stage)
        if not path.is_file() or not has_checkpoints(plan.checkpoints(stage)):
            continue
        changed = _changed_keys(path, plan.stage_settings(stage))
        if changed:
            raise plan.error(f"{stage.where()}: key(s) {', '.join(changed)} differ from those the stage started "
                             f"with ({path}); restore them in the plan to continue it, or remove "
                             f"{plan.directory(stage)} (and the directories of the stages after it) to redo it")


def write_stage_file(plan: Plan, stage: Stage) -> Path:
    return _write(plan.stage_file(stage), HEADER.format(plan=plan.path, name=stage.name), plan.stage_settings(stage))


def write_job_file(plan: Plan, resolved: list[ResolvedStage]) -> Path:
    """An online plan's job file (stage_config.job_settings), written afresh before every launch: the lineage,
    checked first, holds the started stages to their settings."""
    return _write(plan.stage_file(plan.stages[-1]), JOB_HEADER.format(plan=plan.path), job_settings(plan, resolved))


def _write(path: Path, header: str, settings: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = header + yaml.safe_dump(settings, sort_keys=False)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)
    return path


def prepare_stage_files(plan: Plan) -> None:
    """Refuse changed settings of started stages, then write every stage's file (before any step runs)."""
    check_started_stages_unchanged(plan)
    for stage in plan.stages:
        write_stage_file(plan, stage)
