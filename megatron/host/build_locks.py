"""Build locks in DeepSpeed's op cache: a leftover is removed, a lock that may be live on any host is not.

torch's FileBaton (torch/utils/cpp_extension.py) creates `NAME/lock` in TORCH_EXTENSIONS_DIR while one process
compiles an op, holds it open, and removes it after; every other process waits for the file to go. A start
interrupted mid-build leaves it behind and every later start would wait forever, so deepy.py removes leftovers
before it launches. The cache is the Python environment's (extension_cache.py), on a cluster often a shared file
system, where a build on another node, or by another user, holds the lock open where this host's /proc cannot
see it: removing that lock would let two builds write one folder. So a lock is removed only when it is stale
on every host:

- no process of this user on this host holds it open (/proc/PID/fd shows every one of them), and
- no process of this environment may be building it elsewhere: either none is alive on another host or as
  another user (every rank holds a shared lock on `CACHE/.build-claim-UID@HOST` from its start, before anything
  compiles, for its whole life), or the lock file itself is older than LOCK_CLAIM_SECONDS and unlocked (a rank
  that creates a build lock also holds a shared lock on it while it builds);

or when it is older than MAX_BUILD_SECONDS by the file system's own clock (torch never touches it while
building). The kernel (for NFS, the server) drops a process's locks however it ends, so a lock that can be
placed proves that no holder lives. The locks are POSIX record locks (fcntl), which NFS implements itself (its
flock is emulated by them, and rejects a shared flock on a file opened for writing only, or an exclusive one on
a file opened for reading only): a shared lock on a file opened for reading, probed with F_GETLK, which places
nothing and needs no write access to another user's claim. A file system without such locks proves nothing
but by age. deepy.py waits, saying so once, for a lock that may be another host's live build, until it goes or
one of these proves it stale; a lock held open on this host is a build here, which the ranks wait for.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

CLAIM_PREFIX = ".build-claim-"
MAX_BUILD_SECONDS = 3600.0  # far beyond any op's build on a CPU
LOCK_CLAIM_SECONDS = 60.0  # far beyond the moment between a build lock's creation and its builder's lock on it
POLL_SECONDS = 5.0
_claims: dict[Path, int] = {}  # caches this process holds its claim on (a descriptor), for its life
_FLOCK = "hhqqi"  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid


def _claim_name() -> str:
    return f"{CLAIM_PREFIX}{os.getuid()}@{socket.gethostname()}"


def _lock_shared(descriptor: int) -> bool:
    """A shared POSIX lock on the whole file, held until the process ends or closes the file; whether placed."""
    try:
        fcntl.lockf(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _locked_by_another(path: Path) -> bool | None:
    """Whether another process holds a lock on `path`; None where that cannot be told (unreadable, no locks)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        (kind, *_) = struct.unpack(_FLOCK, fcntl.fcntl(descriptor, fcntl.F_GETLK, query))
    except OSError:
        return None
    finally:
        os.close(descriptor)
    return kind != fcntl.F_UNLCK


def hold_build_claim(cache: Path) -> None:
    """Hold this process's claim on `cache` (module docstring) for the rest of its life, and lock each build lock
    it creates while it builds; call it before anything may compile. A cache this process cannot write, or a
    file system without locks, takes no claim: nothing compiles into the first, and the second proves nothing
    stale but by age."""
    if cache in _claims:
        return
    _lock_the_builds_this_process_starts()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        claim = os.open(cache / _claim_name(), os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return
    if not _lock_shared(claim):
        os.close(claim)
        return
    _claims[cache] = claim


def _lock_the_builds_this_process_starts() -> None:
    """torch's FileBaton, from now on in this process, holds a shared lock on the build lock it creates (its own
    descriptor, opened for reading), until it closes it when the build ends."""
    from torch.utils.file_baton import FileBaton

    if getattr(FileBaton.try_acquire, "locks_the_build", False):
        return
    create = FileBaton.try_acquire

    def try_acquire(self) -> bool | None:
        created = create(self)
        if created:
            _lock_shared(self.fd)
        return created

    try_acquire.locks_the_build = True  # type: ignore[attr-defined]
    FileBaton.try_acquire = try_acquire


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
    return [path.name.removeprefix(CLAIM_PREFIX) for path in sorted(cache.glob(f"{CLAIM_PREFIX}*"))
            # this user's processes here: their open files are seen directly
            if path.name != _claim_name() and _locked_by_another(path) is not False]


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
                age = _age_seconds(judged, lock.parent)
            except FileNotFoundError:
                continue  # its build ended meanwhile
            unclaimed = age > LOCK_CLAIM_SECONDS and _locked_by_another(lock) is False
            if age > MAX_BUILD_SECONDS or not elsewhere or unclaimed:
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
