"""The growth record: `growth.json` in a checkpoint's tag directory, saying what growth made of the model.

    {"format": 1,
     "grown_from": {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256},
     "norm_token_count": {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256},
     "iteration": 0,
     "source_sha256": "9f2c...",
     "frozen": {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256}}

`grown_from` is each kind of Pattention's token count before the last growth. Growth appends tokens, so
those are a Pattention's leading tokens, the ones `freeze_old_param_tokens` keeps fixed. `norm_token_count` is
the n of √n the grown checkpoint holds for each kind and `iteration` its iteration: where
norm_token_count_ramp_iters starts (growth/norm_ramp.py); every growth writes both (records of older versions
lack them), and so does a re-shard that restarts the iteration, so that a ramp never restarts from an earlier n.
`source_sha256` is the content digest (checkpoint/manifest.py) of the checkpoint the grow tool read: what the
model was last grown (or re-sharded) from, kept when that checkpoint is deleted. `frozen`, present
only in checkpoints saved by a run that froze tokens, is what that run froze: its optimizer state covers
only the other tokens. The grow tool writes the record; training carries it into every checkpoint it saves,
so a frozen run resumes frozen and a later growth knows the model's history. Other keys are kept as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from megatron.cli import InputError

GROWTH_RECORD = "growth.json"
FORMAT = 1


class GrowthRecordError(InputError):
    """A growth record that cannot be used, named with what is wrong."""


def _counts_problem(record: dict, key: str) -> str | None:
    counts = record.get(key)
    if key in ("frozen", "norm_token_count") and counts is None:
        return None
    if not isinstance(counts, dict) or not counts or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts.values()):
        return f"{key!r} must map slot keys (e.g. ffn_slot_num) to positive token counts, got {counts!r}"
    return None


def _check(record: Any, where: str) -> dict:
    if not isinstance(record, dict):
        raise GrowthRecordError(f"{where}: a growth record is a JSON object, got {type(record).__name__}")
    problems = [] if record.get("format") == FORMAT else [f"'format' must be {FORMAT}, got {record.get('format')!r}"]
    problems += [problem for key in ("grown_from", "frozen", "norm_token_count")
                 if (problem := _counts_problem(record, key))]
    digest = record.get("source_sha256")
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        problems.append(f"'source_sha256' must be a SHA-256 in hex, got {digest!r}")
    iteration = record.get("iteration", 0)
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        problems.append(f"'iteration' must be a non-negative integer, got {iteration!r}")
    if problems:
        raise GrowthRecordError(f"{where}: {'; '.join(problems)}. Restore the file the grow tool wrote, or "
                                f"remove it if the checkpoint was not grown")
    return record


def write_growth_record(tag_dir: Path, record: dict) -> None:
    """Write `record` (checked first) as `tag_dir`/growth.json."""
    path = Path(tag_dir) / GROWTH_RECORD
    _check(record, f"growth record for {path}")
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_growth_record(tag_dir: Path) -> dict | None:
    """The record in `tag_dir`, or None for a checkpoint that was not grown; GrowthRecordError if malformed."""
    path = Path(tag_dir) / GROWTH_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GrowthRecordError(f"{path} is not valid JSON ({error}). Restore the file the grow tool wrote, or "
                                "remove it if the checkpoint was not grown") from None
    return _check(record, str(path))


def old_token_count(record: dict, slot_key: str) -> int:
    """How many tokens the Pattentions whose count `slot_key` sets (e.g. "ffn_slot_num") had before growth."""
    if slot_key not in record["grown_from"]:
        raise GrowthRecordError(f"the growth record has no count for {slot_key} (it has "
                                f"{sorted(record['grown_from'])}); the grow tool records every slot key")
    return record["grown_from"][slot_key]
