"""Values computed from other keys, following GPT-NeoX.

A derived key may also be given explicitly (the resolved config is re-read from
JSON on every rank); then it must agree with what would be derived, so a
stale value can never win silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron.config.validate import ConfigError


def _agreeing(values: Mapping[str, Any], name: str, derived: Any, source: str) -> Any:
    given = values[name]
    if given is not None and given != derived:
        raise ConfigError(f"{name} is {given!r} but {source} gives {derived!r}; remove {name} or make them agree")
    return derived


def _enabled(section: Mapping[str, Any] | None) -> bool:
    return bool(section and section.get("enabled", False))


def _precision(values: Mapping[str, Any]) -> str:
    fp16, bf16 = _enabled(values["fp16"]), _enabled(values["bf16"])
    if fp16 and bf16:
        raise ConfigError("fp16 and bf16 are both enabled; enable at most one of them")
    derived = "fp16" if fp16 else "bfloat16" if bf16 else "fp32"
    return _agreeing(values, "precision", derived, "the enabled fp16/bf16 section")


def _data_parallel_size(values: Mapping[str, Any], world_size: int) -> int:
    model_copies = values["model_parallel_size"] * max(values["pipe_parallel_size"], 1)
    if world_size % model_copies:
        fitting = [size for size in range(1, world_size + 1) if world_size % size == 0]
        raise ConfigError(
            f"world_size {world_size} is not divisible by model_parallel_size {values['model_parallel_size']} "
            f"* pipe_parallel_size {values['pipe_parallel_size']}; change the process count to a multiple of "
            f"{model_copies}, or the parallel sizes to ones whose product divides {world_size} "
            f"({', '.join(map(str, fitting))})"
        )
    return world_size // model_copies


def _quotient(numerator: int, what: str, denominator: int, by: str) -> int:
    if numerator % denominator:
        raise ConfigError(f"{what} = {numerator} is not divisible by {by} {denominator}; adjust the batch sizes")
    return numerator // denominator


def _batch_sizes(values: Mapping[str, Any], world_size: int | None) -> dict[str, int | None]:
    """Any two of (global batch, micro batch, accumulation) determine the third, as in GPT-NeoX."""
    batch = values["train_batch_size"]
    micro = values["train_micro_batch_size_per_gpu"]
    accum = values["gradient_accumulation_steps"]
    if batch is None and micro is None:
        raise ConfigError("set train_micro_batch_size_per_gpu, train_batch_size, or both")
    if world_size is None:
        return {
            "train_batch_size": batch,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
        }
    dp = _data_parallel_size(values, world_size)
    if micro is not None and accum is not None:
        if batch is not None and batch != micro * accum * dp:
            raise ConfigError(
                f"train_batch_size {batch} != train_micro_batch_size_per_gpu {micro} * "
                f"gradient_accumulation_steps {accum} * data-parallel size {dp} (= {micro * accum * dp}); "
                "fix one of them or leave one out to have it derived"
            )
    elif batch is None:
        accum = 1
    else:
        per_rank = _quotient(batch, "train_batch_size", dp, "data-parallel size")
        what = "train_batch_size / data-parallel size"
        if micro is not None:
            accum = _quotient(per_rank, what, micro, "train_micro_batch_size_per_gpu")
        else:
            accum = accum or 1
            micro = _quotient(per_rank, what, accum, "gradient_accumulation_steps")
    return {
        "train_batch_size": micro * accum * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
    }


def derive(values: Mapping[str, Any], world_size: int | None) -> dict[str, Any]:
    """Fill in every derived key; `world_size` None skips the data-parallel batch arithmetic."""
    world_size = _agreeing(values, "world_size", world_size, "the launcher") if world_size else values["world_size"]
    return {
        **values,
        "world_size": world_size,
        "lr": _agreeing(values, "lr", values["optimizer"]["params"]["lr"], "optimizer.params.lr"),
        "precision": _precision(values),
        "max_position_embeddings": values["max_position_embeddings"] or values["seq_length"],
        "final_norm": values["final_norm"] or values["norm"],
        "lr_decay_iters": values["lr_decay_iters"] or values["train_iters"],
        **_batch_sizes(values, world_size),
    }
