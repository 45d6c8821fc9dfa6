"""eval_tasks against lm-eval's task index: the index eval.py runs with, and the names it does not know.

lm-eval indexes its thousands of built-in task files in tens of seconds, so they are indexed only when a task
is not one of eval_include_path's. deepy.py checks the names before launch; an unknown one would otherwise be a
KeyError inside every rank.
"""

from __future__ import annotations

import difflib
from typing import Any


def task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm-eval's TaskManager for `tasks`: eval_include_path's alone when it has them all."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def eval_task_problems(tasks: list[str], include_path: str | None) -> list[str]:
    """A line for each task name lm-eval does not know (with the closest it does); [] if all are known."""
    try:
        known = set(task_manager(tasks, include_path).all_tasks)
    except ImportError:
        return ["eval.py needs lm-eval: pip install -r requirements/requirements-eval.txt"]
    problems = []
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see `lm-eval --tasks list`"
            problems.append(f"eval_tasks: {task!r} is not a task lm-eval knows (nor one of eval_include_path's); "
                            f"{hint}")
    return problems
