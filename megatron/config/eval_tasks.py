"""eval_tasks against lm-eval's task index: the index eval.py runs with, the names it does not know, and data
that cannot be had here.

lm-eval indexes its thousands of built-in task files in seconds to tens of seconds, so they are indexed only
when a task is not one of eval_include_path's. deepy.py checks before launch that each name is known (otherwise
a KeyError in every rank) and that each task's dataset is local, in the datasets cache, or on a hub this machine
reaches (otherwise a 50-line traceback after minutes, offline).
"""

from __future__ import annotations

import difflib
import os
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


def eval_task_problems(tasks: list[str], include_path: str | None) -> list[str]:
    """A line for each task name lm-eval does not know (with the closest it does) and for each task whose
    dataset cannot be had here; [] if none."""
    try:
        index = task_manager(tasks, include_path).task_index
    except ImportError:
        return ["eval.py needs lm-eval: pip install -r requirements/requirements-eval.txt"]
    problems = []
    for task in tasks:
        if task not in index:
            close = difflib.get_close_matches(task, sorted(index), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see `lm-eval --tasks list`"
            problems.append(f"eval_tasks: {task!r} is not a task lm-eval knows (nor one of eval_include_path's); "
                            f"{hint}")
            continue
        dataset = (getattr(index[task], "cfg", None) or {}).get("dataset_path")  # groups have none of their own
        local = dataset is None or dataset in LOCAL_BUILDERS or Path(dataset).exists()
        if not (local or _cached(dataset) or _hub_reachable(dataset)):
            problems.append(f"eval_tasks: {task!r} reads the dataset {dataset!r} from the Hugging Face hub, which this "
                            f"machine does not reach, and it is not in the datasets cache; {OFFLINE_RECIPE}")
    return problems
