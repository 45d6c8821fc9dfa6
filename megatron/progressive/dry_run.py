"""--dry-run: what a plan would do, without doing any of it: every stage's size, compute and schedule, then the
commands of the steps still to do (all of them for a plan that has not started)."""

from __future__ import annotations

from megatron.progressive.commands import SCORE_FIRST, grow_command, shown, train_command
from megatron.progressive.costs import flops, layout, schedule, stage_cost
from megatron.progressive.plan import Plan
from megatron.progressive.progress import EVALUATE, FINISH, GROW, TRAIN, Step
from megatron.progressive.slurm import describe_chain
from megatron.progressive.stage_config import ResolvedStage


def stage_table(resolved: list[ResolvedStage]) -> list[str]:
    """A markdown table, one row per stage, and the plan's total training compute."""
    rows = ["| stage | parameter tokens qkv/proj/ffn | parameters (Pattention) | Pattention share of FLOPs | "
            "training FLOPs/token | steps × tokens | training compute | schedule | processes |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    costs = [stage_cost(entry.config, entry.steps) for entry in resolved]
    for entry, cost in zip(resolved, costs):
        cfg = entry.config
        rows.append(f"| {entry.stage.name} | {entry.slots} | {cost.parameters / 1e6:.2f}M "
                    f"({cost.pattention_parameters / 1e6:.2f}M) | {cost.pattention_share:.0%} | "
                    f"{cost.flops_per_token / 1e6:,.1f}M | {cost.steps:,} × {cost.tokens_per_step:,} | "
                    f"{flops(cost.training_flops)} | {schedule(cfg)} | {layout(cfg)} |")
    tokens = sum(cost.steps * cost.tokens_per_step for cost in costs)
    return [*rows, "", f"Total training compute {flops(sum(cost.training_flops for cost in costs))} "
            f"({tokens:,} tokens); the last stage's model trained on as many tokens from scratch: "
            f"{flops(costs[-1].flops_per_token * tokens)}."]


def _local_command(plan: Plan, by_name: dict[str, ResolvedStage], step: Step, scored: bool) -> str:
    """The step's command; `scored`: a training launch that scores the grown model first."""
    stage = step.stage
    if step.kind == GROW:
        previous = by_name[plan.previous(stage).name].config
        return shown(grow_command(plan, stage, previous))
    if step.kind == EVALUATE:
        return f"in the training launch below ({SCORE_FIRST})"
    if step.kind == FINISH:
        return shown(["ln", "-sfn", str(plan.checkpoints(stage).relative_to(plan.work_dir)), str(plan.final)])
    return shown(train_command(plan, stage, *([SCORE_FIRST] if scored else [])))


def step_commands(plan: Plan, resolved: list[ResolvedStage], steps: list[Step], slurm: bool,
                  sbatch_options: list[str]) -> list[str]:
    if slurm:
        return describe_chain(plan, resolved, steps, sbatch_options)
    by_name = {entry.stage.name: entry for entry in resolved}
    return [f"{_step_name(plan, resolved, step)}: "
            f"{_local_command(plan, by_name, step, scored=before == Step(EVALUATE, step.stage))}"
            for before, step in zip([None, *steps], steps)]


def _step_name(plan: Plan, resolved: list[ResolvedStage], step: Step) -> str:
    """'s2 grow'; online, the job's training with where it grows, e.g. 'job train (grows into s2 at 4, s3 at 8)'."""
    if not plan.online or step.kind != TRAIN:
        return f"{step.stage.name} {step.kind}"
    growths = [f"{entry.stage.name} at {plan.start(entry.stage)} ({entry.slots})" for entry in resolved[1:]]
    return f"job train (from {step.stage.name}; grows into {', '.join(growths)})"
