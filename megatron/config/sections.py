"""Checks of the nested sections: `optimizer` and the DeepSpeed dictionaries.

`fp16`, `bf16` and `zero_optimization` go to DeepSpeed unchanged, so they are
checked with DeepSpeed's own models here, at load time, instead of failing
inside engine start-up on every rank.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from megatron.config.validate import ConfigError, raise_if_any, source_of

_OPTIMIZER_TYPES = {"adam": "Adam", "adamw": "AdamW"}
_OPTIMIZER_PARAMS = ("lr", "betas", "eps")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _param_problems(params: Mapping[str, Any]) -> list[str]:
    problems = []
    for name in params:
        if name == "weight_decay":
            problems.append("optimizer.params.weight_decay: set the top-level weight_decay key instead")
        elif name not in _OPTIMIZER_PARAMS:
            hint = difflib.get_close_matches(str(name), _OPTIMIZER_PARAMS, n=1)
            guess = f"; did you mean {hint[0]!r}?" if hint else f"; accepted: {', '.join(_OPTIMIZER_PARAMS)}"
            problems.append(f"optimizer.params: unknown field {name!r}{guess}")
    lr = params.get("lr")
    if not _is_number(lr) or lr <= 0:
        problems.append(f"optimizer.params.lr: expected a positive number, got {lr!r}")
    betas = params.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        problems.append(f"optimizer.params.betas: expected two numbers in [0, 1), got {betas!r}")
    eps = params.get("eps", 1e-8)
    if not _is_number(eps) or eps <= 0:
        problems.append(f"optimizer.params.eps: expected a positive number, got {eps!r}")
    return problems


def check_optimizer(optimizer: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """Validate {type, params}; return it with the canonical type name and float params."""
    problems = [
        f"optimizer: unknown field {name!r}; it takes type and params"
        for name in optimizer
        if name not in ("type", "params")
    ]
    kind = optimizer.get("type")
    canonical = _OPTIMIZER_TYPES.get(kind.lower()) if isinstance(kind, str) else None
    if canonical is None:
        problems.append(f"optimizer.type: {kind!r} is not one of: Adam, AdamW")
    params = optimizer.get("params")
    if isinstance(params, dict):
        problems += _param_problems(params)
    else:
        problems.append(f"optimizer.params: expected a mapping with lr (and optionally betas, eps), got {params!r}")
    where = source_of("optimizer", origins)
    raise_if_any(f"{problem}{where}" for problem in problems)
    floats = {name: [float(b) for b in value] if name == "betas" else float(value) for name, value in params.items()}
    return {"type": canonical, "params": floats}


def _without_legacy_fp16_flag(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Old GPT-NeoX files repeat `fp16: true` inside the fp16 section; DeepSpeed now rejects it."""
    section = dict(section)
    if "fp16" in section:
        legacy = section.pop("fp16")
        if section.setdefault("enabled", legacy) != legacy:
            enabled = section["enabled"]
            raise ConfigError(f"fp16: the fields fp16 ({legacy!r}) and enabled ({enabled!r}) disagree{where}")
    return section


def _deepspeed_model(name: str) -> type:
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return {"fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config, "zero_optimization": DeepSpeedZeroConfig}[name]


def check_deepspeed_section(name: str, section: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """Validate fp16, bf16 or zero_optimization with DeepSpeed's schema; return the section to pass on."""
    where = source_of(name, origins)
    if name == "fp16":
        section = _without_legacy_fp16_flag(section, where)
    if name in ("fp16", "bf16") and not isinstance(section.get("enabled", False), bool):
        raise ConfigError(f"{name}.enabled: expected true or false, got {section['enabled']!r}{where}")
    if not all(isinstance(field, str) for field in section):
        raise ConfigError(f"{name}: field names must be strings, got {list(section)!r}{where}")
    try:
        _deepspeed_model(name)(**section)
    except ValueError as error:  # pydantic's ValidationError lists each field's error
        details = error.errors() if hasattr(error, "errors") else [{"loc": (), "msg": str(error)}]
        raise_if_any(
            f"{'.'.join([name, *map(str, d['loc'])])}: {d['msg']}{where}" for d in details
        )
    return dict(section)
