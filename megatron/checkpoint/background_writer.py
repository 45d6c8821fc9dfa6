"""Write a checkpoint's files on background threads while the caller computes the next ones.

    with BackgroundWriter(staging) as files:
        files.submit("layer_02-model_00-model_states.pt", lambda stream: torch.save(state, stream))
        records = files.records()          # every file written, hashed and on disk; raises a failed write's error

torch.save, SHA-256 and file writes release the GIL for large buffers, so the writing threads, the caller's
reading and growing and the disk overlap. Each file is hashed as it is written (RecordedFile); a third thread
then flushes it to disk and drops it from the page cache while the writers go on: publishing needs neither a
second read nor a long final fsync, and a checkpoint larger than RAM does not evict the source being read.
At most `threads` files are held in memory at once; submit() waits for room.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from megatron.checkpoint.manifest import FileRecord, RecordedFile, sync_and_drop


class BackgroundWriter:
    """See the module docstring. Leaving the `with` block waits for running writes and drops queued ones."""

    def __init__(self, directory: Path, threads: int = 2) -> None:
        self._directory = directory
        self._writing = ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-writer")
        self._syncing = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sync")
        self._room = threading.Semaphore(threads)
        self._writes: list[Future[FileRecord]] = []
        self._syncs: list[Future[None]] = []

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exception: object) -> None:
        self._writing.shutdown(wait=True, cancel_futures=True)
        self._syncing.shutdown(wait=True, cancel_futures=True)

    def _write(self, name: str, write: Callable[[BinaryIO], None]) -> FileRecord:
        try:
            with RecordedFile(self._directory, name) as stream:
                write(stream)
            self._syncs.append(self._syncing.submit(sync_and_drop, self._directory / name))
            return stream.record
        finally:
            self._room.release()

    def submit(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        """Write file `name` (relative to the directory) with `write(stream)` on a background thread; raises
        the error of an earlier write that failed."""
        for future in (*self._writes, *self._syncs):
            if future.done():
                future.result()
        self._room.acquire()
        try:
            self._writes.append(self._writing.submit(self._write, name, write))
        except BaseException:
            self._room.release()
            raise

    def records(self) -> dict[str, FileRecord]:
        """The records of every file submitted, once all are written and on disk; raises the first failed
        write's error."""
        records = [future.result() for future in self._writes]  # each queued its sync before returning
        for future in self._syncs:
            future.result()
        return {record.name: record for record in records}
