"""What a plan must be to run `--online`: as one job that grows its parameter tokens as it goes (docs/growth.md).

An online plan's stages share one job, one config, one data stream and one learning-rate schedule; the job grows
at each stage's end (growth_schedule). So a stage after the first may set only its parameter-token counts, its
train_iters (the job's iteration where the stage ends, after the stage before's) and the growth keys, the same in
every grown stage. Every other key belongs to the whole job and is set in the first stage (or the shared
configs). Checked on the plan alone, before any config is loaded; each refusal names the stage, the key and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron.config.schema import SCHEMA, TOKEN_COUNT_KEYS

if TYPE_CHECKING:
    from megatron.progressive.plan import Stage

GROWTH_KEYS = ("growth_mode", "growth_optimizer", "growth_norm_token_count", "norm_token_count_ramp_iters")
STAGE_KEYS = (*TOKEN_COUNT_KEYS, "train_iters", *GROWTH_KEYS)
CHAIN = "run the plan as a chain of jobs (without --online)"


def _key_problem(stage: Stage, key: str) -> str:
    if SCHEMA[key].group == "data":
        why = "another dataset or data setting, where the job reads one data stream"
    else:
        why = "a setting of the whole job, which one config runs"
    return (f"{stage.where()}: key {key!r} cannot change between the stages of an online plan ({why}): a grown "
            f"stage sets only {', '.join(STAGE_KEYS)}; set {key} in the first stage to apply it to the whole job, "
            f"or {CHAIN}")


def _iteration_problem(stage: Stage, previous: Stage | None) -> str | None:
    iters = stage.settings.get("train_iters")
    if iters is None:
        return (f"{stage.where()} sets no train_iters: in an online plan each stage's train_iters is the job's "
                "iteration where the stage ends (and the job grows into the next one); give it")
    if previous is not None and iters <= previous.settings["train_iters"]:
        return (f"{stage.where()}: train_iters {iters} is not after stage {previous.name!r}'s "
                f"{previous.settings['train_iters']} (a restarted iteration): in an online plan the iterations "
                f"continue, and train_iters is where the stage ends; to train it {iters} iterations set train_iters: "
                f"{previous.settings['train_iters'] + iters}, or {CHAIN}, whose stages restart at iteration 0")
    return None


def _growth_keys_problem(grown: Sequence[Stage]) -> str | None:
    for key in GROWTH_KEYS:
        values = {stage.name: stage.settings.get(key) for stage in grown}
        if len({repr(value) for value in values.values()}) > 1:
            given = ", ".join(f"{name} {value!r}" for name, value in values.items())
            return (f"key {key!r} differs between the grown stages ({given}): the job grows every time as its one "
                    f"config says; give every grown stage the same {key}, or {CHAIN}")
    return None


def online_problem(stages: Sequence[Stage]) -> str | None:
    """The first reason `stages` cannot run as one job, None where they can."""
    if len(stages) < 2:
        return "an online plan grows the model between stages, and this one has a single stage; run it without --online"
    for stage in stages:
        problem = _iteration_problem(stage, stages[stage.index - 1] if stage.index else None)
        if problem:
            return problem
    for stage in stages[1:]:
        for key in stage.settings:
            if key not in STAGE_KEYS:
                return _key_problem(stage, key)
    return _growth_keys_problem(stages[1:])
