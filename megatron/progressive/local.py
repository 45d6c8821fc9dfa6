"""Running a plan on this machine: the pending steps (progress.py) one after the other.

One driver per work_dir at a time (a lock like a run's save directory). Before a stage trains, the driver waits
for an earlier run of it that is still stopping (a driver killed mid-stage stops its ranks, which save first)
to let go of the stage's save directory. A grown stage's first training launch scores the grown model before its
first step (eval_at_start: no launch of its own), and the driver then prints the growth check: with
growth_mode preserve the grown model's validation loss is the previous stage's last. Before each step the stage
is resolved afresh and held to its lineage (lineage_check.py): a config file edited while the plan runs stops it.
Just before a growth the stage is pinned again, now with the content of the checkpoint it grows from.
"""

from __future__ import annotations

import shutil
import sys
import time

from megatron.checkpoint.save_lock import SaveDirectoryInUse, check_save_directory_free, hold_save_directory
from megatron.progressive.commands import SCORE_FIRST, grow_command, source_tag, train_command
from megatron.progressive.lineage import pin_grown_sources, record_lineage
from megatron.progressive.lineage_check import CHECK, check_unchanged, prepare_stages
from megatron.progressive.plan import Plan, Stage
from megatron.progressive.processes import run_step
from megatron.progressive.progress import (
    EVALUATE,
    FINISH,
    GROW,
    TRAIN,
    Step,
    checkpoint_iteration,
    growth_validation,
    has_checkpoints,
    last_validation,
    pending_steps,
    publish_final,
    retract_stale_final,
)
from megatron.progressive.stage_config import ResolvedStage, resolve_plan

SAVE_DIRECTORY_WAIT_SECONDS = 300
RELATIVE_TOLERANCE = 1e-5  # growth_mode preserve: the grown model's loss is the source's up to rounding


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def hold_work_dir(plan: Plan) -> None:
    """Keep other drivers off this work_dir for as long as this process lives."""
    try:
        hold_save_directory(plan.work_dir, " ".join(sys.argv))
    except SaveDirectoryInUse as error:
        raise plan.error(f"work_dir {plan.work_dir} is in use by another driver: {error}") from None


def wait_for_save_directory(plan: Plan, stage: Stage) -> None:
    """Wait until no earlier run holds the stage's save directory (one being stopped saves a checkpoint first)."""
    deadline, announced = time.monotonic() + SAVE_DIRECTORY_WAIT_SECONDS, False
    while True:
        try:
            check_save_directory_free(plan.checkpoints(stage))
            return
        except SaveDirectoryInUse as error:
            if time.monotonic() > deadline:
                raise plan.error(f"{stage.where()}: {error}") from None
            if not announced:
                _say(f"{stage.name}: waiting for an earlier run of the stage to stop: {error}")
                announced = True
            time.sleep(1)


def clear_incomplete_growth(plan: Plan, stage: Stage) -> None:
    """A grown stage without any committed checkpoint holds at most an interrupted growth: remove it. One whose
    committed checkpoints all fail to load is refused: it has started, and they are not the driver's to delete."""
    directory = plan.checkpoints(stage)
    if has_checkpoints(directory) and checkpoint_iteration(directory) is None:
        raise plan.error(f"{stage.where()} has checkpoints in {directory} but none can be used (missing or truncated "
                         "files); restore them, or move the directory aside to grow the stage anew")
    if directory.exists():
        _say(f"{stage.name}: removing the incomplete growth in {directory}")
        shutil.rmtree(directory)


def growth_check(plan: Plan, resolved: ResolvedStage) -> str:
    """'s2 grown: validation loss X, s1 ended at Y (...)'."""
    stage = resolved.stage
    previous = plan.previous(stage)
    before, after = last_validation(plan, previous), growth_validation(plan, stage)
    if before is None or after is None:
        return f"{stage.name} grown (no validation loss to compare: eval_iters 0 or no validation split)"
    line = (f"{stage.name} grown from {previous.name}: validation loss {after:.6f}, {previous.name} ended at "
            f"{before:.6f} (difference {after - before:+.2e})")
    if resolved.growth.keeps_function and abs(after - before) > RELATIVE_TOLERANCE * abs(before):
        line += "; WARNING: growth_mode preserve should keep the loss"
    return line


def _run(plan: Plan, resolved_stages: list[ResolvedStage], step: Step, echo: bool) -> None:
    stage, resolved = step.stage, resolved_stages[step.stage.index]
    log = plan.directory(stage) / f"{step.kind}.log"
    if step.kind == GROW:
        previous = resolved_stages[plan.previous(stage).index].config
        _say(f"{stage.name}: grow {plan.previous(stage).name}'s {source_tag(previous)} "
             f"({', '.join(resolved.growth.summary())}; growth mode {resolved.growth.describe()}); log: {log}")
        clear_incomplete_growth(plan, stage)
        record_lineage(plan, resolved_stages, stage)  # pinned to the source's content before anything is grown
        run_step(f"{stage.name} grow", grow_command(plan, stage, previous), log, echo)
    elif step.kind == EVALUATE:  # always followed by the stage's training, whose launch scores it first
        _say(f"{stage.name}: the grown checkpoint is scored at the start of its training launch")
    elif step.kind == TRAIN:
        _train(plan, resolved_stages, step.stage, echo)
    elif step.kind == FINISH:
        for grown in pin_grown_sources(plan) if plan.online else ():
            _say(f"{grown.name}: pinned to the checkpoint the job grew it from")
        _say(f"plan complete: {publish_final(plan)} -> {plan.checkpoints(stage)}")


def _train(plan: Plan, resolved_stages: list[ResolvedStage], stage: Stage, echo: bool) -> None:
    """Train `stage`; online, the job from where it stands to the last stage's end, growing at each stage's."""
    target = resolved_stages[-1] if plan.online else resolved_stages[stage.index]
    name, directory = ("job", plan.job_directory) if plan.online else (stage.name, plan.directory(stage))
    start, end = checkpoint_iteration(plan.checkpoints(stage)) or 0, target.config.train_iters
    score_first = not plan.online and stage.index > 0 and start == 0 and growth_validation(plan, stage) is None
    growths = [f"at {plan.start(entry.stage)} into {entry.stage.name}" for entry in resolved_stages[1:]
               if plan.start(entry.stage) >= start] if plan.online else []
    log = directory / f"{TRAIN}.log"
    _say(f"{name}: train iterations {start + 1}-{end}" + "".join(f", growing {growth}" for growth in growths)
         + f"; log: {log}")
    wait_for_save_directory(plan, stage)
    command = train_command(plan, stage, *([SCORE_FIRST] if score_first else []))
    seconds = run_step(f"{name} train", command, log, echo)
    reached = checkpoint_iteration(plan.checkpoints(stage))
    if reached is None or reached < end:
        where = "the online job" if plan.online else stage.where()
        raise plan.error(f"{where}: training stopped at iteration {reached} of {end} (exit_interval, "
                         "exit_duration_in_mins or a signal); run the same command again to continue")
    if score_first:
        _say(growth_check(plan, target))
    loss = last_validation(plan, target.stage)
    _say(f"{name}: trained in {seconds:.0f} s" + (f", last validation loss {loss:.4f}" if loss else ""))


def run_single_step(plan: Plan, resolved: list[ResolvedStage], kind: str, stage_name: str) -> None:
    """One grow or finish step, as a SLURM chain's step job runs it; done steps are skipped, and a step whose
    stage before is not complete is refused. CHECK only holds the plan to its pinned lineage: a chain's training
    job runs it before it trains."""
    by_name = {entry.stage.name: entry for entry in resolved}
    if stage_name not in by_name:
        raise plan.error(f"--stage {stage_name!r} is not a stage of the plan ({', '.join(by_name)})")
    stage = by_name[stage_name].stage
    if plan.online and kind == GROW:
        raise plan.error("--step grow is a step of a chain: an online plan's job grows inside itself")
    check_unchanged(plan, resolved, plan.stages)  # the job re-read the plan: it must be the one submitted
    if kind == CHECK:
        _say(f"{stage.name}: the plan and its config files are as pinned")
        return
    before = plan.previous(stage) if kind == GROW else stage
    if before is None:
        raise plan.error(f"{stage.where()} is the first stage: it is trained from scratch, not grown")
    reached = checkpoint_iteration(plan.checkpoints(before))
    if reached is None or reached < by_name[before.name].config.train_iters:
        raise plan.error(f"{before.where()} is not complete (iteration {reached} of "
                         f"{by_name[before.name].config.train_iters}); it must be before the {kind} step")
    if kind == GROW and checkpoint_iteration(plan.checkpoints(stage)) is not None:
        _say(f"{stage.name}: already grown ({plan.checkpoints(stage)} holds a checkpoint); nothing to do")
        return
    _run(plan, resolved, Step(kind, stage), echo=True)


def run_plan(plan: Plan, resolved: list[ResolvedStage], echo: bool = True, redo: bool = False,
             adopt: bool = False) -> None:
    """Do every pending step of `plan` here, in order (StepFailed, Interrupted or PlanError stop it); `redo`:
    redo a started stage whose lineage changed or does not pin it, and the stages after it, instead of refusing;
    `adopt`: pin a started stage its lineage does not pin as the plan gives it now."""
    hold_work_dir(plan)
    for line in prepare_stages(plan, resolved, redo, adopt):
        _say(line)
    steps = pending_steps(plan, resolved)
    if not steps:
        _say(f"nothing to do: the plan is complete ({plan.final} -> {plan.checkpoints(plan.stages[-1])})")
    retract_stale_final(plan, steps)
    for step in steps:
        check_unchanged(plan, resolve_plan(plan), [step.stage])
        _run(plan, resolved, step, echo)
