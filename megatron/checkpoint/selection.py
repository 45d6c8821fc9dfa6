"""Which checkpoint a run resumes from, verified before DeepSpeed reads it.

The tag `latest` names is checked first: its manifest (every file's size and
SHA-256) and the screening of its pickles (safety.py), with the files
shared over all ranks. If it fails, the newest checkpoint that passes is used,
with a warning naming what was skipped and why; if none passes, the run stops
listing every problem rather than silently starting from scratch. Interrupted
saves (`.tmp-` directories) are reported as skipped, and so is a `latest` naming a
path outside the directory (a tag is a directory name in it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from megatron.checkpoint.commit import CHECKPOINT_TAG, LATEST, STAGING_PREFIX, is_tag_name, read_latest
from megatron.checkpoint.manifest import FileRecord, checkpoint_files, file_problems, read_manifest
from megatron.checkpoint.safety import CheckpointRefused, unpickling_problems
from megatron.checkpoint.work_split import is_rank_0, map_over_ranks, same_on_all_ranks

# Checkpoints this process found damaged while choosing where to resume: pruning never counts them as kept.
_refused: set[Path] = set()


def refused_at_resume() -> frozenset[Path]:
    return frozenset(_refused)


def _warn(message: str) -> None:
    if is_rank_0():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _newest_first(load_dir: Path) -> tuple[list[str], str | None]:
    """`latest`'s tag, then every global_stepN, highest N first; and why `latest` was not read, if it is damaged."""
    try:
        latest, damaged = read_latest(load_dir), None
    except ValueError as error:
        latest, damaged = None, str(error)
    named = [] if latest is None else [latest]
    steps = sorted(((int(m.group(1)), p.name) for p in load_dir.iterdir()
                    if (m := CHECKPOINT_TAG.match(p.name)) and p.is_dir()), reverse=True)
    return named + [tag for _, tag in steps if tag not in named], damaged


def holds_checkpoints(directory: Path) -> bool:
    """Whether `directory` is a save directory with something to resume or to report: `latest`, a global_stepN,
    or an interrupted save."""
    return directory.is_dir() and ((directory / LATEST).is_file() or any(
        CHECKPOINT_TAG.match(p.name.removeprefix(STAGING_PREFIX)) for p in directory.iterdir() if p.is_dir()))


def _one_file_problems(directory: Path, records: dict[str, FileRecord], name: str, hashed: bool = True) -> list[str]:
    return ((file_problems(directory, records[name], hashed=hashed) if name in records else [])
            or unpickling_problems(directory, name))


def _inventory(directory: Path) -> tuple[dict[str, FileRecord], list[str]] | str:
    """The manifest's records and the names of all files, or why they cannot be read."""
    if not directory.is_dir():
        return f"{directory} does not exist"
    try:
        records = {record.name: record for record in read_manifest(directory) or ()}
    except ValueError as error:
        return str(error)
    return records, sorted(set(records) | set(checkpoint_files(directory)))


def present_file_problems(directory: Path) -> list[str]:
    """Why `directory` cannot be resumed from as far as file names and sizes tell, without reading the files."""
    inventory = _inventory(directory)
    if isinstance(inventory, str):
        return [inventory]
    records, _ = inventory
    return [problem for record in records.values() for problem in file_problems(directory, record, hashed=False)]


def screened_file_problems(directory: Path) -> list[str]:
    """present_file_problems, and every pickle screened (safety.py) without hashing: what deepy.py checks before
    any process starts, so that a file the ranks would refuse stops the launch instead."""
    inventory = _inventory(directory)
    if isinstance(inventory, str):
        return [inventory]
    records, names = inventory
    return [problem for name in names for problem in _one_file_problems(directory, records, name, hashed=False)]


def verified_file_problems(directory: Path) -> list[str]:
    """screened_file_problems, and every file's SHA-256 against the manifest: checkpoint_problems' verdict, in
    this one process (files hashed side by side: hashlib releases the GIL)."""
    inventory = _inventory(directory)
    if isinstance(inventory, str):
        return [inventory]
    records, names = inventory
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        found = pool.map(partial(_one_file_problems, directory, records), names)
    return [problem for problems in found for problem in problems]


def checkpoint_problems(directory: Path) -> list[str]:
    """Collective: why `directory` cannot be resumed from ([] if it can)."""
    inventory = same_on_all_ranks(_inventory(directory))
    if isinstance(inventory, str):
        return [inventory]
    records, names = inventory
    return map_over_ranks(partial(_one_file_problems, directory, records), names)


def newest_usable_tag(load_dir: str | None,
                      problems_of: Callable[[Path], list[str]] = present_file_problems) -> tuple[str | None, list[str]]:
    """The newest checkpoint of `load_dir` that `problems_of` finds nothing wrong with (by default: judged by
    file names and sizes alone; None for a fresh run) and what was skipped, and why; CheckpointRefused listing
    every problem if there are checkpoints but none can be used."""
    if not load_dir or not Path(load_dir).is_dir():
        return None, []
    directory = Path(load_dir)
    candidates, damaged_latest = same_on_all_ranks(_newest_first(directory))
    skipped = [f"{p.name}: an interrupted save" for p in sorted(directory.glob(f"{STAGING_PREFIX}global_step*"))]
    if damaged_latest:
        skipped.append(f"{LATEST}: {damaged_latest}; not followed")
    for tag in candidates:
        if not is_tag_name(tag):
            skipped.append(f"{tag}: `{LATEST}` names it, but a checkpoint is a directory inside {directory} (such as "
                           "global_step5), not a path elsewhere; not followed")
            continue
        problems = problems_of(directory / tag)
        if not problems:
            return tag, skipped
        skipped.append(f"{tag}: {'; '.join(problems)}")
        _refused.add((directory / tag).resolve())
    if candidates or damaged_latest:
        raise CheckpointRefused(
            f"load={directory}: no checkpoint there can be resumed from:\n  " + "\n  ".join(skipped)
            + "\nRestore the damaged files, or move these checkpoints away to start from scratch.")
    return None, skipped


def tag_to_resume_before_launch(load_dir: str | None) -> tuple[str | None, list[str]]:
    """newest_usable_tag as deepy.py judges it before launch, so that what it says of the checkpoint (its
    iteration, the settings it changes, its fit to the model) is of the one the ranks will resume: files present
    with their sizes, every pickle screened. Contents are hashed only by the ranks (resume_tag), except where the
    decision not to launch rests on them (launch/preflight.py: nothing_left_to_train)."""
    return newest_usable_tag(load_dir, screened_file_problems)


def resume_tag(load_dir: str | None) -> str | None:
    """Collective: the tag to resume from, every file verified (SHA-256, pickles screened), None for a fresh
    run; CheckpointRefused if none can be used."""
    tag, skipped = newest_usable_tag(load_dir, checkpoint_problems)
    directory = Path(load_dir or "")
    if tag is None:
        if skipped:
            _warn(f"no complete checkpoint in {directory}; starting from scratch. Skipped:\n  " + "\n  ".join(skipped))
        elif load_dir and is_rank_0():
            print(f"load={directory} holds no checkpoint yet: this run starts at iteration 0", flush=True)
        return None
    if skipped:
        _warn(f"resuming from {tag} in {directory}; skipped:\n  " + "\n  ".join(skipped))
    if not (directory / LATEST).is_file():
        _warn(f"{directory} has no `{LATEST}` file; resuming from its newest complete checkpoint, {tag}")
    if read_manifest(directory / tag) is None:
        _warn(f"{directory / tag} has no manifest.json (written by an older version or another tool), "
              "so its files could not be verified")
    return tag
