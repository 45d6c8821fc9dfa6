"""Rules a configuration's keys must satisfy, checked while a Config is built (config.py calls them).

Every problem becomes a `ConfigError` whose message names the key, the value,
the file it came from when known, and what to do instead. Problems of the same
stage are reported together so one run of the launcher shows all of them.
The checks of a built Config against files and the device are in run_inputs.py.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from megatron.cli import InputError
from megatron.config.growth_schedule import schedule_problem
from megatron.config.schema import SCHEMA, TOKEN_COUNT_KEYS, Key


class ConfigError(InputError):
    """A configuration problem, described so the user can fix it."""


def raise_if_any(problems: Iterable[str]) -> None:
    """Raise one ConfigError listing every problem, if there are any."""
    problems = list(problems)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def source_of(name: str, origins: Mapping[str, str]) -> str:
    """' (from FILE)' for messages, or '' when the origin is unknown."""
    return f" (from {origins[name]})" if name in origins else ""


def closest_key(name: str) -> str | None:
    """The accepted key that a misspelled `name` most likely meant."""
    matches = difflib.get_close_matches(name, SCHEMA, n=1, cutoff=0.6)
    return matches[0] if matches else None


def normalize_keys(mapping: Mapping[Any, Any], source: str) -> dict[str, Any]:
    """Top-level keys with '-' read as '_' (GPT-NeoX accepts both spellings)."""
    normalized: dict[str, Any] = {}
    spelling: dict[str, str] = {}
    for raw, value in mapping.items():
        if not isinstance(raw, str):
            raise ConfigError(f"{source}: key {raw!r} is not a string; config keys are names like num_layers")
        name = raw.replace("-", "_")
        if name in normalized:
            raise ConfigError(f"{source}: {spelling[name]!r} and {raw!r} are the same key; keep one of them")
        normalized[name], spelling[name] = value, raw
    return normalized


def _type_name(key: Key) -> str:
    if key.type is dict:
        return f"mapping to {key.item.__name__}" if key.item else "mapping"
    return f"list of {key.item.__name__}" if key.item else key.type.__name__


def _is_instance(value: Any, expected: type) -> bool:
    """isinstance, except that bool is not a number, int is a float, and inf/nan are not."""
    if isinstance(value, bool):
        return expected is bool
    if expected is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, expected)


def _not_finite(key: Key, value: Any) -> bool:
    """A float key (or list of floats) holding nan or ±inf, as YAML reads .nan, .inf and 1e400."""
    items = value if key.item is float and isinstance(value, list) else [value] if key.type is float else []
    return any(isinstance(item, float) and not math.isfinite(item) for item in items)


def _key_problem(key: Key, value: Any) -> str | None:
    """What is wrong with one value on its own, or None."""
    if value is None:
        return None if key.default is None else f"expected {_type_name(key)}, got null"
    if _not_finite(key, value):
        return (f"{value!r} is not a finite number; YAML reads .nan, .inf and numbers beyond about 1.8e308 (such as "
                "1e400) as these: give a finite value")
    if not _is_instance(value, key.type) or (  # `item`: a list's elements, a mapping's values
        key.item and not all(_is_instance(item, key.item) for item in (value.values() if key.type is dict else value))
    ):
        return f"expected {_type_name(key)}, got {value!r} ({type(value).__name__})"
    if key.choices and value not in key.choices:
        hint = difflib.get_close_matches(value, key.choices, n=1)
        suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
        return f"{value!r} is not one of: {', '.join(key.choices)}{suggestion}"
    if key.valid_range and not key.valid_range.contains(value):
        return f"{value!r} is outside the allowed range {key.valid_range}"
    return None


def check_keys(values: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """Check names, types, choices and ranges; return the values with ints made floats where floats are expected."""
    problems = []
    for name, value in values.items():
        key = SCHEMA.get(name)
        if key is None:
            guess = closest_key(name)
            hint = f"did you mean {guess!r}?" if guess else "see docs/config.md for the accepted keys"
            problems.append(f"unknown key {name!r}{source_of(name, origins)}; {hint}")
            continue
        problem = _key_problem(key, value)
        if problem:
            problems.append(f"{name}: {problem}{source_of(name, origins)}")
    raise_if_any(problems)
    return {name: _as_declared_type(SCHEMA[name], value) for name, value in values.items()}


def _as_declared_type(key: Key, value: Any) -> Any:
    if value is None:
        return None
    if key.type is float:
        return float(value)
    if key.item is float:
        return [float(item) for item in value]
    return value


def check_required(values: Mapping[str, Any]) -> None:
    """Every required key has a value."""
    tokenformer = values.get("model_type", "tokenformer") == "tokenformer"
    raise_if_any(
        f"{key.name} is required ({key.meaning.rstrip('.')}); set it in a config file or pass {key.name}=VALUE"
        for key in SCHEMA.values()
        if (key.required or (tokenformer and key.token_count)) and values.get(key.name) is None
    )


def _heads_divide_hidden(v: Mapping[str, Any]) -> str | None:
    if v["hidden_size"] % v["num_attention_heads"]:
        return (
            f"hidden_size {v['hidden_size']} is not divisible by num_attention_heads "
            f"{v['num_attention_heads']}; pick a head count that divides it"
        )
    return None


def _tensor_parallel_splits_evenly(v: Mapping[str, Any]) -> str | None:
    """Each tensor-parallel rank takes an equal block of heads and of every Pattention's tokens."""
    tp = v["model_parallel_size"]
    uneven = [
        f"{name} {v[name]}"
        for name in ("num_attention_heads", *TOKEN_COUNT_KEYS)
        if v[name] is not None and v[name] % tp
    ]
    if uneven:
        counts = [v[name] for name in ("num_attention_heads", *TOKEN_COUNT_KEYS) if v[name] is not None]
        fitting = [size for size in range(1, min(counts) + 1) if all(count % size == 0 for count in counts)]
        return (
            f"model_parallel_size {tp} does not divide {', '.join(uneven)}; tensor parallelism splits heads "
            f"and parameter tokens evenly over the ranks, so choose a model_parallel_size dividing them all: "
            f"{', '.join(map(str, fitting))}"
        )
    return None


def rotary_dims_problem(v: Mapping[str, Any]) -> str | None:
    """Why a head's rotary dimensions (head width × rotary_pct) are no positive even whole number; None if they are."""
    if v["pos_emb"] != "rotary":
        return None
    head_dim = v["hidden_size"] // v["num_attention_heads"]
    rotary_dims = head_dim * v["rotary_pct"]
    if rotary_dims != round(rotary_dims) or round(rotary_dims) % 2 or rotary_dims == 0:
        return (
            f"rotary_pct {v['rotary_pct']} of head dimension {head_dim} gives {rotary_dims:g} rotary "
            "dimensions; it must be a positive even whole number"
        )
    return None


def _positions_cover_sequence(v: Mapping[str, Any]) -> str | None:
    if v["max_position_embeddings"] < v["seq_length"]:
        return (
            f"max_position_embeddings {v['max_position_embeddings']} is smaller than seq_length "
            f"{v['seq_length']}; raise it or shorten seq_length"
        )
    return None


def _min_lr_within_lr(v: Mapping[str, Any]) -> str | None:
    if v["min_lr"] > v["lr"]:
        return f"min_lr {v['min_lr']:g} is larger than lr {v['lr']:g} (optimizer.params.lr)"
    return None


def _split_is_three_proportions(v: Mapping[str, Any]) -> str | None:
    parts = [part.strip() for part in v["split"].split(",")]
    try:
        numbers = [float(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) != 3 or not all(map(math.isfinite, numbers)) or min(numbers) < 0 or sum(numbers) <= 0:
        return (
            f"split {v['split']!r} must be three non-negative numbers with a positive sum "
            "(train, validation, test), e.g. '969, 30, 1'"
        )
    return None


def _one_data_source(v: Mapping[str, Any]) -> str | None:
    if v["data_path"] and v["train_data_paths"]:
        return "data_path and train_data_paths are both set; use one of them"
    return None


def _weights_match_paths(v: Mapping[str, Any]) -> str | None:
    for stage in ("train", "valid", "test"):
        paths, weights = v[f"{stage}_data_paths"], v[f"{stage}_data_weights"]
        if weights is not None and len(weights) != len(paths or ()):
            return (
                f"{stage}_data_weights has {len(weights)} entries but {stage}_data_paths has "
                f"{len(paths or ())}; give one weight per path"
            )
        if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
            return (f"{stage}_data_weights {weights}: each weight must be a positive number (to leave a dataset "
                    f"out, remove it from {stage}_data_paths)")
        if weights is not None and not math.isfinite(sum(weights)):
            return (f"{stage}_data_weights {weights}: their sum overflows to inf, which would weigh every dataset 0; "
                    "only their ratios matter, so give smaller numbers (e.g. 1 for each equal weight)")
    return None


def _attention_config_is_tokenformer(v: Mapping[str, Any]) -> str | None:
    config = v["attention_config"]
    if config is None:
        return None
    try:
        types = {name for names, _ in config for name in names}
        layers = sum(count for _, count in config)
    except (TypeError, ValueError):
        return f"attention_config {config!r} must look like [[['tokenformer'], NUM_LAYERS]]"
    if types != {"tokenformer"} or layers != v["num_layers"]:
        return (
            f"attention_config {config!r} must be [[['tokenformer'], {v['num_layers']}]]: "
            "every layer of this framework is a TokenFormer layer"
        )
    return None


def _pipeline_zero_stage(v: Mapping[str, Any]) -> str | None:
    stage = (v["zero_optimization"] or {}).get("stage", 0)
    if v["pipe_parallel_size"] >= 1 and stage >= 2:
        return (
            f"zero_optimization.stage {stage} cannot be combined with pipe_parallel_size {v['pipe_parallel_size']}: "
            "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only; use stage 1 (it partitions the "
            "optimizer state), or pipe_parallel_size 0 to train the plain model with ZeRO stage 2"
        )
    return None


def _every_stage_has_a_layer(v: Mapping[str, Any]) -> str | None:
    if v["pipe_parallel_size"] > v["num_layers"]:
        return (
            f"pipe_parallel_size {v['pipe_parallel_size']} is larger than num_layers {v['num_layers']}; "
            "each pipeline stage should hold a TokenFormer layer, so use at most num_layers stages"
        )
    return None


# The class of the TokenFormer blocks in the pipeline (megatron/model/pipeline.py).
PIPELINE_LAYER_CLASS = "TransformerLayerPipe"


def _partition_method_is_known(v: Mapping[str, Any]) -> str | None:
    method = v["pipe_partition_method"]
    if method.lower() in ("parameters", "uniform"):  # DeepSpeed reads the method case-insensitively
        return None
    if method.lower().startswith("type:"):
        try:
            if re.search(method[len("type:"):], PIPELINE_LAYER_CLASS, re.IGNORECASE):
                return None
        except re.error:
            pass
    return (
        f"pipe_partition_method {method!r} must be 'parameters', 'uniform' or 'type:REGEX' with a regular "
        f"expression matching the class of the TokenFormer layers, {PIPELINE_LAYER_CLASS} "
        "(e.g. the default 'type:transformer|mlp')"
    )


def _cluster_check_sections_are_known(v: Mapping[str, Any]) -> str | None:
    sections = SCHEMA["cluster_check_sections"].default  # all of them, in the order they run
    if not v["cluster_check_sections"]:
        return (f"cluster_check_sections is empty: the cluster check would check nothing; name the sections to run "
                f"(from {', '.join(sections)}), or leave the key out for all of them")
    unknown = [name for name in v["cluster_check_sections"] if name not in sections]
    if unknown:
        return (f"cluster_check_sections: {', '.join(map(repr, unknown))} is not a section; choose from "
                f"{', '.join(sections)}")
    return None


# Signals a process can catch; SIGKILL and SIGSTOP cannot be.
_CATCHABLE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGQUIT", "SIGCONT", "SIGXCPU")


def _exit_signals_are_catchable(v: Mapping[str, Any]) -> str | None:
    unknown = [name for name in v["exit_signals"] if name not in _CATCHABLE_SIGNALS]
    if unknown:
        return (
            f"exit_signals {unknown} cannot be handled; choose among {', '.join(_CATCHABLE_SIGNALS)} "
            "(SLURM sends SIGTERM, and SIGUSR1 with --signal=USR1@SECONDS)"
        )
    return None


def _compile_section_is_known(v: Mapping[str, Any]) -> str | None:
    section = v["compile"]
    if section is None:
        return None
    unknown = sorted(set(section) - {"enable", "backend", "components"})
    if unknown:
        return f"compile: unknown key {unknown[0]!r}; the section takes enable, backend and components"
    if not isinstance(section.get("enable", False), bool):
        return f"compile.enable {section['enable']!r} must be true or false"
    if not isinstance(section.get("backend", "inductor"), str):
        return f"compile.backend {section['backend']!r} must be a torch.compile backend's name, e.g. inductor"
    components = section.get("components", ["model"])
    if not isinstance(components, list) or set(components) - {"model"}:
        return (f"compile.components {components!r}: only [model] (each TokenFormer layer) is compiled here; the "
                "loss is a hand-written vocabulary-parallel kernel")
    return None


def _restarts_resume_the_run(v: Mapping[str, Any]) -> str | None:
    """A restart resumes from `load`: it must be where the run saves, or each restart would go back to the
    checkpoint the run began from (or to iteration 0)."""
    if not v["max_restarts"] or (v["save"] and v["load"] and Path(v["load"]) == Path(v["save"])):
        return None
    if not v["save"]:
        return (f"max_restarts = {v['max_restarts']} restarts a failed run from its latest checkpoint, but save is "
                "unset: set save and load to the same directory")
    return (f"max_restarts = {v['max_restarts']} restarts a failed run from its latest checkpoint in load, but load "
            f"= {v['load']!r} is not save = {v['save']!r}: set load = {v['save']!r}")


# The data index, the sampler and the checkpoints count samples in 64-bit integers.
MOST_SAMPLES = 2**63 - 1


def _samples_can_be_counted(v: Mapping[str, Any]) -> str | None:
    """Checked once the global batch is known: before the world size is (deepy.py's first reading of the files),
    the message could only name a guess at it."""
    batch = v["train_batch_size"]
    if batch is None or v["train_iters"] * batch <= MOST_SAMPLES:
        return None
    return (f"train_iters = {v['train_iters']} is beyond any run: {v['train_iters'] * batch:.3g} samples of "
            f"train_batch_size {batch}, more than the data index and the checkpoints can count (2^63 - 1); "
            "set the number of optimizer steps to train for")


RULES: tuple[Callable[[Mapping[str, Any]], str | None], ...] = (
    _heads_divide_hidden,
    _tensor_parallel_splits_evenly,
    rotary_dims_problem,
    _positions_cover_sequence,
    _min_lr_within_lr,
    _split_is_three_proportions,
    _one_data_source,
    _weights_match_paths,
    _attention_config_is_tokenformer,
    _pipeline_zero_stage,
    _every_stage_has_a_layer,
    _partition_method_is_known,
    _cluster_check_sections_are_known,
    _exit_signals_are_catchable,
    _compile_section_is_known,
    _samples_can_be_counted,
    _restarts_resume_the_run,
    schedule_problem,
)


def check_rules(values: Mapping[str, Any]) -> None:
    """Cross-key rules on complete, typed, derived values."""
    raise_if_any(problem for rule in RULES if (problem := rule(values)))
