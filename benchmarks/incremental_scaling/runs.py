"""The study's runs for one seed, written as plans for tools/progressive_scaling.py's driver under
WORK_DIR/seed<N>/plans/:

- progressive.yml: configs/plan.yml, S1 -> S2 -> S3 in growth mode preserve (configs/common.yml sets it);
- progressive_official.yml: the same path with growth_mode official in every grown stage (new keys and values
  from the init, the norm over the new token count, a fresh optimizer, as the official code grows);
- restarts.yml: the same stages, lengths, warmups, cosines and data restarts, every stage at S1's size: the path
  without its growth, which tells how much of the path's result its restarts make;
- scratch.yml: the reference, S3 from scratch, one stage with S1's keys (schedule, data) and S3's parameter tokens,
  SCRATCH_ITERS steps;
- control.yml: S1 trained longer, one stage with S1's keys for as many steps as give it the larger of the path's
  and the reference's compute (evaluated at about the compute spacing of the reference's evaluations): the small
  model on the path's compute, and on the reference's (the regime check);
- dense.yml: the dense Transformer (model_type transformer) with about S3's parameter count, trained as the
  reference is: the paper's baseline;
- the ablation (ABLATION): the progressive path with one factor of its growth mode changed, each a plan
  like progressive_official.yml: preserve with a fresh optimizer, preserve with √n of the new count, official
  with the optimizer state carried over, official with √n of the old count, and preserve with n of √n ramped to
  the new count (norm_ramp.py).

Every other path starts from a copy of the progressive path's finished S1 (share_first_stage), so they differ
from it in growth alone. Every stage gets the seed; every run's steps are multiplied by `scale` (the
quick check: 0.05). The driver runs each plan; a plan it finished before is not run again.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron.config import Config
from megatron.config.validate import rotary_dims_problem
from megatron.model.spec import slot_keys
from megatron.progressive.costs import model_args, parameter_counts, stage_cost
from megatron.progressive.plan import Plan, read_plan
from megatron.progressive.progress import checkpoint_iteration
from megatron.progressive.stage_config import ResolvedStage, resolve_plan

CONFIGS = Path(__file__).resolve().parent / "configs"
TEMPLATE = CONFIGS / "plan.yml"
SCRATCH_ITERS = 750
SEEDS = (1, 2, 3)
RAMP_SHARE = 0.25  # preserve_norm_ramp: n of √n moved to the new count over this share of each grown stage


def _ramp(stage: dict[str, Any]) -> dict[str, Any]:
    return {"norm_token_count_ramp_iters": max(1, round(RAMP_SHARE * stage["train_iters"]))}


# The ablation's paths: run key -> (how it grows, the keys of a grown stage given its keys). Each changes one
# factor of preserve or of official (docs/growth.md: new keys, √n, optimizer state); the last keeps preserve's
# function at the growth and reaches the new count's √n over the stage's first quarter.
ABLATION: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "preserve_fresh_optimizer": ("preserve, optimizer reset", lambda _: {"growth_optimizer": "reset"}),
    "preserve_new_norm": ("preserve, √n of the new count", lambda _: {"growth_norm_token_count": "new"}),
    "official_carried_optimizer": ("official, optimizer carried over",
                                   lambda _: {"growth_mode": "official", "growth_optimizer": "carry"}),
    "official_old_norm": ("official, √n of the old count",
                          lambda _: {"growth_mode": "official", "growth_norm_token_count": "old"}),
    "preserve_norm_ramp": (f"preserve, √n ramped to the new count over {RAMP_SHARE:.0%} of the stage", _ramp),
}
GROWN = {"progressive": ("preserve", lambda _: {}), "official": ("official", lambda _: {"growth_mode": "official"}),
         **ABLATION}
PATHS = {**{key: how for key, (how, _) in GROWN.items()}, "restarts": "no growth"}  # run key -> how it grows
SHARING_FIRST_STAGE = tuple(key for key in PATHS if key != "progressive")
OPTIONAL = ("restarts", "dense")  # the controls, left out by --quick


@dataclass(frozen=True)
class Run:
    """One of the study's runs: its plan, resolved (every stage's config checked as deepy.py checks it)."""

    key: str
    plan: Plan
    stages: list[ResolvedStage]

    @property
    def compute(self) -> float:
        """Planned training FLOPs of the whole run."""
        return sum(stage_cost(entry.config, entry.steps).training_flops for entry in self.stages)


def scaled(steps: int, scale: float) -> int:
    return max(2, round(steps * scale))


def write_plan(path: Path, configs: list[Path], work_dir: Path, stages: list[dict[str, Any]]) -> Path:
    """A plan file for tools/progressive_scaling.py at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"configs": [str(c) for c in configs], "work_dir": str(work_dir),
                                    "stages": stages}, sort_keys=False), encoding="utf-8")
    return path


def _run(key: str, path: Path) -> Run:
    plan = read_plan(path)
    return Run(key, plan, resolve_plan(plan))


def dense_shape(large: Config) -> dict[str, int]:
    """hidden_size and num_attention_heads of the dense Transformer whose parameter count is nearest `large`'s, at
    `large`'s depth: widths in steps of 8, heads within a factor 2 of `large`'s head width (the nearest) whose
    rotary dimensions are a positive even number."""
    args = model_args(large)
    target, best = parameter_counts(args)["total_params"], None
    for width in range(8, 4 * args.hidden_size + 1, 8):
        fitting = [heads for heads in range(1, width + 1) if width % heads == 0
                   and args.head_dim / 2 <= width // heads <= 2 * args.head_dim
                   and rotary_dims_problem({"pos_emb": args.pos_emb, "hidden_size": width,
                                            "num_attention_heads": heads, "rotary_pct": args.rotary_pct}) is None]
        if not fitting:
            continue
        heads = min(fitting, key=lambda h: abs(width // h - args.head_dim))
        dense = dataclasses.replace(args, model_type="transformer", hidden_size=width, num_attention_heads=heads,
                                    **dict.fromkeys(slot_keys()))
        gap = abs(parameter_counts(dense)["total_params"] - target)
        if best is None or gap < best[0]:
            best = (gap, width, heads)
    return {"hidden_size": best[1], "num_attention_heads": best[2]}


def write_runs(work_dir: Path, shared: Path, scale: float, seed: int, template: Path = TEMPLATE,
               scratch_iters: int = SCRATCH_ITERS, quick: bool = False, ablation: bool = True) -> dict[str, Run]:
    """One seed's runs, their plans written under work_dir/plans/ and resolved; `shared` is merged after the
    template's configs (the corpus, the port). `quick`: the template's first two stages only, and no OPTIONAL
    runs; `ablation`: with the ABLATION paths. PlanError for anything a run would refuse."""
    path_plan = read_plan(template)
    unsized = [stage for stage in path_plan.stages if "train_iters" not in stage.settings]
    if unsized:
        raise path_plan.error(f"{unsized[0].where()}: key 'train_iters' missing; the study scales every stage's "
                              "length, so give train_iters in each stage")
    configs = [*path_plan.configs, shared]
    stages = [{"name": stage.name, **stage.settings, "seed": seed,
               "train_iters": scaled(stage.settings["train_iters"], scale)}
              for stage in path_plan.stages[:2 if quick else None]]
    first, last = stages[0], stages[-1]
    plans = work_dir / "plans"

    def run(key: str, name: str, run_stages: list[dict[str, Any]]) -> Run:
        return _run(key, write_plan(plans / f"{name}.yml", configs, work_dir / name, run_stages))

    runs = {key: run(key, "progressive" if key == "progressive" else f"progressive_{key}",
                     [first, *({**stage, **keys(stage)} for stage in stages[1:])]) for key, (_, keys) in GROWN.items()
            if ablation or key not in ABLATION}
    small = runs["progressive"].stages[0].config  # S1's counts may come from the config files
    small_slots = {key: getattr(small, key) for key in slot_keys()}
    if not quick:
        runs["restarts"] = run("restarts", "restarts", [first, *({**stage, **small_slots} for stage in stages[1:])])
    scratch = {**first, **{key: last[key] for key in slot_keys() if key in last}, "name": f"{last['name']}_scratch",
               "train_iters": scaled(scratch_iters, scale)}
    runs["scratch"] = run("scratch", "scratch", [scratch])
    large = runs["scratch"].stages[0].config
    small_step, large_step = stage_cost(small).flops_per_step, stage_cost(large).flops_per_step
    # evaluated at about the compute spacing of the large model's evaluations, not 3x as often
    spacing = max(small.eval_interval, round(small.eval_interval * large_step / small_step / small.eval_interval)
                  * small.eval_interval)
    longest = max(runs["progressive"].compute, runs["scratch"].compute)
    control = {**first, "name": f"{first['name']}_longer", "eval_interval": spacing,
               "train_iters": math.ceil(longest / small_step)}
    runs["control"] = run("control", "control", [control])
    if quick:
        return runs
    dense = {**{key: value for key, value in scratch.items() if key not in slot_keys()},
             "name": f"{last['name']}_dense", "model_type": "transformer", **dense_shape(large)}
    runs["dense"] = run("dense", "dense", [dense])
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
