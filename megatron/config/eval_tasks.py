"""eval_tasks against lm-eval's task index: the index eval.py runs with, the names it does not know, and data
that cannot be had here.

Indexing lm-eval's thousands of built-in task files is slow, so they are indexed only when a task is not one
of eval_include_path's. deepy.py checks before launch that each name is known (otherwise a KeyError in every
rank) and that each task's dataset is local, in the datasets cache, or on a hub this machine reaches (otherwise
a long traceback, late, offline). A name that appears in none of the task files, read as plain text (much
quicker than the index), is refused at once, before lm-eval is imported or its index built.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import urllib.request
from pathlib import Path
from typing import Any

# datasets' packaged builders: their data are the task's own data_files
LOCAL_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder"}
OFFLINE_RECIPE = ('make it a local task (docs/inference.md, "Offline / local datasets"), or copy the datasets '
                  "cache from a machine with network")


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager for `tasks`: eval_include_path's alone when it has them all."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def _huggingface_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")


def _cached(dataset_path: str) -> bool:
    """Whether `dataset_path` (a hub id) is in datasets' cache or the hub's download cache."""
    datasets = Path(os.environ.get("HF_DATASETS_CACHE") or _huggingface_home() / "datasets")
    hub = Path(os.environ.get("HF_HUB_CACHE") or _huggingface_home() / "hub")
    return ((datasets / dataset_path.replace("/", "___")).exists()
            or (hub / f"datasets--{dataset_path.replace('/', '--')}").exists())


def _hub_reachable(dataset_path: str) -> bool:
    if "1" in (os.environ.get("HF_DATASETS_OFFLINE"), os.environ.get("HF_HUB_OFFLINE")):
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        request = urllib.request.Request(f"{endpoint}/api/datasets/{dataset_path}", method="HEAD")
        with urllib.request.urlopen(request, timeout=10):
            return True
    except (OSError, ValueError):
        return False


# In a task file: the names it declares (task:, group:, tag:, and the entries of their lists), for a hint.
_DECLARED = re.compile(r"^\s*(?:-\s*|(?:task|group|tag)\s*:\s*)['\"]?([\w.\-]+)", re.MULTILINE)
_WORD = re.compile(r"[^\s:'\"\[\],{}#]+")
_NOT_TASK_FILES = (".py", ".pyc", ".md")


def _names_in_task_files(include_path: str | None) -> tuple[set[str], set[str]] | None:
    """Every word of lm-eval's task files and eval_include_path's, which holds every task, group and tag name
    its index finds (some are declared in templates without a .yaml suffix), and the names they declare; read
    as text, without importing lm-eval. None if lm-eval is not installed."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    roots = [Path(next(iter(spec.submodule_search_locations))) / "tasks"]
    if include_path is not None and Path(include_path).is_dir():
        roots.append(Path(include_path))
    words: set[str] = set()
    declared: set[str] = set()
    for root in roots:
        for path in root.rglob("*"):
            if path.suffix in _NOT_TASK_FILES or "__pycache__" in path.parts or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            words.update(_WORD.findall(text))
            declared.update(_DECLARED.findall(text))
    return words, declared


def _unknown_task(task: str, names: set[str]) -> str:
    close = difflib.get_close_matches(task, sorted(names), n=1)
    hint = f"did you mean {close[0]!r}?" if close else "see `lm-eval --tasks list`"
    return f"eval_tasks: {task!r} is not a task lm-eval knows (nor one of eval_include_path's); {hint}"


def eval_task_problems(tasks: list[str], include_path: str | None) -> list[str]:
    """A line for each task name lm-eval does not know (with the closest it does) and for each task whose
    dataset cannot be had here; [] if none. Names in no task file are refused before lm-eval's index is built."""
    found = _names_in_task_files(include_path)
    if found is None:
        return ["eval.py needs lm-eval: pip install -r requirements/requirements-eval.txt"]
    words, declared = found
    if unknown := [task for task in tasks if task not in words]:
        return [_unknown_task(task, declared) for task in unknown]
    try:
        index = task_manager(tasks, include_path).task_index
    except ImportError:
        return ["eval.py needs lm-eval: pip install -r requirements/requirements-eval.txt"]
    problems = []
    for task in tasks:
        if task not in index:
            problems.append(_unknown_task(task, set(index)))
            continue
        dataset = (getattr(index[task], "cfg", None) or {}).get("dataset_path")  # groups have none of their own
        local = dataset is None or dataset in LOCAL_BUILDERS or Path(dataset).exists()
        if not (local or _cached(dataset) or _hub_reachable(dataset)):
            problems.append(f"eval_tasks: {task!r} reads the dataset {dataset!r} from the Hugging Face hub, which this "
                            f"machine does not reach, and it is not in the datasets cache; {OFFLINE_RECIPE}")
    return problems
