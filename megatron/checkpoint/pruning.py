"""keep_last_n_checkpoints: which older checkpoints a save deletes, and the damaged ones it sets aside.

Only checkpoints that can be resumed from count as kept. A damaged one (a file missing or of the wrong
size, or one this run's resume found corrupted) is renamed `global_stepN.damaged` (`.damaged-2`, ... where a
checkpoint of that iteration was set aside before), named in a warning and never deleted: it is not counted,
so the newest checkpoints that verify are the ones kept. A damaged one at the iteration a resumed run saves again
is set aside the same way before that save (`set_aside_if_damaged`), instead of being replaced and deleted. A
checkpoint's copies re-sharded for another layout (global_stepN-tp1pp1dp4, megatron/growth/reshard_on_resume.py)
are deleted with it, and never counted.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Collection
from pathlib import Path

from megatron.checkpoint.commit import CHECKPOINT_TAG, STAGING_PREFIX
from megatron.checkpoint.selection import present_file_problems, refused_at_resume
from megatron.checkpoint.work_split import is_rank_0

DAMAGED_SUFFIX = ".damaged"


def _damage(path: Path) -> str | None:
    if path.resolve() in refused_at_resume():
        return "it failed verification when this run chose where to resume"
    problems = present_file_problems(path)
    return "; ".join(problems) if problems else None


def _aside_name(path: Path) -> Path:
    """A free name to set `path` aside under: a run resumed from before an earlier damaged checkpoint may
    write, and damage, the same iteration again."""
    aside = path.with_name(path.name + DAMAGED_SUFFIX)
    copies = 1
    while aside.exists():
        copies += 1
        aside = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{copies}")
    return aside


def _set_aside(path: Path, why: str, outcome: str) -> None:
    aside = _aside_name(path)
    path.rename(aside)
    print(f"warning: {path.name} in {path.parent} cannot be resumed from ({why}); renamed to {aside.name}, kept "
          f"{outcome}", file=sys.stderr, flush=True)


def set_aside_if_damaged(save_dir: Path, tag: str) -> None:
    """Rank 0, before saving `tag`: a damaged checkpoint under that name (a run resumed from before it reaches
    its iteration again) is set aside, so that saving anew does not delete the evidence."""
    path = save_dir / tag
    if not is_rank_0() or not path.is_dir():
        return
    why = _damage(path)
    if why is not None:
        _set_aside(path, why, f"while this run saves {tag} anew")


def delete_old_checkpoints(save_dir: Path, keep: int, newest: int, lineage: Collection[int] = ()) -> None:
    """Rank 0, after `global_step{newest}` was committed: keep the `keep` newest checkpoints up to it that can be
    resumed from, set damaged ones aside, delete the rest. Those at the `lineage` iterations (the models before a
    scheduled growth, growth/schedule.py) are neither counted nor deleted. Later ones (left by a run this one
    resumed from an earlier point of) are not ours to judge. Each is renamed out of sight before it is deleted, so
    a kill mid-delete leaves no half checkpoint under a visible name."""
    if not is_rank_0():
        return
    steps = sorted((int(m.group(1)), path) for path in save_dir.iterdir()
                   if (m := CHECKPOINT_TAG.match(path.name)) and path.is_dir() and int(m.group(1)) <= newest)
    usable = []
    for step, path in steps:
        why = None if step == newest else _damage(path)  # the newest was just written and verified by commit
        if why is None:
            usable.append((step, path))
        else:
            _set_aside(path, why, f"and not counted among keep_last_n_checkpoints={keep}")
    counted = [path for step, path in usable if step not in lineage]
    for path in counted[:-keep]:
        for gone in [path, *save_dir.glob(f"{path.name}-tp*pp*dp*")]:  # and its copies re-sharded on resume
            doomed = gone.with_name(f"{STAGING_PREFIX}deleted-{gone.name}")
            gone.rename(doomed)
            shutil.rmtree(doomed)
