"""One run per `save` directory: a second run writing the same checkpoints would silently replace the first's.

The run's rank 0 holds an exclusive `flock` on `SAVE/.lock` for as long as its process lives, and writes who
holds it (host, pid, start time, command) into the file. The kernel drops the lock when that process ends,
however it ends, so a lock left by a crashed or killed run is stale by construction: the next run takes it
and overwrites the holder. deepy.py probes the lock before starting any process, so a second run is refused
at once; the rank-0 lock closes the race between two launches. (flock works across NFS clients on Linux.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from megatron.checkpoint.work_split import is_rank_0, same_on_all_ranks
from megatron.config import ConfigError

LOCK_NAME = ".lock"
_held: dict[Path, IO[str]] = {}  # directories this process holds: a second Trainer of the process reuses


class SaveDirectoryInUse(ConfigError):
    """Another live process holds the save directory."""


def _holder(lock: IO[str]) -> str:
    lock.seek(0)
    try:
        holder = json.loads(lock.read() or "{}")
    except json.JSONDecodeError:
        holder = {}
    if not holder:
        return "another process (it wrote no details)"
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")


def _take(directory: Path) -> IO[str]:
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(lock)
        lock.close()
        raise SaveDirectoryInUse(f"save = {str(directory)!r} is in use by another run ({holder}); wait for it to "
                                 "end or stop it, or set save to another directory") from None
    return lock


def hold_save_directory(directory: str | Path, command: str) -> None:
    """Take `directory`'s lock for the rest of this process and record this process (running `command`, as a
    person would recognise it) as its holder; SaveDirectoryInUse naming the holder if a live process has it."""
    directory = Path(directory).resolve()
    if directory in _held:
        return
    lock = _take(directory)
    lock.truncate(0)
    lock.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command}))
    lock.flush()
    _held[directory] = lock


def hold_save_directory_for_the_run(directory: str | Path, command: str) -> None:
    """Collective: rank 0 holds `directory` (hold_save_directory); every rank raises the same
    SaveDirectoryInUse if it could not."""
    problem = None
    if is_rank_0():
        try:
            hold_save_directory(directory, command)
        except SaveDirectoryInUse as error:
            problem = str(error)
    problem = same_on_all_ranks(problem)
    if problem is not None:
        raise SaveDirectoryInUse(problem)


def check_save_directory_free(directory: str | Path) -> None:
    """SaveDirectoryInUse if a live process holds `directory` (taken and released at once: a probe)."""
    directory = Path(directory).resolve()
    if directory not in _held and (directory / LOCK_NAME).exists():
        _take(directory).close()
