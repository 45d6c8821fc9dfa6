"""Where a plan stands, read from its work_dir alone, so that re-running the same command continues it.

A stage's checkpoints directory says it all. No usable checkpoint: the stage has not started (for a grown
stage, its growth is missing or was interrupted, and is redone). The newest checkpoint's iteration: how far
training got. A grown stage whose newest checkpoint is its growth (global_step0) and whose metrics hold no
validation at iteration 0: not scored yet. Nothing else is recorded, so the state cannot disagree with the
checkpoints, whoever wrote them (this driver, a SLURM job, a person). One exception: a stage whose final
checkpoint was deleted after the next stage grew from it is done (lineage.superseded: the next stage's
checkpoints carry that checkpoint's digest), so deleting a finished predecessor retrains nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from megatron.checkpoint.commit import CHECKPOINT_TAG, committed_tags
from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import newest_usable_tag
from megatron.progressive.lineage import superseded
from megatron.progressive.plan import Plan, Stage
from megatron.progressive.stage_config import ResolvedStage

GROW, EVALUATE, TRAIN, FINISH = "grow", "evaluate", "train", "finish"


@dataclass(frozen=True)
class Step:
    """One step of the plan: grow a stage from the one before, score the grown checkpoint, train a stage, or
    publish work_dir/final (on the last stage)."""

    kind: str
    stage: Stage


def check_layout(plan: Plan) -> None:
    """PlanError if work_dir holds the other way of running the plan: a chain's stage checkpoints for --online, or
    an online job for a chain (each would start afresh beside the other's progress)."""
    if plan.online:
        chained = [stage.name for stage in plan.stages if (plan.directory(stage) / "checkpoints").exists()]
        if chained:
            raise plan.error(f"work_dir {plan.work_dir} holds the checkpoints of a chain of jobs "
                             f"({', '.join(chained)}): continue it without --online, or give the online run another "
                             "work_dir")
    elif plan.job_directory.exists():
        raise plan.error(f"work_dir {plan.work_dir} holds an online job ({plan.job_directory}): continue it with "
                         "--online, or give the chain another work_dir")


def has_checkpoints(directory: Path) -> bool:
    """Whether `directory` holds a committed checkpoint (global_stepN), usable or not: a stage that has one has
    started, even where every one is damaged."""
    return bool(committed_tags(directory))


def checkpoint_iteration(directory: Path) -> int | None:
    """The iteration of the newest usable checkpoint in `directory` (judged by file names and sizes, as
    deepy.py does), None if there is none."""
    try:
        tag, _ = newest_usable_tag(str(directory))
    except CheckpointRefused:
        return None
    return None if tag is None else int(CHECKPOINT_TAG.match(tag).group(1))


def has_checkpoints_of(plan: Plan, stage: Stage) -> bool:
    """Whether `stage` has started: it has a committed checkpoint, usable or not. Online, one of the job's after
    the stage before's end (the checkpoint at that end holds the model before the growth, and a resume of it
    grows again)."""
    tags = committed_tags(plan.checkpoints(stage))
    if not plan.online:
        return bool(tags)
    return any(iteration >= plan.iterations(stage).start for iteration, _ in tags)


def validation_losses(plan: Plan, stage: Stage) -> dict[int, float]:
    """Iteration -> validation loss of the stage's metrics (a repeated iteration, from a resumed run: the last);
    online, the job's within the stage's iterations."""
    path = plan.logs(stage) / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    losses = {record["iteration"]: record["lm_loss"] for record in records if record.get("split") == "valid"}
    if plan.online:
        return {iteration: loss for iteration, loss in losses.items() if iteration in plan.iterations(stage)}
    return losses


def last_validation(plan: Plan, stage: Stage) -> float | None:
    losses = validation_losses(plan, stage)
    return losses[max(losses)] if losses else None


def growth_validation(plan: Plan, stage: Stage) -> float | None:
    """The grown checkpoint's validation loss, before any training of the stage (a chain's evaluate step)."""
    return validation_losses(plan, stage).get(0) if stage.index and not plan.online else None


def final_is_published(plan: Plan) -> bool:
    last = plan.checkpoints(plan.stages[-1])
    return plan.final.is_symlink() and plan.final.resolve() == last.resolve()


def publish_final(plan: Plan) -> Path:
    """Point work_dir/final at the last stage's checkpoints (a relative symlink, replaced atomically)."""
    if plan.final.exists() and not plan.final.is_symlink():
        raise plan.error(f"{plan.final} exists and is not a symlink; move it away (the driver points it at the "
                         "last stage's checkpoints)")
    temporary = plan.work_dir / ".final.tmp"
    temporary.unlink(missing_ok=True)
    os.symlink(plan.checkpoints(plan.stages[-1]).relative_to(plan.work_dir), temporary)
    os.replace(temporary, plan.final)
    return plan.final


def retract_stale_final(plan: Plan, steps: list[Step]) -> None:
    """Remove work_dir/final while stages remain to be done: it names the plan's finished last stage only."""
    if plan.final.is_symlink() and any(step.kind != FINISH for step in steps):
        plan.final.unlink()


def _started_after_incomplete(plan: Plan, stage: Stage, incomplete: Stage) -> str:
    return (f"{stage.where()} has checkpoints in {plan.checkpoints(stage)} but stage {incomplete.name!r} before it "
            "is not complete, so they were not grown from its final checkpoint: remove that directory (and those "
            "of the stages after it) to redo them")


def stage_iteration(plan: Plan, resolved: list[ResolvedStage], stage: Stage,
                    redone: Collection[str] = ()) -> int | None:
    """How far `stage` got: its newest usable checkpoint's iteration; its train_iters (done) where its final
    checkpoint was deleted after the next stage grew from it; None where it has not started. The stages named in
    `redone` count as not started. The one judge of a stage's progress, for the run and --status alike."""
    if stage.name in redone:
        return None
    if plan.online:
        reached = checkpoint_iteration(plan.checkpoints(stage))
        started = reached is not None and reached >= plan.iterations(stage).start
        return min(reached, plan.end(stage)) if started else None
    following = plan.stages[stage.index + 1] if stage.index + 1 < len(plan.stages) else None
    if following is not None and following.name not in redone and superseded(plan, resolved, stage):
        return resolved[stage.index].config.train_iters
    return checkpoint_iteration(plan.checkpoints(stage))


def pending_steps(plan: Plan, resolved: list[ResolvedStage], redone: Collection[str] = ()) -> list[Step]:
    """The steps still to do, in order; [] when the plan is complete and work_dir/final published. The stages
    named in `redone` count as not started (what a redo would leave of them). Online: one training step, the
    job's, named by the first stage it has not finished, then the finish."""
    if plan.online:
        steps = []
        for entry in resolved:
            iteration = stage_iteration(plan, resolved, entry.stage)
            if iteration is None or iteration < entry.config.train_iters:
                steps.append(Step(TRAIN, entry.stage))
                break
        return steps + ([Step(FINISH, plan.stages[-1])] if steps or not final_is_published(plan) else [])
    steps: list[Step] = []
    incomplete: Stage | None = None
    for entry in resolved:
        stage = entry.stage
        iteration = stage_iteration(plan, resolved, stage, redone)
        if incomplete is not None and iteration is not None:
            raise plan.error(_started_after_incomplete(plan, stage, incomplete))
        if stage.index and iteration is None:
            steps += [Step(GROW, stage), Step(EVALUATE, stage)]
        elif stage.index and iteration == 0 and growth_validation(plan, stage) is None:
            steps.append(Step(EVALUATE, stage))
        if iteration is None or iteration < entry.config.train_iters:
            steps.append(Step(TRAIN, stage))
            incomplete = incomplete or stage
    if steps or redone or not final_is_published(plan):
        steps.append(Step(FINISH, plan.stages[-1]))
    return steps
