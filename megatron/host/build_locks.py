"""Build locks in DeepSpeed's op cache: a leftover is removed, a lock that may be live on any host is not.

torch's FileBaton (torch/utils/cpp_extension.py) creates `NAME/lock` in TORCH_EXTENSIONS_DIR while one process
compiles an op, holds it open, and removes it after; every other process waits for the file to go. A start
interrupted mid-build leaves it behind and every later start would wait forever, so deepy.py removes leftovers
before it launches. The cache is the Python environment's (extension_cache.py), on a cluster often a shared file
system, where a build on another node, or by another user, holds the lock open where this host's /proc cannot
see it: removing that lock would let two builds write one folder. So a lock is removed only when it is stale
on every host:

- no process of this user on this host holds it open (/proc/PID/fd shows every one of them), and
- no process of this environment is alive on another host or as another user: every rank holds a shared flock
  on `CACHE/.build-claim-UID@HOST` from its start, before anything compiles, for its whole life, and the kernel
  (for NFS, the server) drops it however the process ends, so an exclusive flock taken there proves that none
  lives (a file system without flock proves nothing);

or when it is older than MAX_BUILD_SECONDS by the file system's own clock (torch never touches it while
building). deepy.py waits, saying so once, for a lock that may be another host's live build, until it goes
or one of these proves it stale; a lock held open on this host is a build here, which the ranks wait for.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

CLAIM_PREFIX = ".build-claim-"
MAX_BUILD_SECONDS = 3600.0  # far beyond any op's build (1-5 minutes on a CPU)
POLL_SECONDS = 5.0
_claims: dict[Path, IO[str]] = {}  # caches this process holds its claim on, for its life


def _claim_name() -> str:
    return f"{CLAIM_PREFIX}{os.getuid()}@{socket.gethostname()}"


def hold_build_claim(cache: Path) -> None:
    """Hold this process's claim on `cache` (module docstring) for the rest of its life; call it before
    anything may compile. A cache this process cannot write, or a file system without flock, takes no claim:
    nothing compiles into the first, and the second proves nothing stale but by age."""
    if cache in _claims:
        return
    try:
        cache.mkdir(parents=True, exist_ok=True)
        claim = open(cache / _claim_name(), "a", encoding="utf-8")  # noqa: SIM115 - held for the process's life
    except OSError:
        return
    try:
        fcntl.flock(claim, fcntl.LOCK_SH)
    except OSError:
        claim.close()
        return
    _claims[cache] = claim


def _open_files() -> set[str]:
    """Every file this user's live processes hold open (others' are unreadable)."""
    held = set()
    for fd_directory in Path("/proc").glob("[0-9]*/fd"):
        try:
            held.update(os.readlink(link) for link in fd_directory.iterdir())
        except OSError:
            continue  # ended meanwhile, or another user's
    return held


def _live_claims_elsewhere(cache: Path) -> list[str]:
    """UID@HOST of each claim on `cache`, other than this user's on this host, that a live process may hold."""
    live = []
    for path in sorted(cache.glob(f"{CLAIM_PREFIX}*")):
        if path.name == _claim_name():
            continue  # this user's processes here: their open files are seen directly
        try:
            with open(path, encoding="utf-8") as claim:
                fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held, or unprovable (no flock there, unreadable)
            live.append(path.name.removeprefix(CLAIM_PREFIX))
    return live


def _age_seconds(lock: os.stat_result, folder: Path) -> float:
    """How old a lock is by the clock of the file system it is on (a shared one's server sets mtimes)."""
    with tempfile.TemporaryFile(dir=folder) as probe:
        return os.fstat(probe.fileno()).st_mtime - lock.st_mtime


def _remove_if_unchanged(lock: Path, judged: os.stat_result) -> bool:
    """Remove `lock` if it is still the file judged stale (not a new build's lock made meanwhile)."""
    try:
        now = lock.stat()
    except FileNotFoundError:
        return False
    if (now.st_ino, now.st_mtime_ns) != (judged.st_ino, judged.st_mtime_ns):
        return False
    lock.unlink(missing_ok=True)
    return True


def _build_locks(cache: Path) -> list[Path]:
    # CACHE/NAME/lock where TORCH_EXTENSIONS_DIR is set, CACHE/pyXY_cpu/NAME/lock under torch's default
    found = [*cache.glob("*/lock"), *cache.glob("*/*/lock")] if cache.is_dir() else []
    return [path for path in found if path.is_file()]


def remove_stale_build_locks(cache: Path, poll_seconds: float = POLL_SECONDS) -> list[Path]:
    """Remove each build `lock` under `cache` that is stale on every host (module docstring), waiting for those
    that may be a live build elsewhere; the removed ones are named on stderr and returned."""
    removed: list[Path] = []
    announced: set[Path] = set()
    while True:
        held_here = _open_files()
        locks = [path for path in _build_locks(cache) if str(path.resolve()) not in held_here]
        elsewhere = _live_claims_elsewhere(cache) if locks else []
        waiting = False
        for lock in locks:
            try:
                judged = lock.stat()
                old = _age_seconds(judged, lock.parent) > MAX_BUILD_SECONDS
            except FileNotFoundError:
                continue  # its build ended meanwhile
            if old or not elsewhere:
                if _remove_if_unchanged(lock, judged):
                    removed.append(lock)
                    print(f"removed {lock}: left by a start that was interrupted while compiling (no process on any "
                          "host may hold it); the op is built again", file=sys.stderr, flush=True)
                continue
            waiting = True
            if lock not in announced:
                announced.add(lock)
                print(f"waiting for {lock}: a process of this environment runs as {', '.join(elsewhere)}, where a "
                      f"build may hold it; it goes when that build ends, and is removed once no such process is "
                      f"alive or it is {MAX_BUILD_SECONDS / 60:.0f} minutes old", file=sys.stderr, flush=True)
        if not waiting:
            return removed
        time.sleep(poll_seconds)
