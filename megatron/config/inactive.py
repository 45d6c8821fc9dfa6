"""Keys that a config sets but that have no effect here, or a cost the user may not expect, for the launcher to print.

GPT-NeoX files set many keys this framework accepts but does not act on; a
user who turned one on should be told instead of finding out from the results.
A key is reported when its value differs from its default, because the
default is the behaviour this framework has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron.config.schema import PATTENTION_KEYS, SCHEMA, TRITON_FLASH_BACKENDS

if TYPE_CHECKING:
    from megatron.config.config import Config


def _backend_on_cpu(cfg: Config, device_name: str) -> list[tuple[str, str]]:
    if device_name == "cpu" and cfg.distributed_backend == "nccl":
        return [("distributed_backend", "nccl needs CUDA devices; this CPU run uses gloo")]
    return []


def _pattention_keys_of_a_dense_model(cfg: Config) -> list[tuple[str, str]]:
    if cfg.model_type != "transformer":
        return []
    reason = "model_type transformer has no Pattention layers (its projections are linear), so the Pattention keys " \
             "do not apply"
    return [(name, reason) for name in PATTENTION_KEYS if getattr(cfg, name) != SCHEMA[name].default]


def inactive_keys(cfg: Config, device_name: str) -> list[tuple[str, str]]:
    """(key, reason) for every key set to a value that has no effect on this device or this kind of model."""
    unused = [
        (key.name, key.inactive)
        for key in SCHEMA.values()
        if key.inactive and getattr(cfg, key.name) != key.default
    ]
    return unused + _pattention_keys_of_a_dense_model(cfg) + _backend_on_cpu(cfg, device_name)


def _triton_on_a_cpu(cfg: Config, device_name: str) -> list[tuple[str, str]]:
    """Every Pattention implementation but plain runs Θ in Triton kernels with flash_backend triton or kernels
    (fused's score matrix and flash's blocks alike, megatron/model/pattention/registry.py)."""
    uses_tiles = cfg.model_type == "tokenformer" and cfg.pattention_impl != "plain"
    if device_name != "cpu" or cfg.flash_backend not in TRITON_FLASH_BACKENDS or not uses_tiles:
        return []
    return [("flash_backend", f"{cfg.flash_backend} on a CPU runs pattention_impl {cfg.pattention_impl}'s kernels "
             "under Triton's interpreter, about 100x slower than flash_backend: pytorch (meant for testing the "
             "kernels)")]


def _compiling_on_a_cpu(cfg: Config, device_name: str) -> list[tuple[str, str]]:
    """The first step compiles the layers before it computes anything, and prints nothing meanwhile."""
    if device_name != "cpu" or not (cfg.compile or {}).get("enable", False):
        return []
    return [("compile", "the first training step compiles every TokenFormer layer before it trains, which takes a "
             "minute or more on a CPU with no output meanwhile; set compile: {enable: false} for short runs")]


def slow_keys(cfg: Config, device_name: str) -> list[tuple[str, str]]:
    """(key, why) for every key set to a value that makes this run much slower on this device than another value,
    or silent for long."""
    return _triton_on_a_cpu(cfg, device_name) + _compiling_on_a_cpu(cfg, device_name)
