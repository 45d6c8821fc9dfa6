"""The validated configuration object every part of the framework reads.

A `Config` only exists in a valid state: building one runs every load-time
check and derivation, and it is read-only afterwards except for
`padded_vocab_size`, which the tokenizer fills in when a run starts. The
launcher ships it to each rank as JSON, where it is validated again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from megatron.config.derive import derive
from megatron.config.schema import SCHEMA, defaults
from megatron.config.sections import check_deepspeed_section, check_optimizer
from megatron.config.validate import (
    ConfigError,
    check_keys,
    check_required,
    check_rules,
    closest_key,
    normalize_keys,
)

_SETTABLE_AFTER_LOAD = ("padded_vocab_size",)


def _no_such_key(name: str) -> AttributeError:
    guess = closest_key(name)
    return AttributeError(f"Config has no key {name!r}" + (f"; did you mean {guess!r}?" if guess else ""))


def _resolve(raw: Any, world_size: int | None, origins: Mapping[str, str]) -> dict[str, Any]:
    """Defaults, checks and derived values, in the order each step needs."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of keys to values, got {type(raw).__name__}")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
    values = {**defaults(), **check_keys(normalize_keys(copy.deepcopy(raw), "config"), origins)}
    check_required(values)
    values["optimizer"] = check_optimizer(values["optimizer"], origins)
    for name in ("fp16", "bf16", "zero_optimization"):
        if values[name] is not None:
            values[name] = check_deepspeed_section(name, values[name], origins)
    values = derive(values, world_size)
    check_rules(values)
    return values


class Config:
    """Validated configuration with one attribute per key of docs/config.md.

    `Config(d, world_size, origins)` is the same as `Config.from_dict`; `origins`
    maps keys to where they came from, for error messages.
    """

    __slots__ = ("_values",)

    def __init__(
        self, values: Mapping[str, Any], world_size: int | None = None, origins: Mapping[str, str] | None = None
    ) -> None:
        object.__setattr__(self, "_values", _resolve(values, world_size, origins or {}))

    @classmethod
    def from_dict(
        cls, values: Mapping[str, Any], world_size: int | None = None, origins: Mapping[str, str] | None = None
    ) -> Config:
        """Validate `values` (keys as in the YAML files) into a Config."""
        return cls(values, world_size, origins)

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Inverse of to_json(); validates again."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"the config JSON is not valid JSON: {error}") from None
        return cls(values, origins={name: "the JSON config" for name in values} if isinstance(values, dict) else {})

    def to_dict(self) -> dict[str, Any]:
        """Every key, including derived ones, as plain JSON-compatible values."""
        return copy.deepcopy(self._values)

    def to_json(self) -> str:
        return json.dumps(self._values, sort_keys=True)

    def format(self) -> str:
        """Sorted 'key ..... value' lines for printing once at start-up."""
        width = max(map(len, self._values)) + 3
        lines = []
        for name in sorted(self._values):
            value = self._values[name]
            if name == "config_files" and value:
                value = sorted(value)
            lines.append(f"  {name} {'.' * (width - len(name))} {json.dumps(value)}")
        return "\n".join(lines)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            value = self._values[name]
        except KeyError:
            raise _no_such_key(name) from None
        return copy.deepcopy(value) if isinstance(value, (dict, list)) else value

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTABLE_AFTER_LOAD:
            self._values[name] = check_keys({name: value}, {})[name]
        elif name in SCHEMA:
            raise AttributeError(
                f"{name} is read-only once the config is validated; "
                f"set it in a config file or as an override {name}=VALUE"
            )
        else:
            raise _no_such_key(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._values == other._values

    __hash__ = None  # padded_vocab_size can still change

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return Config.from_json, (self.to_json(),)

    def __repr__(self) -> str:
        return f"Config(num_layers={self.num_layers}, hidden_size={self.hidden_size}, world_size={self.world_size})"
