"""The study's four runs, written as plans for tools/progressive_scaling.py's driver under WORK_DIR/plans/:

- progressive.yml: configs/plan.yml, S1 -> S2 -> S3 (its growth mode: preserve, the default);
- progressive_official.yml: the same path with growth_mode official in every grown stage (new keys and values
  from the init, the norm over the new token count, a fresh optimizer, as the official code grows); it starts
  from a copy of the first path's finished S1 (share_first_stage), so the two paths differ in growth alone;
- scratch.yml: S3 from scratch, one stage with S1's keys (seed, schedule: it reads S1's batches, then more) and
  S3's parameter tokens, SCRATCH_ITERS steps;
- control.yml: S1 trained longer, one stage with S1's keys for as many steps as give it the progressive path's
  total training compute (evaluated every as many steps as cost what an evaluation interval of S3 costs): the small
  model trained longer, which tells how much of the path's result is growth and how much is a small model being
  the more efficient one at this budget.

Every run's steps are multiplied by `scale` (the quick check: 0.05). The driver runs each plan; a plan it
finished before is not run again.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron.model.spec import slot_keys
from megatron.progressive.costs import stage_cost
from megatron.progressive.plan import Plan, read_plan
from megatron.progressive.progress import checkpoint_iteration
from megatron.progressive.stage_config import ResolvedStage, resolve_plan

CONFIGS = Path(__file__).resolve().parent / "configs"
TEMPLATE = CONFIGS / "plan.yml"
SCRATCH_ITERS = 400
GROWTH_MODES = {"progressive": "preserve", "official": "official"}  # run key -> growth mode of its grown stages


@dataclass(frozen=True)
class Run:
    """One of the study's runs: its plan, resolved (every stage's config checked as deepy.py checks it)."""

    key: str
    plan: Plan
    stages: list[ResolvedStage]

    @property
    def compute(self) -> float:
        """Planned training FLOPs of the whole run."""
        return sum(stage_cost(entry.config).training_flops for entry in self.stages)


def scaled(steps: int, scale: float) -> int:
    return max(2, round(steps * scale))


def _write(path: Path, configs: list[Path], work_dir: Path, stages: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"configs": [str(c) for c in configs], "work_dir": str(work_dir),
                                    "stages": stages}, sort_keys=False), encoding="utf-8")
    return path


def _run(key: str, path: Path) -> Run:
    plan = read_plan(path)
    return Run(key, plan, resolve_plan(plan))


def write_runs(work_dir: Path, shared: Path, scale: float, template: Path = TEMPLATE,
               scratch_iters: int = SCRATCH_ITERS) -> dict[str, Run]:
    """The four runs' plans, written under work_dir/plans/ and resolved; `shared` is merged after the template's
    configs (the corpus, the port). PlanError for anything a run would refuse."""
    path_plan = read_plan(template)
    unsized = [stage for stage in path_plan.stages if "train_iters" not in stage.settings]
    if unsized:
        raise path_plan.error(f"{unsized[0].where()}: key 'train_iters' missing; the study scales every stage's "
                              "length, so give train_iters in each stage")
    configs = [*path_plan.configs, shared]
    stages = [{"name": stage.name, **stage.settings, "train_iters": scaled(stage.settings["train_iters"], scale)}
              for stage in path_plan.stages]
    first, last = stages[0], stages[-1]
    plans = work_dir / "plans"
    runs = {"progressive": _run("progressive", _write(plans / "progressive.yml", configs, work_dir / "progressive",
                                                      stages))}
    official = [stages[0], *({**stage, "growth_mode": "official"} for stage in stages[1:])]
    runs["official"] = _run("official", _write(plans / "progressive_official.yml", configs,
                                               work_dir / "progressive_official", official))
    scratch = {**first, **{key: last[key] for key in slot_keys() if key in last}, "name": f"{last['name']}_scratch",
               "train_iters": scaled(scratch_iters, scale)}
    runs["scratch"] = _run("scratch", _write(plans / "scratch.yml", configs, work_dir / "scratch", [scratch]))
    small, large = runs["progressive"].stages[0].config, runs["scratch"].stages[0].config
    small_step, large_step = stage_cost(small).flops_per_step, stage_cost(large).flops_per_step
    # evaluated at about the compute spacing of the large model's evaluations, not 3x as often
    spacing = max(small.eval_interval, round(small.eval_interval * large_step / small_step / small.eval_interval)
                  * small.eval_interval)
    control = {**first, "name": f"{first['name']}_longer", "eval_interval": spacing,
               "train_iters": round(runs["progressive"].compute / small_step)}
    runs["control"] = _run("control", _write(plans / "control.yml", configs, work_dir / "control", [control]))
    return runs


def share_first_stage(source: Run, target: Run) -> bool:
    """Give `target` a copy of `source`'s finished first stage (the same stage: same keys, seed and data) unless it
    has one: the two paths then differ from the first growth on only. False if there is nothing to copy."""
    first, own = source.stages[0], target.stages[0]
    if first.stage.settings != own.stage.settings:
        raise ValueError(f"{target.plan.path}: its first stage differs from {source.plan.path}'s; it cannot be shared")
    destination = target.plan.directory(own.stage)
    if destination.exists() or checkpoint_iteration(source.plan.checkpoints(first.stage)) != first.config.train_iters:
        return False
    temporary = destination.with_name(destination.name + ".copying")
    shutil.rmtree(temporary, ignore_errors=True)
    shutil.copytree(source.plan.directory(first.stage), temporary)
    temporary.rename(destination)
    return True
