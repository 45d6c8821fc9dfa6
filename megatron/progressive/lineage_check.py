"""Holding stages to their lineage (lineage.py): refuse a changed stage, or redo it when asked.

Before a run or a submission, a stage that has started (it has a committed checkpoint, usable or not) and
whose lineage changed is refused, naming each key with its recorded and its new value; with --redo-changed it
is redone instead, with every stage after it (each grew from the one before): their directories are moved to
work_dir/replaced/, so the redone stage is grown, scored and trained anew (its metrics start empty, so its
grown model is re-scored). A started stage whose lineage does not pin it (no lineage.json, or one naming its
source by tag only) is refused too, unless --adopt-unpinned pins it as the plan gives it now (said so) or
--redo-changed redoes it; a started stage is never pinned anew otherwise. Stages not started yet are pinned as
the plan gives them now, and a grown stage again just before its growth, with the source's content. Before each
step, and in each job of a SLURM chain (step jobs, and training jobs before they train: `--step check`), the
stages must still resolve to their lineage: a config file edited meanwhile stops the plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from megatron.progressive.lineage import (
    current_lineage,
    defaulted_keys,
    describe_changes,
    lineage_changes,
    lineage_path,
    pin_grown_sources,
    record_lineage,
    recorded_lineage,
    unpinned_reason,
)
from megatron.progressive.plan import Plan, Stage
from megatron.progressive.progress import has_checkpoints_of
from megatron.progressive.stage_config import ResolvedStage
from megatron.progressive.stage_file import prepare_stage_files, write_job_file

REDO_FLAG = "--redo-changed"
ADOPT_FLAG = "--adopt-unpinned"
CHECK = "check"  # the driver's --step that only checks the lineage (a SLURM chain's training jobs run it)
REPLACED = "replaced"


def _started(plan: Plan, stage: Stage) -> bool:
    return has_checkpoints_of(plan, stage)


def _stages_after(plan: Plan, stage: Stage) -> list[Stage]:
    """The stages after `stage` that have a directory: each grew from the one before."""
    return [later for later in plan.stages[stage.index + 1:] if plan.directory(later).exists()]


def _grown_from(plan: Plan, stage: Stage) -> str:
    after = _stages_after(plan, stage)
    return f" and the stage(s) grown from it ({', '.join(s.name for s in after)})" if after else ""


def _redo_advice(plan: Plan, stage: Stage) -> str:
    if plan.online:
        return (f"move {plan.work_dir} aside to run the plan again ({REDO_FLAG} cannot redo part of an online plan, "
                "whose stages are one job)")
    return (f"run again with {REDO_FLAG} to redo it{_grown_from(plan, stage)}: their directories are moved to "
            f"{plan.work_dir / REPLACED}/")


def _refusal(plan: Plan, stage: Stage, changes: list) -> str:
    return (f"{stage.where()} was started from other settings than the plan and its config files give now "
            f"({lineage_path(plan, stage)}): {describe_changes(changes, defaulted_keys(plan, stage))}. Restore them to "
            f"continue the stage, or {_redo_advice(plan, stage)}")


def _unpinned_refusal(plan: Plan, stage: Stage, reason: str) -> str:
    redo = _redo_advice(plan, stage) if plan.online else (
        f"with {REDO_FLAG} to redo it{_grown_from(plan, stage)} (their directories are moved to "
        f"{plan.work_dir / REPLACED}/)")
    return (f"{stage.where()} has started but is not pinned: {reason}, so nothing shows it was started from the "
            f"plan as it is now. Run again with {ADOPT_FLAG} to pin it as the plan gives it now, or {redo}")


def _move_aside(plan: Plan, stage: Stage) -> Path:
    destination = plan.work_dir / REPLACED / f"{stage.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    destination.parent.mkdir(parents=True, exist_ok=True)
    plan.directory(stage).rename(destination)
    return destination


def _unpinned_started(plan: Plan) -> list[tuple[Stage, str]]:
    """(stage, why) for every started stage its lineage does not pin, in plan order."""
    return [(stage, reason) for stage in plan.stages
            if _started(plan, stage) and (reason := unpinned_reason(plan, stage))]


def _changed_started(plan: Plan, resolved: list[ResolvedStage]) -> list[tuple[Stage, list]]:
    """(stage, its changes) for every started stage whose lineage changed, in plan order."""
    return [(stage, changes) for stage in plan.stages
            if _started(plan, stage) and (changes := lineage_changes(plan, resolved, stage))]


def changed_stage_lines(plan: Plan, resolved: list[ResolvedStage]) -> list[str]:
    """What --status and --dry-run say of started stages not pinned or whose lineage changed: one line each."""
    return [*(f"{stage.name}: started but not pinned: {reason} (a run refuses; {ADOPT_FLAG} pins it as the plan "
              f"gives it now, {REDO_FLAG} redoes it and the stages after it)"
              for stage, reason in _unpinned_started(plan)),
            *(f"{stage.name}: changed since it was pinned: {describe_changes(changes, defaulted_keys(plan, stage))} "
              f"(a run refuses; {REDO_FLAG} "
              "redoes it and the stages after it)" for stage, changes in _changed_started(plan, resolved))]


def _redo(plan: Plan, stages: list[Stage]) -> list[str]:
    """Move the directories of `stages` aside; one line each."""
    said = []
    for stage in stages:
        said.append(f"{stage.name}: redone from scratch; its earlier directory is now {_move_aside(plan, stage)}")
    return said


def _adopt(plan: Plan, resolved: list[ResolvedStage], stage: Stage, reason: str) -> str:
    """Pin a started stage as the plan gives it now; what was done, in one line."""
    record_lineage(plan, resolved, stage)
    return f"{stage.name}: pinned as the plan and its config files give it now ({ADOPT_FLAG}); {reason}"


def _adoptable(plan: Plan, resolved: list[ResolvedStage]) -> list[tuple[Stage, str]]:
    """(stage, why) for every started stage its lineage does not pin, which --adopt-unpinned pins; PlanError for
    a grown one whose source checkpoint is gone (nothing would pin it by content)."""
    unpinned = _unpinned_started(plan)
    for stage, _ in unpinned:
        if plan.previous(stage) is not None and not current_lineage(plan, resolved, stage)["source_sha256"]:
            raise plan.error(f"{stage.where()} cannot be pinned: the checkpoint it grew from is not in "
                             f"{plan.checkpoints(plan.previous(stage))}; run with {REDO_FLAG} to redo it")
    return unpinned


def _first_refusal(plan: Plan, resolved: list[ResolvedStage], adopted: set[str]) -> tuple[Stage, str] | None:
    """The first started stage, in plan order, that its lineage does not pin or whose lineage changed, and why;
    the stages named in `adopted` are pinned as the plan gives them now, so neither."""
    for stage in filter(partial(_started, plan), plan.stages):
        if stage.name in adopted:
            continue
        reason = unpinned_reason(plan, stage)
        if reason:
            return stage, _unpinned_refusal(plan, stage, reason)
        changes = lineage_changes(plan, resolved, stage)
        if changes:
            return stage, _refusal(plan, stage, changes)
    return None


@dataclass(frozen=True)
class Verdict:
    """What a run does with the started stages before anything else: pin `adopted`, redo `redone` (the first
    stage refused, and the stages after it that have a directory)."""

    adopted: list[tuple[Stage, str]]
    redone: list[Stage]


def verdict(plan: Plan, resolved: list[ResolvedStage], redo: bool, adopt: bool) -> Verdict:
    """The run's verdict on the started stages, doing nothing: PlanError where it refuses. The run acts on it and
    --dry-run shows it, so both refuse alike."""
    adopted = _adoptable(plan, resolved) if adopt else []
    refusal = _first_refusal(plan, resolved, {stage.name for stage, _ in adopted})
    if refusal is None:
        return Verdict(adopted, [])
    stage, why = refusal
    if not redo or plan.online:
        raise plan.error(why)
    return Verdict(adopted, [stage, *_stages_after(plan, stage)])


def refuse_or_redo(plan: Plan, resolved: list[ResolvedStage], redo: bool, adopt: bool = False) -> list[str]:
    """Act on the verdict: with `adopt`, pin every started stage its lineage does not pin as the plan gives it
    now; with `redo`, move the first refused stage's directory and those of the stages after it aside. PlanError,
    before anything is done, where the run refuses. What was done, one line each."""
    decided = verdict(plan, resolved, redo, adopt)
    said = [_adopt(plan, resolved, stage, reason) for stage, reason in decided.adopted]
    return said + _redo(plan, decided.redone)


def prepare_stages(plan: Plan, resolved: list[ResolvedStage], redo: bool = False, adopt: bool = False) -> list[str]:
    """Before anything runs: refuse (or redo, or adopt) started stages that are not pinned or whose lineage
    changed, write every stage file, pin the stages not started yet. What was done, one line each."""
    said = [f"{stage.name}: pinned to the checkpoint the job grew it from"
            for stage in (pin_grown_sources(plan) if plan.online else ())]
    said += refuse_or_redo(plan, resolved, redo, adopt)
    if plan.online:
        write_job_file(plan, resolved)
    else:
        prepare_stage_files(plan)
    for stage in plan.stages:
        if not _started(plan, stage):
            record_lineage(plan, resolved, stage)
    return said


def check_unchanged(plan: Plan, resolved: list[ResolvedStage], stages: list[Stage] | tuple[Stage, ...]) -> None:
    """PlanError if any of `stages` has no recorded lineage (prepare_stages pinned every stage) or no longer
    resolves to it (`resolved` read afresh)."""
    for stage in stages:
        if recorded_lineage(plan, stage) is None:
            raise plan.error(f"{stage.where()} is not pinned: {lineage_path(plan, stage)} is gone; run "
                             "tools/progressive_scaling.py again to pin the plan")
        changes = lineage_changes(plan, resolved, stage)
        if changes:
            raise plan.error(f"{stage.where()}: the plan or its config files changed since the stage was pinned "
                             f"({lineage_path(plan, stage)}): {describe_changes(changes, defaulted_keys(plan, stage))}. "
                             f"Restore them, or run "
                             f"tools/progressive_scaling.py again (with {REDO_FLAG} to redo a stage that has started)")
