"""Make a checkpoint visible only once every rank's files are complete.

    SAVE/.tmp-global_stepN/                 engine.save_checkpoint(save_latest=False), rng states, config.json
    SAVE/.tmp-global_stepN/manifest.json    after a barrier: each file's size and SHA-256, hashed by all ranks
    SAVE/global_stepN/                      one atomic rename
    SAVE/latest                             then replaced atomically (write, fsync, rename)
    older global_stepM/                     deleted beyond keep_last_n_checkpoints only now (pruning.py)

A SIGKILL at any moment leaves `latest` naming a complete checkpoint. An
interrupted save leaves a `.tmp-` directory, which the next save removes and a
resume reports as skipped.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from megatron.checkpoint.manifest import (
    FileRecord,
    checkpoint_files,
    record_file,
    sync_directory,
    write_durably,
    write_manifest,
)
from megatron.checkpoint.work_split import barrier, is_rank_0, map_over_ranks, same_on_all_ranks
from megatron.cli import InputError

STAGING_PREFIX = ".tmp-"
LATEST = "latest"
CHECKPOINT_TAG = re.compile(r"^global_step(\d+)$")


def committed_tags(directory: Path) -> list[tuple[int, Path]]:
    """(N, path) of every global_stepN directory in `directory` (usable or not), highest N first."""
    if not directory.is_dir():
        return []
    return sorted(((int(match.group(1)), path) for path in directory.iterdir()
                   if (match := CHECKPOINT_TAG.match(path.name)) and path.is_dir()), reverse=True)


def is_tag_name(name: str) -> bool:
    """Whether `name`, as read from `latest`, can name a checkpoint: one directory name inside the save directory,
    not a path leading elsewhere (`../other_run/global_step5`, `/etc`)."""
    return name not in ("", ".", "..") and Path(name).name == name


def read_latest(save_dir: Path) -> str | None:
    """The tag `save_dir/latest` names, None without one; ValueError naming the file when it is empty or does not
    hold text (damaged: a disk error, another program's write), which no checkpoint's name can be."""
    marker = save_dir / LATEST
    if not marker.is_file():
        return None
    held = marker.read_bytes()
    try:
        tag = held.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InputError(f"{marker} is damaged: it holds {held[:32]!r}{'...' if len(held) > 32 else ''}, not a "
                         "checkpoint's name such as global_step5") from None
    if not tag:
        raise ValueError(f"{marker} is empty (a write cut short, or emptied by hand), not a checkpoint's name such "
                         "as global_step5")
    return tag


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched."""


def staging_directory(save_dir: Path, tag: str) -> Path:
    return save_dir / f"{STAGING_PREFIX}{tag}"


def remove_interrupted_saves(save_dir: Path) -> None:
    """Collective: rank 0 deletes what earlier interrupted saves left behind."""
    if is_rank_0() and save_dir.is_dir():
        for leftover in save_dir.glob(f"{STAGING_PREFIX}*"):
            if leftover.is_dir():
                shutil.rmtree(leftover)
    barrier()


@contextmanager
def reporting_write_failures(save_dir: Path, tag: str) -> Iterator[None]:
    """Turn a failed write (disk full, quota, I/O error) into one clear error and drop the partial files."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        free_mb = shutil.disk_usage(save_dir).free / 2**20 if save_dir.is_dir() else 0.0
        shutil.rmtree(staging_directory(save_dir, tag), ignore_errors=True)
        cause = error
        while cause.__context__ is not None:  # the first error of the chain; later ones come from cleaning up
            cause = cause.__context__
        try:
            previous = read_latest(save_dir) or "none"
        except ValueError:
            previous = "the one before, `latest` being damaged"
        raise CheckpointWriteError(
            f"could not save checkpoint {tag} in {save_dir} ({free_mb:.1f} MB free there): "
            f"{(str(cause).strip() or type(cause).__name__).splitlines()[0]}. The previous checkpoint ({previous}) "
            "is untouched; make room or set save to another directory, then resume."
        ) from error


def commit(save_dir: Path, tag: str, known: Mapping[str, FileRecord] | None = None) -> Path:
    """Collective, after every rank wrote its files into the staging directory: manifest, rename, `latest`.
    `known`: records of files hashed as they were written (RecordedFile), which are not read again."""
    staging = staging_directory(save_dir, tag)
    barrier()
    files = same_on_all_ranks(checkpoint_files(staging))
    records = map_over_ranks(partial(record_file, staging, known=known), files)
    final = save_dir / tag
    if is_rank_0():
        write_manifest(staging, records)
        _replace_directory(staging, final)
        write_durably(save_dir / LATEST, tag)
    barrier()
    return final


def _replace_directory(source: Path, target: Path) -> None:
    """Rename `source` to `target`; an existing `target` (the same iteration saved again after resuming
    from an earlier checkpoint; a damaged one was set aside before the save, pruning.py) is moved out of sight
    first and deleted after."""
    replaced = target.with_name(f"{STAGING_PREFIX}replaced-{target.name}")
    if target.exists():
        target.rename(replaced)
    source.rename(target)
    sync_directory(target.parent)
    shutil.rmtree(replaced, ignore_errors=True)
