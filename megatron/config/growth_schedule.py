"""The rule growth_schedule's value must satisfy (config/validate.py calls it; growth/schedule.py runs it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatron.config.schema import TOKEN_COUNT_KEYS

KEY = "growth_schedule"


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _entry_problem(index: int, entry: Any, previous: Mapping[str, int], last_iteration: int,
                   v: Mapping[str, Any]) -> str | None:
    where = f"{KEY} entry {index + 1}"
    example = "e.g. {iteration: 2000, ffn_slot_num: 2048}"
    if not isinstance(entry, Mapping):
        return f"{where} ({entry!r}) is not a mapping: write each growth as {example}"
    unknown = sorted(set(entry) - {"iteration", *TOKEN_COUNT_KEYS})
    if unknown:
        return f"{where}: unknown key {unknown[0]!r}; an entry takes iteration and {', '.join(TOKEN_COUNT_KEYS)}"
    iteration = entry.get("iteration")
    if not _is_count(iteration):
        return f"{where}: iteration {iteration!r} must be a positive integer (the iteration after which it grows)"
    if iteration <= last_iteration:
        return f"{where}: iteration {iteration} does not come after the previous entry's {last_iteration}"
    if iteration >= v["train_iters"]:
        return (f"{where}: iteration {iteration} is not before train_iters {v['train_iters']}, so the grown model "
                "would never train: grow earlier or train longer")
    if not set(entry) & set(TOKEN_COUNT_KEYS):
        return f"{where} names no slot count: give one or more of {', '.join(TOKEN_COUNT_KEYS)}"
    bad = [key for key in TOKEN_COUNT_KEYS if key in entry and not _is_count(entry[key])]
    if bad:
        return f"{where}: {bad[0]} {entry[bad[0]]!r} is not a parameter-token count: give a positive integer"
    shrinks = [f"{key} {previous[key]} -> {entry[key]}" for key in TOKEN_COUNT_KEYS
               if key in entry and entry[key] < previous[key]]
    if shrinks:
        return f"{where} shrinks the model ({', '.join(shrinks)}): a schedule only appends parameter tokens"
    if all(entry.get(key, previous[key]) == previous[key] for key in TOKEN_COUNT_KEYS):
        return f"{where} grows nothing: each count it gives is the model's at that point ({dict(previous)})"
    tp = v["model_parallel_size"]
    uneven = [f"{key} {entry[key]}" for key in TOKEN_COUNT_KEYS if key in entry and entry[key] % tp]
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
        return (f"{KEY} with growth_mode preserve: norm_activation_type softmax cannot grow and keep the function "
                "(a zero key takes probability mass from the old tokens; docs/growth.md): use growth_mode official "
                "or an l2 variant of norm_activation_type")
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
    counts, last = {key: v[key] for key in TOKEN_COUNT_KEYS}, 0
    for index, entry in enumerate(entries):
        problem = _entry_problem(index, entry, counts, last, v)
        if problem:
            return problem
        counts, last = {key: entry.get(key, counts[key]) for key in TOKEN_COUNT_KEYS}, entry["iteration"]
    return None


def counts_after_each(config) -> list[dict[str, int]]:
    """A validated config's slot counts at the start, then after each growth its schedule lists, in order."""
    stages = [{key: getattr(config, key) for key in TOKEN_COUNT_KEYS}]
    for entry in config.growth_schedule or ():
        stages.append({key: entry.get(key, stages[-1][key]) for key in TOKEN_COUNT_KEYS})
    return stages
