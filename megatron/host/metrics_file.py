"""log_dir/metrics.jsonl as a file both sides write: rank 0's MetricsWriter (training/metrics.py) its records, and
deepy.py a "restart" record between two launches (launch/restarts.py), when no rank runs. Each appends whole lines:
a record a kill cut short is ended first, so that the next one is not glued to it (the next run drops it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE_NAME = "metrics.jsonl"


def ends_a_line(path: Path) -> bool:
    """Whether what is appended to `path` starts a line of its own (a new or empty file, or a last newline)."""
    if not path.is_file() or path.stat().st_size == 0:
        return True
    with open(path, "rb") as stream:
        stream.seek(-1, os.SEEK_END)
        return stream.read(1) == b"\n"


def append_record(log_dir: str, record: dict[str, Any]) -> None:
    """Append `record` to log_dir/metrics.jsonl as a whole line, from outside a run."""
    path = Path(log_dir) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record) + "\n"
    starts_a_line = ends_a_line(path)
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(line if starts_a_line else "\n" + line)
