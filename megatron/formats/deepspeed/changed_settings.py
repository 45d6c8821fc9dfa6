"""Optimizer, data and batch keys a resumed run sets otherwise than the checkpoint's own run: warned, not refused.

A model key changed on resume is refused (compatibility.py): the weights would compute another function. A new
learning rate, weight decay, precision or dataset is a choice a person may make on purpose when continuing a
run, but made by accident (a shared config edited between two runs) it changes the run without a word. So
deepy.py names each such key, with the checkpoint's value and this run's, before any process starts. The keys
are the schema's "optimizer" and "data" groups, so a key added to either is covered; nested sections
(optimizer, zero_optimization, fp16, bf16) are compared entry by entry. Two more keys change what the data
position the checkpoint holds (the samples read) means, and their warning says how: seq_length (samples of
another length are cut and shuffled otherwise, so the position points at other text) and
train_micro_batch_size_per_gpu (the global batch, and so the text a step reads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron.checkpoint.safety import CheckpointRefused
from megatron.checkpoint.selection import tag_to_resume_before_launch
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


def _data_position_warnings(tag_dir: Path, saved: dict[str, Any], cfg: Config) -> list[str]:
    """The warnings for seq_length, seed and train_micro_batch_size_per_gpu changed (module docstring)."""
    warnings = []
    keep = "set it as in its config.json if that is not intended"
    before, after = saved.get("seq_length"), cfg.seq_length
    if before is not None and before != after:
        warnings.append(
            f"resuming {tag_dir} with seq_length changed: saved {before!r}, this run {after!r}. The data position it "
            f"holds counts samples of {before} tokens; samples of {after} are cut and shuffled otherwise, so from "
            "there the run reads other text than its saved run would have: some of it again, some never "
            f"({keep})")
    before, after = saved.get("seed"), cfg.seed
    if before is not None and before != after:
        warnings.append(
            f"resuming {tag_dir} with seed changed: saved {before!r}, this run {after!r}. The data order and the "
            "validation samples are drawn from the seed, so the data position it holds points at another order: "
            f"from there the run reads some text again, some never, and validates on other samples ({keep})")
    before, after = saved.get("train_micro_batch_size_per_gpu"), cfg.train_micro_batch_size_per_gpu
    if before is not None and before != after:
        batch, now = saved.get("train_batch_size"), cfg.train_batch_size
        if batch == now:
            effect = f"the global batch stays {now} sequences, so a step trains on the same text as before"
        else:
            effect = (f"a step now trains on {now} sequences instead of {batch}, while train_iters and the "
                      "learning-rate schedule count steps: the run reads another amount of text from here")
        warnings.append(f"resuming {tag_dir} with train_micro_batch_size_per_gpu changed: saved {before!r}, this run "
                        f"{after!r}; {effect} ({keep})")
    return warnings


def resume_warnings(cfg: Config) -> list[str]:
    """One line per optimizer or data key this training run changes from the checkpoint it resumes; [] for a
    fresh run, an evaluation, or a weights-only checkpoint (a warm start: a new optimizer and data are its point)."""
    if not cfg.load or cfg.eval_only:
        return []
    try:
        tag, _ = tag_to_resume_before_launch(cfg.load)  # the one the ranks will resume: screened
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
            "config.json if that is not intended)" for key, before, after in changed_settings(saved, cfg)
            ] + _data_position_warnings(tag_dir, saved, cfg)
