"""Index arrays cached as ``.npy`` files beside the data: built once, then memory-mapped by every rank and job.

Rank 0 builds what is missing while the other ranks wait at a barrier. The
build itself runs under an exclusive file lock and writes each file under a
unique temporary name before renaming it, so concurrent jobs (or ranks of a
job whose nodes do not share the disk) never build twice at once nor read a
half-written file. The lock is a small ``.lock`` file left beside the caches.
"""

import fcntl
import os
import socket
import uuid
from collections.abc import Callable

import numpy as np
import torch

from megatron.cli import InputError


def load_or_build(paths: dict[str, str], build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays named by ``paths`` (kind -> .npy path), read-only; ``build()`` makes all kinds when any is missing."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed or torch.distributed.get_rank() == 0:
        _build_if_missing(paths, build)
    if distributed:
        torch.distributed.barrier()
    _build_if_missing(paths, build)  # only does work where rank 0's files are not visible (node-local disks)
    return {kind: _load(path) for kind, path in paths.items()}


def _complete(paths: dict[str, str]) -> bool:
    return all(os.path.isfile(path) for path in paths.values())


def _build_if_missing(paths: dict[str, str], build: Callable[[], dict[str, np.ndarray]]) -> None:
    if _complete(paths):
        return
    lock_path = os.path.commonprefix(list(paths.values())).rstrip("_") + ".lock"
    try:
        lock = open(lock_path, "a")
    except OSError as error:
        raise OSError(
            f"cannot create the index cache beside the data ({lock_path}: {error.strerror}); "
            f"make that directory writable or build the cache once where it is"
        ) from error
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(paths):
            return
        arrays = build()
        for kind, path in paths.items():
            _save_atomically(path, arrays[kind])


def _save_atomically(path: str, values: np.ndarray) -> None:
    """Write under a name unique across hosts and processes, then rename: readers never see half a file."""
    temporary = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "wb") as stream:
            np.save(stream, values)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _load(path: str) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as error:
        raise InputError(f"index cache {path} is unreadable ({error}); delete it to rebuild") from error
