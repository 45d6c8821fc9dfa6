"""Optimizer and data keys a resumed run sets otherwise than the checkpoint's own run: warned, not refused.

A model key changed on resume is refused (compatibility.py): the weights would compute another function. A new
learning rate, weight decay, precision or dataset is a choice a person may make on purpose when continuing a
run, but made by accident (a shared config edited between two runs) it changes the run without a word. So
deepy.py names each such key, with the checkpoint's value and this run's, before any process starts. The keys
are the schema's "optimizer" and "data" groups, so a key added to either is covered; nested sections
(optimizer, zero_optimization, fp16, bf16) are compared entry by entry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import newest_usable_tag
from megatron.config import Config
from megatron.config.schema import SCHEMA
from megatron.formats.deepspeed.compatibility import holds_weights_only
from megatron.model.args import ARCHITECTURE_KEYS

WARNED_GROUPS = ("optimizer", "data")
# How the data is read, not which: the same run with more or fewer loader processes.
UNWARNED = {"num_workers"}
WARNED_KEYS = tuple(name for name, key in SCHEMA.items()
                    if key.group in WARNED_GROUPS and name not in ARCHITECTURE_KEYS and name not in UNWARNED)


def _flatten(name: str, value: Any) -> dict[str, Any]:
    """{'optimizer.params.lr': 0.005, ...} for a nested section; {name: value} otherwise."""
    if isinstance(value, dict) and value:
        return {flat: inner for key, item in value.items() for flat, inner in _flatten(f"{name}.{key}", item).items()}
    return {name: value}


def _plain(value: Any) -> Any:
    """The value as config.json holds it (tuples as lists), so that only a real difference counts."""
    return json.loads(json.dumps(value))


def changed_settings(saved: dict[str, Any], cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, this run's value) for every warned key `saved` (a config.json) holds with another value;
    a key config.json lacks (an older checkpoint) is not compared."""
    changes = []
    for name in WARNED_KEYS:
        if name not in saved:
            continue
        before, after = _flatten(name, _plain(saved[name])), _flatten(name, _plain(getattr(cfg, name)))
        changes += [(key, before.get(key), after.get(key)) for key in sorted(before.keys() | after.keys())
                    if before.get(key) != after.get(key)]
    return changes


def resume_warnings(cfg: Config) -> list[str]:
    """One line per optimizer or data key this training run changes from the checkpoint it resumes; [] for a
    fresh run, an evaluation, or a weights-only checkpoint (a warm start: a new optimizer and data are its point)."""
    if not cfg.load or cfg.eval_only:
        return []
    try:
        tag, _ = newest_usable_tag(cfg.load)
    except CheckpointRefused:
        return []  # the preflight names it
    if tag is None:
        return []
    tag_dir = Path(cfg.load) / tag
    path = tag_dir / "config.json"
    if not path.is_file() or holds_weights_only(tag_dir):
        return []
    saved = json.loads(path.read_text(encoding="utf-8"))
    return [f"resuming {tag_dir} with {key} changed: saved {before!r}, this run {after!r} (set it as in its "
            "config.json if that is not intended)" for key, before, after in changed_settings(saved, cfg)]
