"""A progressive-scaling plan: the YAML file tools/progressive_scaling.py runs (docs/growth.md).

    configs: [configs/demo.yml]             # every stage's config files, merged left to right as deepy.py does
    work_dir: work_dirs/progressive_demo    # stage NAME's checkpoints and logs go under work_dir/NAME/
    stages:                                 # in order; each a name plus that stage's config keys
      - {name: s1, train_iters: 200}
      - {name: s2, qkv_slot_num: 256, proj_slot_num: 256, ffn_slot_num: 1024, train_iters: 100}

This module reads the file and checks what needs no config loaded: its shape, the stage names, that every
stage key is a config key, not one the driver sets itself, with a value the key accepts (named as the plan
writes it), and that work_dir can be a directory. Relative paths are taken from the current directory, as
deepy.py takes them. Every error names the plan file, the stage, the key and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron.config import ConfigError
from megatron.config.loader import read_yaml, values_set
from megatron.config.schema import SCHEMA
from megatron.config.validate import check_keys, closest_key, normalize_keys
from megatron.progressive.online_rules import GROWTH_KEYS, online_problem

PLAN_KEYS = ("configs", "work_dir", "stages")
STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
FINAL = "final"
ONLINE_JOB = "job"
# Set by the driver for every stage: a stage giving them would train somewhere the driver does not look.
DRIVER_KEYS = {"save": "work_dir/NAME/checkpoints", "load": "work_dir/NAME/checkpoints",
               "log_dir": "work_dir/NAME/logs"}
REFUSED_KEYS = {
    "pretrain_partial_init": "the driver grows each stage from the previous stage's last checkpoint with "
                             "tools/grow_checkpoint.py; remove it",
    "eval_only": "a plan trains; to score a stage's checkpoint run deepy.py train.py ... eval_only=true "
                 "load=work_dir/NAME/checkpoints",
    "world_size": "it is the number of processes the launcher starts: set num_gpus (and num_nodes)",
    "user_script": "the driver runs train.py",
    "config_files": "load_config records the config files itself",
    "padded_vocab_size": "the tokenizer sets it when a run starts",
}


class PlanError(ConfigError):
    """A plan that cannot run as written; the message says where and what to do."""


@dataclass(frozen=True)
class Stage:
    """One stage: its name, position and config keys (normalized: '-' read as '_')."""

    name: str
    index: int
    settings: dict[str, Any]

    def where(self) -> str:
        return f"stage {self.name!r} (stages[{self.index}])"


@dataclass(frozen=True)
class Plan:
    """`online`: the stages run as one job (work_dir/job/) that grows at each stage's end (online_rules.py);
    `job_defaults`: the keys the driver gives that job where the plan's config files leave them unset."""

    path: Path
    configs: tuple[Path, ...]
    work_dir: Path
    stages: tuple[Stage, ...]
    online: bool = False
    job_defaults: tuple[tuple[str, Any], ...] = ()

    def error(self, message: str) -> PlanError:
        return PlanError(f"{self.path}: {message}")

    def directory(self, stage: Stage) -> Path:
        """The stage's directory: its lineage.json, and in a chain its stage file, checkpoints, logs and jobs."""
        return self.work_dir / stage.name

    @property
    def job_directory(self) -> Path:
        """An online plan's job: its config file (job.yml), checkpoints and logs, for every stage."""
        return self.work_dir / ONLINE_JOB

    def checkpoints(self, stage: Stage) -> Path:
        """The stage's save = load directory; in a chain a grown stage's first checkpoint (global_step0) is its
        growth; online, the job's, where the stage's checkpoints are those after the stage before's end."""
        return (self.job_directory if self.online else self.directory(stage)) / "checkpoints"

    def logs(self, stage: Stage) -> Path:
        return (self.job_directory if self.online else self.directory(stage)) / "logs"

    def end(self, stage: Stage) -> int:
        """An online stage's last iteration in the job's count (its train_iters)."""
        return stage.settings["train_iters"]

    def start(self, stage: Stage) -> int:
        """An online stage's first iteration less one: the stage before's end (0 for the first)."""
        previous = self.previous(stage)
        return 0 if previous is None else self.end(previous)

    def iterations(self, stage: Stage) -> range:
        """An online stage's iterations in the job's count: after the stage before's end (whose checkpoint holds
        the model before the growth) through its own; the first stage's from 0."""
        return range(self.start(stage) + 1 if stage.index else 0, self.end(stage) + 1)

    def stage_file(self, stage: Stage) -> Path:
        """The YAML file merged after `configs` for this stage (written by the driver); online, the job's."""
        return self.job_directory / "job.yml" if self.online else self.directory(stage) / "stage.yml"

    def config_files(self, stage: Stage) -> list[Path]:
        return [*self.configs, self.stage_file(stage)]

    def stage_settings(self, stage: Stage) -> dict[str, Any]:
        """The stage's keys and the directories the driver gives it (a chain's stage file). Online, the first
        stage's keys are the job's: a grown stage adds its own and the growth keys, and the learning-rate schedule
        decays over the whole job unless a config sets lr_decay_iters."""
        checkpoints = str(self.checkpoints(stage))
        directories = {"save": checkpoints, "load": checkpoints, "log_dir": str(self.logs(stage))}
        if not self.online:
            return {**stage.settings, **directories}
        grown = {key: value for later in self.stages[1:] for key, value in later.settings.items()
                 if key in GROWTH_KEYS} if stage.index else {}
        return {**dict(self.job_defaults), **self.stages[0].settings, **grown, **stage.settings, **directories}

    def previous(self, stage: Stage) -> Stage | None:
        return self.stages[stage.index - 1] if stage.index else None

    @property
    def final(self) -> Path:
        """work_dir/final: a symlink to the last stage's checkpoints once the plan is complete."""
        return self.work_dir / FINAL


def _path_list(plan_path: Path, value: Any) -> tuple[Path, ...]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise PlanError(f"{plan_path}: configs must be a non-empty list of config files, e.g. "
                        f"configs: [configs/demo.yml]; got {value!r}")
    missing = [item for item in value if not Path(item).is_file()]
    if missing:
        raise PlanError(f"{plan_path}: configs: {', '.join(missing)} does not exist (relative paths are taken "
                        f"from the current directory, {Path.cwd()}); fix the path or run from the directory the "
                        "plan's paths are relative to (the repository root for the plans in configs/progressive/)")
    return tuple(Path(item).resolve() for item in value)


def _stage_key_problem(name: str) -> str | None:
    if name in DRIVER_KEYS:
        return f"is set by the driver ({DRIVER_KEYS[name]}); remove it from the stage"
    if name in REFUSED_KEYS:
        return f"cannot be part of a plan: {REFUSED_KEYS[name]}"
    if name not in SCHEMA:
        guess = closest_key(name)
        return "is not a config key; " + (f"did you mean {guess!r}?" if guess else "see docs/config.md for the keys")
    return None


def _stage(plan_path: Path, index: int, raw: Any, seen: set[str]) -> Stage:
    where = f"stages[{index}]"
    if not isinstance(raw, Mapping):
        raise PlanError(f"{plan_path}: {where} must be a mapping with a name and config keys, e.g. "
                        f"{{name: s{index + 1}, train_iters: 1000}}; got {raw!r}")
    settings = normalize_keys(raw, f"{plan_path}: {where}")
    name = settings.pop("name", None)
    if not isinstance(name, str) or not STAGE_NAME.match(name) or name in (FINAL, ONLINE_JOB):
        raise PlanError(f"{plan_path}: {where}: name {name!r} must be a directory name of letters, digits, '.', "
                        f"'_' or '-' other than {FINAL!r} and {ONLINE_JOB!r} (its checkpoints go under "
                        "work_dir/NAME/); set "
                        f"name: s{index + 1}")
    if name in seen:
        raise PlanError(f"{plan_path}: {where}: name {name!r} is used by an earlier stage; give every stage its "
                        "own name (each has its own directory)")
    seen.add(name)
    stage = Stage(name, index, settings)
    for key in settings:
        problem = _stage_key_problem(key)
        if problem:
            raise PlanError(f"{plan_path}: {stage.where()}: key {key!r} {problem}")
    try:
        check_keys(settings, {})
    except ConfigError as error:
        raise PlanError(f"{plan_path}: {stage.where()}: {error}") from None
    return stage


def _work_dir(plan_path: Path, value: Any) -> Path:
    if not isinstance(value, str):
        raise PlanError(f"{plan_path}: work_dir must be a directory path, got {value!r}")
    work_dir = Path(value).resolve()
    existing = next(folder for folder in (work_dir, *work_dir.parents) if folder.exists())
    if not existing.is_dir():
        raise PlanError(f"{plan_path}: work_dir {value} cannot be a directory: {existing} is a file; choose another "
                        "work_dir")
    return work_dir


def parse_plan(path: str | Path, content: Any, online: bool = False) -> Plan:
    """The plan `content` (the parsed YAML of `path`) describes, to run as a chain or `online`; PlanError naming
    the first problem."""
    path = Path(path)
    if not isinstance(content, Mapping):
        raise PlanError(f"{path}: a plan is a mapping with the keys {', '.join(PLAN_KEYS)}; got "
                        f"{type(content).__name__}")
    unknown = sorted(set(content) - set(PLAN_KEYS))
    if unknown:
        raise PlanError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; a plan has only "
                        f"{', '.join(PLAN_KEYS)} (config keys shared by every stage go into a file listed in "
                        "configs, a stage's own keys into its entry of stages)")
    missing = [key for key in PLAN_KEYS if content.get(key) is None]
    if missing:
        raise PlanError(f"{path}: {', '.join(missing)} missing; a plan needs configs (config files every stage "
                        "shares), work_dir (where stages write) and stages (a list of {name: ..., key: value})")
    work_dir = _work_dir(path, content["work_dir"])
    stages, seen = content["stages"], set()
    if not isinstance(stages, list) or not stages:
        raise PlanError(f"{path}: stages must be a non-empty list of mappings, each with a name")
    plan = Plan(path, _path_list(path, content["configs"]), work_dir,
                tuple(_stage(path, index, raw, seen) for index, raw in enumerate(stages)))
    if not online:
        return plan
    problem = online_problem(plan.stages)
    if problem:
        raise plan.error(f"it cannot run --online: {problem}")
    # The job decays over its whole length; lr_decay_iters None (or unset) would follow a stage's own train_iters.
    decays = values_set(plan.configs).get("lr_decay_iters") is not None
    return replace(plan, online=True, job_defaults=(
        () if decays else (("lr_decay_iters", plan.end(plan.stages[-1])),)))


def read_plan(path: str | Path, online: bool = False) -> Plan:
    """Read and check the plan file `path` (to run as one job: `online`)."""
    path = Path(path)
    return parse_plan(path, read_yaml(path, "plan file", PlanError)[1], online)
