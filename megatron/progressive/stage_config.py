"""Every stage's config, resolved as deepy.py resolves it, and the rules between consecutive stages.

A stage's config is the plan's configs merged with the stage's keys and the directories the driver gives it
(the stage file). It must pass what deepy.py checks before it starts any process (megatron/launch/resolve.py)
with the processes the stage will have: this machine's (or its hostfile's) for a local run; for a SLURM job,
whose allocation does not exist yet, num_nodes × num_gpus, the allocation the driver asks for (and the device
check, fp16 needing a GPU, is left to the job's own deepy.py). Between stages only the parameter-token counts
and the parallel layout may change, as tools/grow_checkpoint.py requires (megatron/growth/plan.py: the same
check, run here on the configs before any checkpoint exists), and the counts must not shrink. Each stage
starts its own learning-rate schedule at iteration 0, so a decay length inherited from the shared configs
that is not the stage's length is refused: it would train the stage at min_lr, or never decay. So are
freezing and a √n ramp in the first stage, which is not grown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from megatron.config import Config, ConfigError, load_config
from megatron.growth.plan import GrowthPlan, plan_growth
from megatron.launch.resolve import resolve_run
from megatron.launch.resources import Slots
from megatron.model.spec import slot_keys
from megatron.progressive.plan import Plan, Stage


@dataclass(frozen=True)
class ResolvedStage:
    """A stage with its validated config; `growth` is how it grows from the stage before (None for the first)."""

    stage: Stage
    config: Config
    growth: GrowthPlan | None
    steps: int  # the iterations it trains: its train_iters in a chain; online, those after the stage before's end

    @property
    def processes(self) -> int:
        return self.config.world_size

    @property
    def slots(self) -> str:
        return "/".join(str(getattr(self.config, key)) for key in slot_keys())


def allocation(cfg: Config) -> tuple[int, int]:
    """(nodes, tasks per node) a SLURM job of this config asks for: num_nodes (1 when unset) × num_gpus."""
    return max(cfg.num_nodes, 1), cfg.num_gpus or 1


def _allocation_slots(cfg: Config) -> Slots:
    nodes, per_node = allocation(cfg)
    return {f"node{index}": list(range(per_node)) for index in range(nodes)}


def _resolve(plan: Plan, settings: dict[str, Any], slurm: bool, subject: str, keys: str) -> Config:
    """The plan's configs merged with `settings` (the stage file's keys, as key=value overrides: JSON is YAML),
    as a training launch resolves them; PlanError naming the config (`subject`, e.g. "stage 's1': its") if
    they are refused."""
    overrides = [f"{key}={json.dumps(value)}" for key, value in settings.items()]
    try:
        slots = _allocation_slots(load_config(plan.configs, overrides)) if slurm else None
        return resolve_run(plan.configs, overrides, "train.py", slots=slots, device="cuda" if slurm else None)[0]
    except ConfigError as error:
        files = " + ".join(str(path) for path in plan.configs)
        raise plan.error(f"{subject} config ({files} + {keys}) is refused, as deepy.py would refuse it: "
                         f"{error}") from None


def resolve_stage(plan: Plan, stage: Stage, slurm: bool) -> Config:
    """The stage's config as its training launch resolves it; PlanError naming the stage if it is refused."""
    return _resolve(plan, plan.stage_settings(stage), slurm, f"{stage.where()}: its", "the stage's keys")


def job_settings(plan: Plan, resolved: list[ResolvedStage]) -> dict[str, Any]:
    """An online plan's job file: the last stage's keys at the first stage's parameter-token counts, growing at
    each stage's end to the next stage's counts."""
    first, last = resolved[0].config, resolved[-1]
    schedule = [{"iteration": plan.end(before.stage), **{key: getattr(after.config, key) for key in slot_keys()}}
                for before, after in zip(resolved, resolved[1:])]
    return {**plan.stage_settings(last.stage), **{key: getattr(first, key) for key in slot_keys()},
            "growth_schedule": schedule}


def _schedule_problem(plan: Plan, stage: Stage, cfg: Config) -> str | None:
    if plan.online:
        return _online_schedule_problem(plan, stage, cfg)
    if "lr_decay_iters" in stage.settings or cfg.lr_decay_iters == cfg.train_iters:
        return None
    return (f"{stage.where()}: key 'lr_decay_iters' is {cfg.lr_decay_iters} (from the shared configs) but the "
            f"stage trains train_iters {cfg.train_iters}: every stage runs its own warmup and decay from iteration "
            f"0, so set lr_decay_iters: {cfg.train_iters} in the stage (or drop lr_decay_iters from the shared "
            "configs: it then follows each stage's train_iters)")


def _online_schedule_problem(plan: Plan, stage: Stage, cfg: Config) -> str | None:
    last = plan.end(plan.stages[-1])
    if stage.index or "lr_decay_iters" in stage.settings or cfg.lr_decay_iters == last:
        return None
    return (f"{stage.where()}: key 'lr_decay_iters' is {cfg.lr_decay_iters} (from the shared configs) but the online "
            f"job trains until iteration {last}, on one warmup and decay: set lr_decay_iters: {last} in the first "
            "stage, or drop lr_decay_iters from the shared configs (it then follows the job's length)")


def _shrink_problem(plan: Plan, stage: Stage, source: Config, target: Config) -> str | None:
    previous = plan.previous(stage)
    for key in slot_keys():
        old, new = getattr(source, key), getattr(target, key)
        if new < old:
            return (f"{stage.where()}: key {key!r} is {new}, fewer parameter tokens than stage {previous.name!r}'s "
                    f"{old}: each stage grows the one before and never shrinks it; set {key}: {old} or more")
    return None


def _growth(plan: Plan, stage: Stage, source: Config, target: Config) -> GrowthPlan:
    problem = _shrink_problem(plan, stage, source, target)
    if problem:
        raise plan.error(problem)
    previous = plan.previous(stage)
    try:
        growth = plan_growth(source, target)
    except ConfigError as error:
        raise plan.error(f"{stage.where()} cannot be grown from stage {previous.name!r} by "
                         f"tools/grow_checkpoint.py: {error}") from None
    if plan.online and growth.old_tokens == growth.new_tokens:
        raise plan.error(f"{stage.where()} has the parameter-token counts of stage {previous.name!r}, so the online "
                         f"job would not grow at its start: give it more tokens, or merge it into {previous.name!r} "
                         f"(set {previous.name}'s train_iters to {plan.end(stage)})")
    return growth


def resolve_plan(plan: Plan, slurm: bool = False) -> list[ResolvedStage]:
    """Every stage resolved and checked against the one before, in order; PlanError for the first problem."""
    resolved: list[ResolvedStage] = []
    for stage in plan.stages:
        cfg = resolve_stage(plan, stage, slurm)
        problem = _schedule_problem(plan, stage, cfg)
        if problem:
            raise plan.error(problem)
        if not resolved and cfg.freeze_old_param_tokens:
            raise plan.error(f"{stage.where()}: key 'freeze_old_param_tokens': the first stage trains from scratch "
                             "and has no old tokens to freeze; set it in the stages that are grown")
        if not resolved and cfg.norm_token_count_ramp_iters:
            raise plan.error(f"{stage.where()}: key 'norm_token_count_ramp_iters': the first stage trains from "
                             "scratch and is not grown, so it has no n of √n to ramp from; set it in the stages that "
                             "are grown")
        growth = _growth(plan, stage, resolved[-1].config, cfg) if resolved else None
        steps = cfg.train_iters - (plan.start(stage) if plan.online else 0)
        resolved.append(ResolvedStage(stage, cfg, growth, steps))
    if plan.online:
        _resolve(plan, job_settings(plan, resolved), slurm, "the online job's", "the job file's keys")
    return resolved
