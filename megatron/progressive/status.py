"""--status: one line per stage, from the work_dir (how far each stage got, its losses, the growth check) and,
for a SLURM chain, the state of each stage's newest jobs (an online plan's one job on its last stage's line); then
any started stage whose pinned lineage changed."""

from __future__ import annotations

from megatron.progressive.lineage_check import changed_stage_lines
from megatron.progressive.plan import Plan
from megatron.progressive.progress import (
    checkpoint_iteration,
    final_is_published,
    growth_validation,
    last_validation,
    stage_iteration,
)
from megatron.progressive.slurm import job_state, submitted_jobs
from megatron.progressive.stage_config import ResolvedStage


def _progress(plan: Plan, resolved: list[ResolvedStage], entry: ResolvedStage) -> str:
    stage, total = entry.stage, entry.config.train_iters
    iteration = stage_iteration(plan, resolved, stage)
    if iteration is None:
        return "not grown yet" if stage.index else "not started"
    state = "done" if iteration >= total else ("grown, not trained yet" if iteration == 0 else "training")
    text = f"{state}: iteration {iteration}/{total}"
    if not plan.online and iteration != checkpoint_iteration(plan.checkpoints(stage)):
        text += f" (its final checkpoint deleted after {plan.stages[stage.index + 1].name} grew from it)"
    loss = last_validation(plan, stage)
    if loss is not None and iteration:
        text += f", last validation loss {loss:.4f}"
    grown = growth_validation(plan, stage)
    if grown is not None:
        before = last_validation(plan, plan.previous(stage))
        text += f", after growth {grown:.4f}" + (f" ({plan.previous(stage).name} ended {before:.4f})"
                                                  if before is not None else "")
    return text


def _jobs(plan: Plan, stage_name: str, records: list[dict]) -> str:
    newest: dict[str, dict] = {}
    for record in records:
        if record["stage"] == stage_name:
            newest[record["step"]] = record
    return ", ".join(f"{step} job {record['job']} {job_state(record['job']) or 'state unknown'}"
                     for step, record in newest.items())


def status_lines(plan: Plan, resolved: list[ResolvedStage]) -> list[str]:
    records = submitted_jobs(plan)
    width = max(len(entry.stage.name) for entry in resolved)
    lines = []
    for entry in resolved:
        jobs = _jobs(plan, entry.stage.name, records)
        progress = _progress(plan, resolved, entry)
        lines.append(f"{entry.stage.name:<{width}}  {progress}" + (f" | {jobs}" if jobs else ""))
    final = f"{plan.final} -> {plan.final.resolve()}" if final_is_published(plan) else "not published yet"
    lines.append(f"{'final':<{width}}  {final}")
    return lines + changed_stage_lines(plan, resolved)
