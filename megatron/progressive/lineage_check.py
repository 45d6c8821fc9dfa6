"""Holding stages to their lineage (lineage.py): refuse a changed stage, or redo it when asked.

Before a run or a submission, a stage that has started (it has a checkpoint) and whose lineage changed is
refused, naming each key with its recorded and its new value; with --redo-changed it is redone instead, with
every stage after it (each grew from the one before): their directories are moved to work_dir/replaced/, so
the redone stage is grown, scored and trained anew (its metrics start empty, so its grown model is re-scored).
Stages not started yet are pinned as the plan gives them now. Before each step, and in each job of a SLURM
chain (step jobs, and training jobs before they train: `--step check`), the stages must still resolve to their
lineage: a config file edited meanwhile stops the plan.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron.progressive.lineage import describe_changes, lineage_changes, lineage_path, record_lineage
from megatron.progressive.plan import Plan, Stage
from megatron.progressive.progress import checkpoint_iteration
from megatron.progressive.stage_config import ResolvedStage
from megatron.progressive.stage_file import prepare_stage_files

REDO_FLAG = "--redo-changed"
CHECK = "check"  # the driver's --step that only checks the lineage (a SLURM chain's training jobs run it)
REPLACED = "replaced"


def _started(plan: Plan, stage: Stage) -> bool:
    return checkpoint_iteration(plan.checkpoints(stage)) is not None


def _refusal(plan: Plan, stage: Stage, changes: list, after: list[Stage]) -> str:
    also = f" and the stage(s) grown from it ({', '.join(s.name for s in after)})" if after else ""
    return (f"{stage.where()} was started from other settings than the plan and its config files give now "
            f"({lineage_path(plan, stage)}): {describe_changes(changes)}. Restore them to continue the stage, or run "
            f"again with {REDO_FLAG} to redo it{also}: their directories are moved to {plan.work_dir / REPLACED}/")


def _move_aside(plan: Plan, stage: Stage) -> Path:
    destination = plan.work_dir / REPLACED / f"{stage.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    destination.parent.mkdir(parents=True, exist_ok=True)
    plan.directory(stage).rename(destination)
    return destination


def _changed_started(plan: Plan, resolved: list[ResolvedStage]) -> list[tuple[Stage, list]]:
    """(stage, its changes) for every started stage whose lineage changed, in plan order."""
    return [(stage, changes) for stage in plan.stages
            if _started(plan, stage) and (changes := lineage_changes(plan, resolved, stage))]


def changed_stage_lines(plan: Plan, resolved: list[ResolvedStage]) -> list[str]:
    """What --status and --dry-run say of started stages whose lineage changed: one line each."""
    return [f"{stage.name}: changed since it was pinned: {describe_changes(changes)} (a run refuses; {REDO_FLAG} "
            "redoes it and the stages after it)" for stage, changes in _changed_started(plan, resolved)]


def refuse_or_redo(plan: Plan, resolved: list[ResolvedStage], redo: bool) -> list[tuple[Stage, Path]]:
    """PlanError for the first started stage whose lineage changed; with `redo`, that stage's directory and those
    of the stages after it moved aside instead: (stage, where it went) for each."""
    changed = _changed_started(plan, resolved)
    if not changed:
        return []
    stage, changes = changed[0]
    after = [later for later in plan.stages[stage.index + 1:] if plan.directory(later).exists()]
    if not redo:
        raise plan.error(_refusal(plan, stage, changes, after))
    return [(moved, _move_aside(plan, moved)) for moved in (stage, *after)]


def prepare_stages(plan: Plan, resolved: list[ResolvedStage], redo: bool = False) -> list[tuple[Stage, Path]]:
    """Before anything runs: refuse (or redo) changed started stages, write every stage file, pin the stages
    not started yet. The stages redone, and where their old directories went."""
    moved = refuse_or_redo(plan, resolved, redo)
    prepare_stage_files(plan)
    for stage in plan.stages:
        if not _started(plan, stage):
            record_lineage(plan, resolved, stage)
    return moved


def check_unchanged(plan: Plan, resolved: list[ResolvedStage], stages: list[Stage] | tuple[Stage, ...]) -> None:
    """PlanError if any of `stages` no longer resolves to its recorded lineage (`resolved` read afresh)."""
    for stage in stages:
        changes = lineage_changes(plan, resolved, stage)
        if changes:
            raise plan.error(f"{stage.where()}: the plan or its config files changed since the stage was pinned "
                             f"({lineage_path(plan, stage)}): {describe_changes(changes)}. Restore them, or run "
                             f"tools/progressive_scaling.py again (with {REDO_FLAG} to redo a stage that has started)")
