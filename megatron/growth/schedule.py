"""`growth_schedule`: the iterations at which a running job grows its parameter tokens (docs/growth.md).

    growth_schedule:
      - {iteration: 2000, qkv_slot_num: 512, proj_slot_num: 512, ffn_slot_num: 2048}
      - {iteration: 4000, ffn_slot_num: 4096}

An entry's slot counts hold from the iteration after it; a count it leaves out stays as it was. The config's
own slot counts are the model the run starts with. A checkpoint is saved at each listed iteration, before the
growth (the record of the smaller model; resuming it grows again), and every later one holds the grown model,
so a resume builds the model of the entries before its iteration (GrowthSchedule.config_at).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.config import Config
from megatron.model.spec import slot_keys

KEY = "growth_schedule"


@dataclass(frozen=True)
class ScheduledGrowth:
    iteration: int
    counts: dict[str, int]  # every slot key's count from the next iteration on


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _entry_problem(index: int, entry: Any, previous: Mapping[str, int], last_iteration: int,
                   v: Mapping[str, Any]) -> str | None:
    where = f"{KEY} entry {index + 1}"
    example = "e.g. {iteration: 2000, ffn_slot_num: 2048}"
    if not isinstance(entry, Mapping):
        return f"{where} ({entry!r}) is not a mapping: write each growth as {example}"
    unknown = sorted(set(entry) - {"iteration", *slot_keys()})
    if unknown:
        return f"{where}: unknown key {unknown[0]!r}; an entry takes iteration and {', '.join(slot_keys())}"
    iteration = entry.get("iteration")
    if not _is_count(iteration):
        return f"{where}: iteration {iteration!r} must be a positive integer (the iteration after which it grows)"
    if iteration <= last_iteration:
        return f"{where}: iteration {iteration} does not come after the previous entry's {last_iteration}"
    if iteration >= v["train_iters"]:
        return (f"{where}: iteration {iteration} is not before train_iters {v['train_iters']}, so the grown model "
                "would never train: grow earlier or train longer")
    if not set(entry) & set(slot_keys()):
        return f"{where} names no slot count: give one or more of {', '.join(slot_keys())}"
    bad = [key for key in slot_keys() if key in entry and not _is_count(entry[key])]
    if bad:
        return f"{where}: {bad[0]} {entry[bad[0]]!r} is not a parameter-token count: give a positive integer"
    shrinks = [f"{key} {previous[key]} -> {entry[key]}" for key in slot_keys() if entry.get(key, 1 << 62) < previous[key]]
    if shrinks:
        return f"{where} shrinks the model ({', '.join(shrinks)}): a schedule only appends parameter tokens"
    if all(entry.get(key, previous[key]) == previous[key] for key in slot_keys()):
        return f"{where} grows nothing: each count it gives is the model's at that point ({dict(previous)})"
    tp = v["model_parallel_size"]
    uneven = [f"{key} {entry[key]}" for key in slot_keys() if key in entry and entry[key] % tp]
    if uneven:
        return (f"{where}: {', '.join(uneven)} is not divisible by model_parallel_size {tp}, which splits each "
                f"Pattention's tokens evenly: use a multiple of {tp}")
    return None


def _run_problem(v: Mapping[str, Any]) -> str | None:
    """What of the run keeps any schedule from applying."""
    if v["model_type"] != "tokenformer":
        return (f"{KEY} appends parameter tokens to Pattentions, and model_type {v['model_type']} has none: grow a "
                "TokenFormer (model_type: tokenformer)")
    if not v["save"]:
        return (f"{KEY} saves the model before each growth (the smaller model's record, and what a resume grows "
                "again), but save is unset: set save (and load to the same directory to resume)")
    if v["freeze_old_param_tokens"]:
        return (f"{KEY} with freeze_old_param_tokens is not supported: an online growth trains every token; grow "
                "offline (tools/grow_checkpoint.py) to freeze the old ones")
    if v["growth_mode"] == "preserve" and v["norm_activation_type"] == "softmax":
        from megatron.growth.plan import SOFTMAX_GROWTH

        return f"{KEY} with growth_mode preserve: {SOFTMAX_GROWTH}"
    return None


def schedule_problem(v: Mapping[str, Any]) -> str | None:
    """The first problem of `v`'s growth_schedule (config/validate.py's rule), None where it can run."""
    entries = v[KEY]
    if not entries:
        return None
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        return f"{KEY} must be a list of growths, e.g. [{{iteration: 2000, ffn_slot_num: 2048}}]"
    problem = _run_problem(v)
    if problem:
        return problem
    counts, last = {key: v[key] for key in slot_keys()}, 0
    for index, entry in enumerate(entries):
        problem = _entry_problem(index, entry, counts, last, v)
        if problem:
            return problem
        counts, last = {key: entry.get(key, counts[key]) for key in slot_keys()}, entry["iteration"]
    return None


@dataclass(frozen=True)
class GrowthSchedule:
    """A validated config's schedule: `config`, the run's own (its slot counts are the model it starts with), and
    each growth with every count it leaves in effect, in order."""

    config: Config
    growths: tuple[ScheduledGrowth, ...]

    @classmethod
    def from_config(cls, config: Config) -> GrowthSchedule:
        counts, growths = {key: getattr(config, key) for key in slot_keys()}, []
        for entry in config.growth_schedule or ():
            counts = {key: entry.get(key, counts[key]) for key in slot_keys()}
            growths.append(ScheduledGrowth(entry["iteration"], counts))
        return cls(config, tuple(growths))

    def config_at(self, iteration: int) -> Config:
        """The config of the model a checkpoint at `iteration` holds: every growth listed before it applied (one
        listed at `iteration` comes after that checkpoint, which holds the model before it), and the growths
        still to come as its schedule. Its checkpoints' config.json describes their model, and validates."""
        done = [growth for growth in self.growths if growth.iteration < iteration]
        if not done:
            return self.config
        entries = [entry for entry in self.config.growth_schedule if entry["iteration"] >= iteration]
        return Config.from_dict({**self.config.to_dict(), **done[-1].counts, KEY: entries or None})

    def at(self, iteration: int) -> ScheduledGrowth | None:
        return next((growth for growth in self.growths if growth.iteration == iteration), None)


def growth_iterations(cfg) -> set[int]:
    """The iterations whose checkpoint a schedule saves (checkpoint/save.py should_save)."""
    return {entry["iteration"] for entry in cfg.growth_schedule or ()}
