"""Read GPT-NeoX style YAML config files and command-line overrides into a Config.

Files are merged left to right: a key in a later file replaces the earlier
value, and a mapping value such as `optimizer` is replaced whole, not merged.
Top-level keys may be spelled with '-' or '_' (`tokenizer-type` is
`tokenizer_type`).

Overrides are strings `key=value` applied after all files. The value is parsed
as YAML, so it gets the same types as in a file:

    train_iters=100                          -> int
    lr_decay_style=cosine, data_path=/x/y    -> str
    warmup=0.02, min_lr=1e-5                 -> float
    optimizer={type: Adam, params: {lr: 0.001}}   -> mapping (replaces optimizer whole)
    extra_save_iters=[10, 20]                -> list
    wandb_group=null                         -> unset

Numbers such as `1e-5` are floats here (YAML 1.2), unlike plain PyYAML.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from megatron.config.config import Config
from megatron.config.validate import ConfigError, normalize_keys


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first_line: int, second_line: int) -> None:
        super().__init__(f"key {key!r} is given twice, on lines {first_line} and {second_line}; keep one of them "
                         "(YAML would silently keep the second)")


class _NoSpaceAfterColon(yaml.YAMLError):
    def __init__(self, key: str, line: int) -> None:
        name, _, value = key.partition(":")
        super().__init__(f"{key!r} on line {line} reads as one key with no value: YAML needs a space after the "
                         f"colon ({{{name}: {value}}})")


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _ConfigYamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent-only numbers like 1e-5 as floats, and refuses a key given twice in
    one mapping (PyYAML keeps the last one silently) and a flow-style `{key:value}` (one key, no value). Merge
    keys (`<<: *base`) are flattened by SafeLoader: the keys they bring may be given again, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                continue  # normalize_keys names a key that is not a string
            if node.flow_style and ":" in key and value_node.tag.endswith(":null") and not value_node.value:
                raise _NoSpaceAfterColon(key, key_node.start_mark.line + 1)
            if key in lines:
                raise _DuplicateKey(key, lines[key], key_node.start_mark.line + 1)
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


_ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_ConfigYamlLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source} is not valid YAML: {error}") from None


def read_yaml(path: Path, what: str, error: type[ConfigError] = ConfigError) -> tuple[str, Any]:
    """The text of the YAML file `path` and what it holds; `error` naming the file (`what` it is) if it is
    missing or unreadable, ConfigError if it is not YAML."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as problem:
        raise error(f"{what} {path} cannot be read: {problem}") from None
    return text, parse_yaml(text, f"{what} {path}")


def _read_file(path: Path) -> tuple[str, dict[str, Any]]:
    """The file's text and its top-level mapping with normalized keys."""
    text, content = read_yaml(path, "config file")
    if content is None:
        return text, {}
    if not isinstance(content, dict):
        kind = type(content).__name__
        raise ConfigError(f"config file {path} must contain a mapping of keys to values, got a {kind}")
    return text, normalize_keys(content, f"config file {path}")


def parse_override(override: str) -> tuple[str, Any]:
    """'key=value' -> (key with '_', value parsed as YAML)."""
    key, separator, value = override.partition("=")
    if not separator or not key.strip():
        raise ConfigError(f"override {override!r} must look like key=value, e.g. train_iters=100")
    source = f"override {override!r}"
    return next(iter(normalize_keys({key.strip(): parse_yaml(value, source)}, source).items()))


def load_config(
    paths: str | Path | Iterable[str | Path],
    overrides: Iterable[str] = (),
    world_size: int | None = None,
) -> Config:
    """Merge YAML files left to right, apply `key=value` overrides, validate.

    `world_size` (total processes) completes the batch-size arithmetic; None
    skips only the checks that need the data-parallel size.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise ConfigError("no config files given; pass at least one YAML file")
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    files: dict[str, str] = {}
    for path in map(Path, paths):
        text, content = _read_file(path)
        files[str(path)] = text
        merged.update(content)
        origins.update(dict.fromkeys(content, str(path)))
    for override in overrides:
        key, value = parse_override(override)
        merged[key] = value
        origins[key] = f"override {override!r}"
    merged["config_files"] = files
    return Config.from_dict(merged, world_size, origins)


def values_set(paths: Iterable[str | Path]) -> dict[str, Any]:
    """The top-level values config files `paths` set themselves, the later file's where two set a key."""
    merged: dict[str, Any] = {}
    for path in paths:
        merged.update(_read_file(Path(path))[1])
    return merged


def keys_set(paths: str | Path | Iterable[str | Path], overrides: Iterable[str] = ()) -> set[str]:
    """The keys config files `paths` and `overrides` set themselves: every other key of their Config is the
    schema's default (so a note can say that a default, not the user, chose a value)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return {key for path in map(Path, paths) for key in _read_file(path)[1]} | {
        parse_override(override)[0] for override in overrides}
